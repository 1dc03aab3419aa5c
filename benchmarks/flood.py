"""A junk flood from local connections against registered workers' heartbeats.

Prints ONE JSON object; asserts nothing on time. A real daemon (`dynaresized serve`, a
subprocess, SQLite log, loopback TCP without CURVE as a single-node job runs it) serves
`--workers` registered workers (an engine and a trainer per device, raw DEALER sockets in one
process) that beat every `--beat-s` seconds and ask for an answer with every beat. After a
warm-up, `--flooders` processes each open one unauthenticated connection to the worker endpoint
and send junk frames as fast as they can for `--flood-s` seconds, never reading a reply (a
flooder whose connection the daemon cuts connects again, as a DEALER does).

* `ack_silence_max_s`: the longest time any registered worker went without a `heartbeat_ack`
  during the flood (from its previous answer, or the flood's start);
* `heartbeat_rtt_ms` during the flood (p50 / p99 / max, beat to its answer at the worker);
* `workers_lost` and `reregistered`: workers the daemon declared lost, and workers welcomed again;
* `daemon_rss_mib`: at the flood's start, its peak, at its end, and `slope_mib_per_10min` after the
  first 10 s of the flood (a least-squares line through samples every 0.5 s);
* `frames_sent` by the flooders, `junk_refused` (the daemon's decode errors) and
  `connections_cut` (dynaresized_connections_cut_total) from its metrics; `daemon_alive`.

    python benchmarks/flood.py                         # 1 flooder, 60 s, 64 workers
    python benchmarks/flood.py --flooders 8
    python benchmarks/flood.py --flood-s 10 --workers 16   # the CI-sized run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def slope_per_s(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, value) samples."""
    if len(samples) < 2:
        return 0.0
    mt = statistics.fmean(t for t, _ in samples)
    mv = statistics.fmean(v for _, v in samples)
    den = sum((t - mt) ** 2 for t, _ in samples)
    return sum((t - mt) * (v - mv) for t, v in samples) / den if den else 0.0


def metric_sum(url: str, name: str) -> float:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def config_text(state_dir: Path, worker_ep: str, control_ep: str, metrics_port: int, devices: list[str],
                timeout_s: float) -> str:
    return f"""
[daemon]
state_dir = "{state_dir}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = {metrics_port}
heartbeat_interval_s = {timeout_s / 3}
log_format = "json"
log_level = "info"

[cluster]
devices = {json.dumps(devices)}
training = {json.dumps(devices[: len(devices) // 2])}

[core]
heartbeat_timeout_s = {timeout_s}

[policy]
name = "static"
"""


# -- the flooders -----------------------------------------------------------------------------


def flooder(endpoint: str, until: float, out: Any, frame_bytes: int) -> None:
    """Junk frames as fast as the socket takes them on one connection, never reading. A DEALER
    connects again by itself when the daemon cuts it, and goes on."""
    import zmq

    ctx = zmq.Context()
    junk = b"\xff" * frame_bytes
    sent = 0
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.connect(endpoint)
    while time.monotonic() < until:
        for _ in range(1000):
            try:
                sock.send(junk, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                sock.poll(10, zmq.POLLOUT)  # the pipe is full (the daemon reads slower) or cut
                break
    sock.close(0)
    ctx.term()
    out.put({"sent": sent})


# -- the registered workers -------------------------------------------------------------------


def workers_main(endpoint: str, devices: list[str], beat_s: float, flood_at: float, flood_end: float,
                 until: float, ready: Any, out: Any) -> None:
    import zmq

    from dynaresized import wire
    from dynaresized.domain import WorkerKind

    ctx = zmq.Context()
    decoder = wire.daemon_decoder()
    workers = []
    for i, device in enumerate(devices):
        for kind, prefix in ((WorkerKind.ROLLOUT_ENGINE, "eng"), (WorkerKind.TRAINER_RANK, "tr")):
            wid, process = f"{prefix}-{i}", uuid.uuid4().hex
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"{wid}#{process}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            w = {"id": wid, "sock": s, "token": "", "seq": 0, "sent": {}, "acked": None, "welcomes": 0,
                 "silence": 0.0}
            s.send(wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=wid, kind=kind, devices=(device,),
                                          pid=os.getpid(), process=process, secret=secrets.token_hex(16))))
            workers.append(w)
    by_sock = {w["sock"]: w for w in workers}
    poller = zmq.Poller()
    for w in workers:
        poller.register(w["sock"], zmq.POLLIN)
    rtts: list[float] = []
    errors: dict[str, int] = {}

    def receive(timeout_ms: float) -> None:
        for sock, _ in poller.poll(timeout_ms):
            w = by_sock[sock]
            while True:
                try:
                    msg = decoder.decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                now = time.monotonic()
                if type(msg) is wire.Welcome:
                    w["token"] = msg.token
                    w["welcomes"] += 1
                    w["acked"] = now
                elif type(msg) is wire.HeartbeatAck:
                    sent = w["sent"].pop(msg.seq, None)
                    if flood_at <= now <= flood_end + 1.0:
                        gap = now - max(w["acked"] or flood_at, flood_at)
                        w["silence"] = max(w["silence"], gap)
                        if sent is not None:
                            rtts.append(now - sent)
                    w["acked"] = now
                elif type(msg) is wire.Error:
                    key = msg.reason or msg.code.value
                    errors[key] = errors.get(key, 0) + 1

    deadline = time.monotonic() + 30
    while any(not w["token"] for w in workers) and time.monotonic() < deadline:
        receive(50)
    ready.put(sum(bool(w["token"]) for w in workers))
    next_beat = time.monotonic()
    while time.monotonic() < until:
        now = time.monotonic()
        if now >= next_beat:
            for w in workers:
                if w["token"]:
                    w["seq"] += 1
                    w["sent"][w["seq"]] = time.monotonic()
                    if len(w["sent"]) > 64:
                        w["sent"].pop(next(iter(w["sent"])))
                    try:
                        w["sock"].send(wire.encode(wire.Heartbeat(worker_id=w["id"], seq=w["seq"], token=w["token"],
                                                                  ack=True)), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
            next_beat += beat_s
        receive(max(0.0, min(50.0, (next_beat - time.monotonic()) * 1000)))
    end = time.monotonic()
    for w in workers:  # a worker still unanswered at the end: its silence runs to the flood's end
        if w["acked"] is not None and w["acked"] < flood_end:
            w["silence"] = max(w["silence"], min(end, flood_end + 1.0) - max(w["acked"], flood_at))
    out.put({"rtts": rtts, "errors": errors, "silence_max": max((w["silence"] for w in workers), default=None),
             "reregistered": sum(w["welcomes"] > 1 for w in workers), "registered": len(workers)})
    for w in workers:
        w["sock"].close(0)
    ctx.term()


def config_control(cfg: Path) -> str:
    import tomllib

    return tomllib.loads(cfg.read_text())["daemon"]["control_endpoint"]


def workers_lost(state_dir: Path) -> int:
    """WorkerLost facts in the daemon's log."""
    from dynaresized.core import facts as f
    from dynaresized.store import open_recorder

    recorder = open_recorder(state_dir / "events.sqlite", read_only=True)
    try:
        return sum(type(f.decode_fact(e.data)) is f.WorkerLost for e in recorder.read_all())
    finally:
        recorder.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=64, help="registered workers (an engine and a trainer per device)")
    ap.add_argument("--flooders", type=int, default=1, help="unauthenticated connections flooding")
    ap.add_argument("--flood-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--beat-s", type=float, default=0.25, help="each worker's heartbeat interval (an ack asked each)")
    ap.add_argument("--timeout-s", type=float, default=3.0, help="the daemon's heartbeat timeout")
    ap.add_argument("--frame-bytes", type=int, default=64, help="size of each junk frame")
    args = ap.parse_args()

    devices = [f"node{i // 8}:gpu{i % 8}" for i in range(max(1, args.workers // 2))]
    tmp = Path(tempfile.mkdtemp(prefix="dynaresized-flood-"))
    worker_ep = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    cfg = tmp / "config.toml"
    cfg.write_text(config_text(tmp / "state", worker_ep, f"tcp://127.0.0.1:{free_port()}", metrics_port, devices,
                               args.timeout_s))
    log = (tmp / "daemon.log").open("wb")
    daemon = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(cfg)],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    from dynaresized import wire
    from dynaresized.control import control_request

    control_ep = config_control(cfg)
    deadline = time.monotonic() + 30
    while True:
        try:
            control_request(control_ep, wire.StatusRequest(), timeout_s=0.5)
            break
        except TimeoutError:
            if time.monotonic() > deadline or daemon.poll() is not None:
                print(json.dumps({"error": "the daemon did not start", "log": str(tmp / "daemon.log")}))
                return 1
    ready, out = mp.Queue(), mp.Queue()
    procs: list[mp.Process] = []
    flood_at = time.monotonic() + 10 + args.warmup_s  # registration takes well under 10 s at this size
    flood_end = flood_at + args.flood_s
    until = flood_end + 3.0
    wp = mp.Process(target=workers_main, args=(worker_ep, devices, args.beat_s, flood_at, flood_end, until, ready, out))
    wp.start()
    registered = ready.get(timeout=40)
    while time.monotonic() < flood_at:
        time.sleep(0.05)
    refused0 = metric_sum(metrics_url, "dynaresized_decode_errors_total")
    fq: Any = mp.Queue()
    for _ in range(args.flooders):
        p = mp.Process(target=flooder, args=(worker_ep, flood_end, fq, args.frame_bytes))
        p.start()
        procs.append(p)
    samples: list[tuple[float, float]] = []
    rss_start = rss_mib(daemon.pid)
    while time.monotonic() < flood_end:
        if daemon.poll() is not None:
            break
        samples.append((time.monotonic() - flood_at, rss_mib(daemon.pid)))
        time.sleep(0.5)
    sent = [fq.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    result = out.get(timeout=30)
    wp.join(timeout=10)
    alive = daemon.poll() is None
    refused = metric_sum(metrics_url, "dynaresized_decode_errors_total") - refused0
    cut = metric_sum(metrics_url, "dynaresized_connections_cut_total")
    if alive:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    log.close()
    lost = workers_lost(tmp / "state")
    after = [(t, v) for t, v in samples if t >= 10.0]
    rtts = result["rtts"]
    print(json.dumps({
        "workers": registered, "flooders": args.flooders, "flood_s": args.flood_s, "frame_bytes": args.frame_bytes,
        "ack_silence_max_s": None if result["silence_max"] is None else round(result["silence_max"], 3),
        "heartbeat_rtt_ms": {"p50": round((percentile(rtts, 0.5) or 0) * 1000, 2),
                             "p99": round((percentile(rtts, 0.99) or 0) * 1000, 2),
                             "max": round(max(rtts, default=0) * 1000, 2), "count": len(rtts)},
        "workers_lost": lost, "reregistered": result["reregistered"],
        "daemon_rss_mib": {"start": round(rss_start, 1), "peak": round(max((v for _, v in samples), default=0), 1),
                           "end": round(samples[-1][1], 1) if samples else None,
                           "slope_mib_per_10min": round(slope_per_s(after) * 600, 2)},
        "frames_sent": sum(s["sent"] for s in sent),
        "junk_refused": refused, "connections_cut": cut, "worker_errors": result["errors"],
        "daemon_alive": alive, "load_avg_1m": round(os.getloadavg()[0], 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
