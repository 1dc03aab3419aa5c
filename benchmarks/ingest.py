"""How fast the daemon ingests worker messages over loopback TCP, beside the ceiling.

Prints one JSON object:
* `daemon`: messages/s the real daemon (subprocess, SQLite log with synchronous=FULL) turns into
  recorded facts, from several client processes; p50/p99 latency from a client's send to the
  fact's `recorded_at` in the log. The messages are `queue_empty` reports, one fact each
  (`progress` reports were, until they became soft state on 5 December 2026).
* `ceiling`: the same clients against a bare pyzmq ROUTER + msgspec decode loop.
* `heartbeats`: CPU share of one core the daemon spends on N workers heartbeating at 1 Hz.

    python benchmarks/ingest.py [--clients 4] [--messages 20000] [--idle-workers 1000] [--idle-seconds 20]
    python benchmarks/ingest.py --only heartbeats   # the idle cost alone (what profiling it needs)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from dynaresized import wire
from dynaresized.domain import WorkerKind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, state_dir: Path, worker_ep: str, control_ep: str, n_devices: int) -> None:
    devices = [f"node{i // 8}:gpu{i % 8}" for i in range(n_devices)]
    path.write_text(f"""
[daemon]
state_dir = "{state_dir}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = 0
log_format = "json"
log_level = "warning"
snapshot_every = 100000
[cluster]
devices = {json.dumps(devices)}
training = {json.dumps(devices[: n_devices // 2])}
[policy]
name = "static"
[core]
heartbeat_timeout_s = 30
""")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(endpoint: str, index: int, workers: int, messages: int, start_evt, out_q, register: bool) -> None:
    """One process; `workers` DEALER sockets each register, then send queue_empty reports
    (`running` numbers them)."""
    ctx = zmq.Context()
    socks = []
    decoder = wire.daemon_decoder()
    for w in range(workers):
        wid = f"bench-{index}-{w}"
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, wid.encode())
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(endpoint)
        device = f"node{(index * workers + w) // 8}:gpu{(index * workers + w) % 8}"
        token = ""
        if register:
            s.send(wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=wid,
                                          kind=WorkerKind.ROLLOUT_ENGINE, devices=(device,))))
            assert s.poll(10000), "no welcome"
            reply = decoder.decode(s.recv())
            assert isinstance(reply, wire.Welcome), reply
            token = reply.token  # every later message of the registration carries it
        socks.append((wid, s, token))
    start_evt.wait()
    sent: list[tuple[str, int, float]] = []
    per = messages // workers
    for i in range(per):
        for wid, s, token in socks:
            now = time.time()
            s.send(wire.encode(wire.QueueEmpty(worker_id=wid, step=1, running=i, sent_at=now, token=token)))
            sent.append((wid, i, now))
    out_q.put(sent)
    time.sleep(1.0)
    for _, s, _ in socks:
        s.close()
    ctx.term()


def _ceiling(endpoint: str, expected: int, out_q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.RCVHWM, 0)
    s.bind(endpoint)
    decoder = wire.worker_decoder()
    got: dict[tuple[str, int], float] = {}
    first = None
    while len(got) < expected:
        if not s.poll(20000):
            break
        _, payload = s.recv_multipart()
        msg = decoder.decode(payload)
        now = time.time()
        first = first or now
        got[(msg.worker_id, msg.done)] = now
    out_q.put((got, first, time.time()))
    s.close()
    ctx.term()


def _percentiles(latencies: list[float]) -> dict[str, float]:
    latencies.sort()
    if not latencies:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"p50_ms": round(latencies[len(latencies) // 2] * 1e3, 3),
            "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1e3, 3)}


def run_clients(endpoint: str, clients: int, workers: int, messages: int, register: bool):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    start_evt, out_q = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(endpoint, i, workers, messages // clients, start_evt, out_q, register))
             for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.05 * clients * workers)  # let everyone register
    t0 = time.time()
    start_evt.set()
    sent = []
    for _ in procs:
        sent.extend(out_q.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
    return t0, sent


def bench_ceiling(clients: int, workers: int, messages: int) -> dict[str, float]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    total = (messages // clients // workers) * workers * clients
    server = ctx.Process(target=_ceiling, args=(endpoint, total, out_q))
    server.start()
    time.sleep(0.5)
    cpu0 = cpu_seconds(server.pid)
    t0, sent = run_clients(endpoint, clients, workers, messages, register=False)
    got, first, last = out_q.get(timeout=300)
    cpu1 = cpu_seconds(server.pid)
    server.join(timeout=30)
    lat = [got[(w, i)] - ts for w, i, ts in sent if (w, i) in got]
    return {"messages": len(got), "messages_per_s": round(len(got) / max(last - t0, 1e-9)),
            "cpu_us_per_message": round((cpu1 - cpu0) / max(len(got), 1) * 1e6, 2), **_percentiles(lat)}


def start_daemon(tmp: Path, n_devices: int) -> tuple[subprocess.Popen[bytes], str, str]:
    worker_ep, control_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp / "config.toml"
    write_config(cfg, tmp / "state", worker_ep, control_ep, n_devices)
    proc = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from dynaresized.control import control_request

    for _ in range(200):
        try:
            control_request(control_ep, wire.StatusRequest(), 0.2)
            break
        except TimeoutError:
            continue
    return proc, worker_ep, control_ep


def bench_daemon(clients: int, workers: int, messages: int) -> dict[str, float]:
    from dynaresized.store import open_recorder

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, worker_ep, _ = start_daemon(tmp, max(clients * workers, 2))
        try:
            cpu0 = cpu_seconds(proc.pid)
            t0, sent = run_clients(worker_ep, clients, workers, messages, register=True)
            expected = {(w, i) for w, i, _ in sent}
            rec = open_recorder(tmp / "state" / "events.sqlite", read_only=True)
            recorded: dict[tuple[str, int], float] = {}
            deadline = time.time() + 120
            position = 0
            while len(recorded) < len(expected) and time.time() < deadline:
                for e in rec.read_all(after_position=position, types={"engine_queue_empty"}):
                    position = e.position
                    fact = msgspec.msgpack.decode(e.data)
                    recorded[(fact["worker_id"], fact["running"])] = e.recorded_at
                time.sleep(0.2)
            rec.close()
            cpu1 = cpu_seconds(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    last = max(recorded.values()) if recorded else t0
    lat = [recorded[(w, i)] - ts for w, i, ts in sent if (w, i) in recorded]
    return {"messages": len(recorded), "lost": len(expected) - len(recorded),
            "messages_per_s": round(len(recorded) / max(last - t0, 1e-9)),
            "cpu_us_per_message": round((cpu1 - cpu0) / max(len(recorded), 1) * 1e6, 2), **_percentiles(lat)}


def _heartbeaters(endpoint: str, index: int, count: int, seconds: float, ready_q) -> None:
    ctx = zmq.Context()
    socks = []
    for w in range(count):
        wid = f"hb-{index}-{w}"
        n = index * count + w
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, wid.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send(wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=wid, kind=WorkerKind.TRAINER_RANK,
                                      devices=(f"node{n // 8}:gpu{n % 8}",))))
        socks.append((wid, s))
    decoder = wire.daemon_decoder()
    tokens = {}
    for wid, s in socks:
        assert s.poll(30000)
        welcome = decoder.decode(s.recv())
        assert isinstance(welcome, wire.Welcome), welcome
        tokens[wid] = welcome.token
    ready_q.put(index)
    end = time.monotonic() + seconds
    seq = 0
    while time.monotonic() < end:
        tick = time.monotonic()
        seq += 1
        for wid, s in socks:
            s.send(wire.encode(wire.Heartbeat(worker_id=wid, seq=seq, token=tokens[wid])))
            while s.poll(0):
                s.recv()
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    for _, s in socks:
        s.close()
    ctx.term()


def bench_heartbeats(workers: int, seconds: float, procs: int = 4) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        proc, worker_ep, _ = start_daemon(Path(d), workers)
        ctx = mp.get_context("spawn")
        ready_q = ctx.Queue()
        ps = [ctx.Process(target=_heartbeaters, args=(worker_ep, i, workers // procs, seconds + 4, ready_q))
              for i in range(procs)]
        try:
            for p in ps:
                p.start()
            for _ in ps:
                ready_q.get(timeout=120)
            time.sleep(2.0)  # settle
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(seconds)
            c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        finally:
            for p in ps:
                p.join(timeout=seconds + 30)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return {"workers": workers, "hz": 1.0, "seconds": round(t1 - t0, 2),
            "daemon_cpu_share_of_one_core": round((c1 - c0) / (t1 - t0), 4)}


def _median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The round with the median throughput (a whole round, so its numbers belong together)."""
    ordered = sorted(rounds, key=lambda r: r["messages_per_s"])
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers-per-client", type=int, default=4)
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--idle-workers", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved ceiling/daemon rounds; medians are reported (other load on the "
                             "machine hits one round, not all)")
    parser.add_argument("--only", choices=("heartbeats",), default=None,
                        help="run only this part and print its result")
    args = parser.parse_args()
    if args.only == "heartbeats":
        print(json.dumps({"benchmark": "ingest", "machine": {"cpus": os.cpu_count()},
                          "heartbeats": bench_heartbeats(args.idle_workers, args.idle_seconds),
                          "targets": {"heartbeats_cpu_share": "<= 0.05"}}))
        return
    ceilings, daemons = [], []
    for _ in range(args.rounds):
        ceilings.append(bench_ceiling(args.clients, args.workers_per_client, args.messages))
        daemons.append(bench_daemon(args.clients, args.workers_per_client, args.messages))
    ceiling, daemon = _median_round(ceilings), _median_round(daemons)
    heartbeats = bench_heartbeats(args.idle_workers, args.idle_seconds)
    result = {
        "benchmark": "ingest",
        "machine": {"cpus": os.cpu_count()},
        "clients": args.clients, "workers_per_client": args.workers_per_client,
        "ceiling": ceiling,
        "daemon": daemon,
        "daemon_vs_ceiling": round(daemon["messages_per_s"] / max(ceiling["messages_per_s"], 1), 3),
        "rounds": {"ceiling_messages_per_s": [r["messages_per_s"] for r in ceilings],
                   "daemon_messages_per_s": [r["messages_per_s"] for r in daemons]},
        "heartbeats": heartbeats,
        "targets": {"daemon_vs_ceiling": ">= 0.5", "daemon_messages_per_s": ">= 30000",
                    "heartbeats_cpu_share": "<= 0.05"},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
