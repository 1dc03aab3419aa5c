"""A long run of one daemon under a busy job, a junk flood and a chatty worker: does anything drift?

Prints ONE JSON object; asserts nothing on time. A real daemon (`dynaresized serve`, a subprocess,
SQLite log, loopback TCP without CURVE) serves the light workers of benchmarks/scale.py
(`--hosts` processes of raw DEALER sockets, an engine and a trainer per device, each with its own
identity, hello, token and heartbeats as our client beats; engines reporting progress once a
second; trainer 0 reporting 8 mini-batches and a step every `--step-s` seconds; every op answered
at once) under the hysteresis policy with its guards opened, so that every imbalanced step report
starts a resize, and lending, with loans that cost next to nothing: each engine reports its queue
empty for the next rollout step in the second half of every step, while the training step runs,
and the policy lends the idle engines to it (they come home at the step report). For the whole
`--duration-s` after registration, two misbehaving peers run beside the job:

* a flood: `--flooders` (1) unauthenticated DEALERs sending `--frame-bytes` junk frames as fast
  as they can, never reading (benchmarks/flood.py's `flooder`; cut by the daemon's junk budget,
  a DEALER connects again by itself);
* a chatty worker: a registered engine (the last device's) sending the same `queue_empty` for
  its step `--chatty-per-s` times a second, far above `daemon.report_rate`.

(`--flooders 0` and `--chatty-per-s 0` leave either out: to tell what a drift comes from.)

What it reports:

* `ack_silence_max_s`: the longest time any registered worker went without an answer
  (a heartbeat_ack, or a welcome when it had to register again) during the run, against
  `core.heartbeat_timeout_s`; `heartbeat_rtt_ms` during the flood (p50 / p99 / max);
* `rss_mib`: the daemon's RSS at the start, its peak, at the end, and `slope_mib_per_10min`, a
  least-squares line through samples every `--sample-s` after `--warmup-s`, and a sample a
  minute (`by_minute`); `daemon_cpu_share`;
* `log_bytes_per_hour` (the facts written during the run, scaled, at the log's bytes per fact);
  `replay_s`: the replay of the retained log as the daemon does it at start (its latest snapshot,
  then the facts after it: benchmarks/scale.py's `replay_run_s`), with `replay_hour_s`;
* `workers_lost` during the run (and after it: once the hosts stop, a resize in flight loses
  its targets), `live_at_end`, `resizes_committed`, `loans_started` and `loans_landed`, and
  `loan_returns` (each takes every device lent in a step home at its step report);
* `refusals_by_reason`: the daemon's `dynaresized_refusals_total{reason}`,
  `dynaresized_decode_errors_total{kind}` and `dynaresized_connections_cut_total{reason}`;
  `worker_errors`, the refusals the workers received;
* `daemon_alive` at the end, `load_avg_1m` (mean and max over the run: the machine is shared),
  and the parameters.

    python benchmarks/soak.py                                 # 1,024 devices, 30 minutes
    python benchmarks/soak.py --devices 128 --duration-s 60   # the CI-sized run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parent
COUNTERS = {"dynaresized_refusals_total": "refusals", "dynaresized_decode_errors_total": "decode_errors",
            "dynaresized_connections_cut_total": "connections_cut"}


def benchmark(name: str) -> ModuleType:
    """A benchmark script beside this one, loaded by its path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scale, flood = benchmark("scale"), benchmark("flood")


def counters(metrics_url: str) -> dict[str, dict[str, float]] | None:
    """`COUNTERS` from the daemon's Prometheus endpoint, each by its label's value; None if it
    does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {short: {} for short in COUNTERS.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                out[COUNTERS[sample.name]][",".join(sample.labels.values()) or "all"] = sample.value
    return out


def soak(n: int, hosts: int, duration_s: float, warmup_s: float, sample_s: float, step_s: float,
         flooders: int, chatty_per_s: float, frame_bytes: int, tmp: Path) -> dict[str, Any]:
    from dynaresized.core import facts as fx
    from dynaresized.daemon.config import CoreSection, DaemonSection

    state_dir = tmp / "state"
    worker_ep, control_ep = f"tcp://127.0.0.1:{scale.free_port()}", f"tcp://127.0.0.1:{scale.free_port()}"
    metrics_port = scale.free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    config = scale.config_text(state_dir, worker_ep, control_ep, n, metrics_port=metrics_port, lending=True)
    hosts = max(1, min(hosts, n))
    chatty = f"eng-{n - 1}"
    measure = tmp / "measure"
    rss: list[tuple[float, float]] = []  # (seconds into the run, MiB)
    loads: list[float] = []
    with scale.serving(tmp, config, worker_ep, control_ep, n, hosts, step_s, queue_empty=True, chatty=chatty,
                       chatty_per_s=chatty_per_s, measure=str(measure)) as served:
        daemon = served.daemon
        w0, t0 = time.monotonic(), time.time()
        c0 = scale.proc_cpu_s(daemon.pid)
        flooded: Any = mp.Queue()
        flooding = [mp.Process(target=flood.flooder, args=(worker_ep, w0 + duration_s, flooded, frame_bytes))
                    for _ in range(flooders)]
        for p in flooding:
            p.start()
        measure.touch()  # the hosts count RTTs and silences from here: the flood has begun
        while time.monotonic() - w0 < duration_s and daemon.poll() is None:
            rss.append((time.monotonic() - w0, scale.proc_rss_mib(daemon.pid)))
            loads.append(os.getloadavg()[0])
            time.sleep(min(sample_s, max(0.0, duration_s - (time.monotonic() - w0))))
        alive = daemon.poll() is None
        w1, t1 = time.monotonic(), time.time()
        cpu_s = scale.proc_cpu_s(daemon.pid) - c0 if alive else None
        if alive:
            rss.append((w1 - w0, scale.proc_rss_mib(daemon.pid)))
        refusals = counters(metrics_url) if alive else None
        st = scale.status(control_ep, 30.0) if alive else None
        if not alive:  # the run ended early: so do the flooders, whose count is lost
            for p in flooding:
                p.kill()
        frames_sent = sum(flooded.get(timeout=60)["sent"] for _ in flooding) if alive else None
        for p in flooding:
            p.join(timeout=10)
    results = scale.host_results(tmp, hosts)
    rtts = [x for r in results for x in r["rtts"]]

    rows, facts, bytes_per_fact = scale.read_log(state_dir)
    in_run = sum(t0 <= e.recorded_at <= t1 for e in rows)
    lost, lost_after = scale.workers_lost(rows, facts, t1)

    def count(kind: type) -> int:
        return sum(isinstance(x, kind) for x in facts)

    replay = scale.bench_replay(state_dir / "events.sqlite")
    after = [(t, v) for t, v in rss if t >= warmup_s]
    daemon_limits, core_limits = DaemonSection(), CoreSection()
    return {
        "benchmark": "soak",
        "devices": n, "workers": 2 * n, "hosts": hosts, "duration_s": round(w1 - w0, 1), "warmup_s": round(warmup_s, 1),
        "step_s": step_s, "chatty_worker": chatty, "chatty_per_s": chatty_per_s, "flooders": flooders,
        "frame_bytes": frame_bytes,
        "sample_s": sample_s, "register_s": round(served.registered_s, 1),
        "daemon_limits": {"report_rate": daemon_limits.report_rate, "report_burst": daemon_limits.report_burst,
                          "junk_budget": daemon_limits.junk_budget, "junk_window_s": daemon_limits.junk_window_s,
                          "heartbeat_timeout_s": core_limits.heartbeat_timeout_s},
        "daemon_alive": alive,
        "ack_silence_max_s": round(max(r["ack_silence_max_s"] for r in results), 3),
        "heartbeat_rtt_ms": {"p50": round((scale.percentile(rtts, 0.5) or 0) * 1000, 1),
                             "p99": round((scale.percentile(rtts, 0.99) or 0) * 1000, 1),
                             "max": round(max(rtts, default=0) * 1000, 1), "acks": len(rtts)},
        "rss_mib": {"start": round(rss[0][1], 1) if rss else None,
                    "peak": round(max(v for _, v in rss), 1) if rss else None,
                    "end": round(rss[-1][1], 1) if rss else None,
                    "slope_mib_per_10min": round(flood.slope_per_s(after) * 600, 2), "samples_after_warmup": len(after),
                    "by_minute": [round(v, 1) for t, v in rss if t % 60 < sample_s]},
        "daemon_cpu_share": None if cpu_s is None else round(cpu_s / (w1 - w0), 3),
        "log_bytes_per_hour": round(in_run / (t1 - t0) * 3600 * bytes_per_fact),
        "log_bytes_per_fact": round(bytes_per_fact, 1), "facts_per_s": round(in_run / (t1 - t0), 1),
        "replay_s": replay["replay_run_s"], **{k: v for k, v in replay.items() if k != "replay_run_s"},
        "workers_lost": lost, "workers_lost_after_run": lost_after,
        "live_at_end": None if st is None else sum(w["status"] == "live" for w in st["workers"]),
        "resizes_started": count(fx.ResizeStarted), "resizes_committed": count(fx.ResizeCommitted),
        "loans_started": count(fx.LoanStarted), "loans_landed": count(fx.LoanLanded),
        "loan_returns": count(fx.LoanReturned),
        "refusals_by_reason": refusals,
        "worker_errors": scale.worker_errors(results),
        "flood_frames_sent": frames_sent,
        "chatty_reports_sent": sum(r["chatty_sent"] for r in results),
        "queue_empty_sent": sum(r["queue_empty_sent"] for r in results),
        "load_avg_1m": {"mean": round(sum(loads) / len(loads), 2) if loads else None,
                        "max": round(max(loads), 2) if loads else None},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1024, help="devices (an engine and a trainer each)")
    parser.add_argument("--duration-s", type=float, default=1800.0, help="seconds of the run after registration")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds before the RSS slope counts (default: half the run, at most 900: at "
                             "1,024 devices the daemon's native buffers take about 15 minutes to reach their level)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="the daemon's RSS sampled this often")
    parser.add_argument("--hosts", type=int, default=4, help="worker host processes")
    parser.add_argument("--step-s", type=float, default=scale.STEP_S, help="the job's RL step, wall seconds")
    parser.add_argument("--chatty-per-s", type=float, default=500.0, help="the chatty engine's queue_empty reports a second")
    parser.add_argument("--flooders", type=int, default=1, help="unauthenticated connections flooding junk")
    parser.add_argument("--frame-bytes", type=int, default=64, help="size of each junk frame")
    args = parser.parse_args()
    warmup_s = args.warmup_s if args.warmup_s is not None else min(900.0, args.duration_s / 2)
    scale.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="dynaresized-soak-") as d:
        result = soak(args.devices, args.hosts, args.duration_s, warmup_s, args.sample_s, args.step_s,
                      args.flooders, args.chatty_per_s, args.frame_bytes, Path(d))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
