"""A chatty engine against a resize in flight: how much longer an operator's resize takes while
one registered engine sends the same `queue_empty` as fast as it can.

Prints ONE JSON object; asserts nothing on time. A real daemon (`dynaresized serve`, SQLite log,
loopback TCP) with `--devices` devices, an engine and a trainer on each (our `WorkerClient`,
every op answered at once), is resized back and forth by the operator (`resize`), `--resizes`
times without the flood and as many times while an engine (the last device's, which no resize
moves) sends `--reports` identical `queue_empty` of one step at full speed:

* `resize_s`: each resize from the request to `committed` in `status`, median and max, quiet
  and during the flood, and `extra_s` = the medians' difference;
* `queue_empty_facts`: `engine_queue_empty_observed` facts the flood wrote (a repeat writes
  none), `rate_limited` (refused past `daemon.report_rate`), `reports_sent`.

    python benchmarks/chatty.py                  # 4 devices, 5 + 5 resizes, 40,000 reports
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, label: str = "") -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


async def resize_once(control_ep: str, secret: bytes, target: tuple[int, int]) -> float:
    from dynaresized import wire
    from dynaresized.control import control_request

    before = control_request(control_ep, wire.StatusRequest(), timeout_s=5).data["resizes"]["committed"]
    t0 = time.monotonic()
    reply = control_request(control_ep, wire.ResizeRequest(train=target[0], rollout=target[1], reason="chatty"),
                            timeout_s=5, secret=secret)
    if not reply.ok:
        raise RuntimeError(f"resize refused: {reply.message}")
    while time.monotonic() - t0 < 60:
        status = control_request(control_ep, wire.StatusRequest(), timeout_s=5).data
        if status["resizes"]["committed"] > before and status["phase"] == "steady":
            return time.monotonic() - t0
        await asyncio.sleep(0.005)
    raise RuntimeError(f"the resize to {target} did not commit within 60 s: {status['resizes']}")


def chatty_main(endpoint: str, device: str, reports: int, go: Any, stop: Any, out: Any) -> None:
    """The chatty engine, in a process of its own (the other workers' answers must not wait for
    it): registers, then on `go` sends `reports` identical `queue_empty` as fast as it can."""
    import logging

    import structlog

    from dynaresized.client import WorkerClient
    from dynaresized.domain import OpKind, WorkerKind

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

    async def main() -> None:
        c = WorkerClient(endpoint, f"rollout-engine-{device.replace(':', '-')}", WorkerKind.ROLLOUT_ENGINE, (device,))

        async def ok(op: Any) -> str:
            return "done"

        c.on_all({k: ok for k in OpKind})  # it commits with the rest of its pool
        await c.start()
        out.put("registered")
        while not go.is_set():
            await asyncio.sleep(0.01)
        sent = 0
        while sent < reports and not stop.is_set():
            await c.report_queue_empty(step=7)
            sent += 1
            if sent % 200 == 0:
                await asyncio.sleep(0)
        out.put(sent)
        await c.close()

    asyncio.run(main())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from dynaresized.client import WorkerClient
    from dynaresized.control import read_control_secret
    from dynaresized.core import facts as f
    from dynaresized.domain import OpKind, WorkerKind
    from dynaresized.store import open_recorder

    devices = [f"node0:gpu{i}" for i in range(args.devices)]
    tmp = Path(tempfile.mkdtemp(prefix="dynaresized-chatty-"))
    worker_ep, control_ep, metrics_port = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                                           free_port())
    half = args.devices // 2
    (tmp / "config.toml").write_text(f"""
[daemon]
state_dir = "{tmp / 'state'}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = {metrics_port}
log_format = "json"
log_level = "info"

[cluster]
devices = {json.dumps(devices)}
training = {json.dumps(devices[:half])}

[policy]
name = "static"
""")
    log = (tmp / "daemon.log").open("wb")
    daemon = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(tmp / "config.toml")],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    clients: list[WorkerClient] = []
    try:
        for _ in range(200):
            try:
                metric(url, "dynaresized_")
                break
            except OSError:
                await asyncio.sleep(0.1)

        async def ok(op: Any) -> str:
            return "done"

        go, stop, out = mp.Event(), mp.Event(), mp.Queue()
        chatty = mp.Process(target=chatty_main, args=(worker_ep, devices[-1], args.reports, go, stop, out))
        chatty.start()
        out.get(timeout=30)
        for d in devices:
            for kind in WorkerKind:
                if (kind, d) == (WorkerKind.ROLLOUT_ENGINE, devices[-1]):
                    continue  # the chatty engine's
                c = WorkerClient(worker_ep, f"{kind.value}-{d.replace(':', '-')}", kind, (d,))
                c.on_all({k: ok for k in OpKind})
                await c.start()
                clients.append(c)
        secret = read_control_secret(tmp / "state")
        # back and forth: one device of the first half's edge moves; the chatty engine's never does
        targets = [(half - 1, args.devices - half + 1), (half, args.devices - half)]
        quiet = [await resize_once(control_ep, secret, targets[i % 2]) for i in range(args.resizes)]
        done = args.resizes
        go.set()
        await asyncio.sleep(0.2)
        during = []
        for i in range(args.resizes):
            if not chatty.is_alive() or not out.empty():
                break  # the flood is over
            during.append(await resize_once(control_ep, secret, targets[(done + i) % 2]))
        stop.set()
        sent = out.get(timeout=60)
        chatty.join(timeout=30)
        limited = metric(url, "dynaresized_refusals_total", 'reason="rate_limited"')
    finally:
        for c in clients:
            await c.close()
        daemon.terminate()
        daemon.wait(timeout=30)
        log.close()
    recorder = open_recorder(tmp / "state" / "events.sqlite", read_only=True)
    try:
        dry = sum(type(f.decode_fact(e.data)) is f.EngineQueueEmptyObserved for e in recorder.read_all())
    finally:
        recorder.close()
    q, d = statistics.median(quiet), statistics.median(during) if during else None
    return {"devices": args.devices, "resizes": args.resizes,
            "resize_s": {"quiet": {"median": round(q, 4), "max": round(max(quiet), 4)},
                         "during": {"median": None if d is None else round(d, 4),
                                    "max": round(max(during), 4) if during else None, "count": len(during)}},
            "extra_s": None if d is None else round(d - q, 4),
            "reports_sent": sent, "queue_empty_facts": dry, "rate_limited": limited,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    import logging

    import structlog

    # the client logs every refusal it gets: tens of thousands here, not part of the result
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--resizes", type=int, default=5)
    ap.add_argument("--reports", type=int, default=40_000)
    print(json.dumps(asyncio.run(run(ap.parse_args()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
