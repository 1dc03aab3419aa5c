"""What one daemon costs as the cluster grows: the cost curve over the number of devices.

Prints ONE JSON object; asserts nothing on time. For each device count N (default 8, 64, 512,
1,024 and 4,096), with an engine and a trainer per device (2N workers):

* `core_step_us`: `Core.step()` in this process, per event (p50 / p99 over a realistic mix:
  every worker's heartbeat and every engine's progress once a second, ticks, mini-batch reports,
  a step report a step and the ops of the resizes it starts, all acknowledged), and the core's
  work per step report (its step time, facts and commands);
* the real daemon (`dynaresized serve`, a subprocess, SQLite log, the hysteresis policy with its
  guards opened so that every imbalanced step report starts a resize) serving light workers:
  `--hosts` processes of raw DEALER sockets, one per worker, each with its own identity, hello,
  token and secret, heartbeating as our client does at the default interval (1 s: a beat in
  every second with no other message, an answer asked for once the last is 2.5 s old), engines
  reporting progress once a second, trainer 0 reporting 8 mini-batches and a step every `--step-s` seconds, every op
  answered at once. Over a `--window` of steady state:
  - `daemon_cpu_share` (of one core, all its threads) and `daemon_rss_mib`;
  - `decision_latency_ms` (p50 / p99): from the step report's send at trainer 0 to the first op
    of the resize it started arriving at a worker (send, ingress, core, policy, the fsync of the
    facts, the op's send: what a job waits for);
  - `heartbeat_rtt_ms` (p50 / p99 / max, heartbeat to its ack at the worker) and the workers the
    daemon declared lost in the window: the daemon "keeps every heartbeat within its timeout" when none
    is (`workers_lost_after_window`: those lost once the hosts stopped);
  - `log_bytes_per_hour` (the log's growth over the window, scaled), and `replay_hour_s`: the
    replay of an hour's log as the daemon does it at start (its latest snapshot, then the facts
    after it: at most `snapshot_every` of them), measured at its worst case: the snapshot decoded
    and `snapshot_every` facts of this run's own log read and folded;
* `simulate_s`: wall time of `dynaresized simulate --scenario longtail-stationary --steps 200
  --gpus N` (bounded by `--simulate-timeout`; null and `simulate_timed_out` beyond it).

    python benchmarks/scale.py                              # 8, 64, 512, 1024, 4096 (~20 min)
    python benchmarks/scale.py --devices 4096 --window 20   # one point
    python benchmarks/scale.py --plot docs/scale.png        # and the curve as a PNG

Each point also reports the load average, since the machine is shared: CPU shares are of one
core and are what the daemon used, whatever else ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import heapq
import math
import os
import random
import resource
import secrets
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve()
STEP_S = 6.0  # the job's RL step, wall seconds (real steps take minutes: this is a busy job)
MINI_BATCHES = 8
PROGRESS_S = 1.0  # each engine's progress report interval
HEARTBEAT_S = 1.0  # the daemon's default heartbeat interval
HEARTBEAT_TIMEOUT_S = 10.0  # and timeout


def device_names(n: int) -> list[str]:
    return [f"node{i // 8}:gpu{i % 8}" for i in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the core alone ---------------------------------------------------------------------------


def bench_core(n: int, max_events: int) -> dict[str, Any]:
    """Time `Core.step()` per event over the workload the daemon sees, in virtual time."""
    from dynaresized.core import ClusterState, Core, CoreConfig
    from dynaresized.core import events as ev
    from dynaresized.core.policy import load_policy
    from dynaresized.domain import Pool, WorkerKind

    devices = device_names(n)
    core = Core(CoreConfig(guards=open_guards(), heartbeat_timeout_s=10.0, op_resend_s=2.0),
                load_policy("hysteresis", {"lending": False}))
    state = ClusterState()
    times: dict[str, list[float]] = {}
    step_work: list[dict[str, float]] = []
    acks: list[ev.OpReported] = []
    count = 0

    def feed(event: ev.Event) -> None:
        nonlocal state, count
        t0 = time.perf_counter_ns()
        state, facts, commands = core.step(state, event)
        dt = (time.perf_counter_ns() - t0) / 1000
        times.setdefault(type(event).__name__, []).append(dt)
        count += 1
        if isinstance(event, ev.StepReported):
            step_work.append({"us": dt, "facts": len(facts), "commands": len(commands)})
        for c in commands:
            op = getattr(c, "op", None)
            if op is not None:
                acks.append(ev.OpReported(at=event.at, worker_id=c.worker_id, op_id=op.op_id, ok=True))

    pools = tuple(Pool.TRAINING if i < n // 2 else Pool.ROLLOUT for i in range(n))
    feed(ev.Configure(at=0.0, devices=tuple(devices), pools=pools))
    engines = [f"eng-{i}" for i in range(n)]
    trainers = [f"tr-{i}" for i in range(n)]
    for i, d in enumerate(devices):
        feed(ev.WorkerHello(at=0.1, worker_id=engines[i], kind=WorkerKind.ROLLOUT_ENGINE, devices=(d,)))
        feed(ev.WorkerHello(at=0.1, worker_id=trainers[i], kind=WorkerKind.TRAINER_RANK, devices=(d,)))
    for k in list(times):
        times[k].clear()
    count = 0
    t, step = 1.0, 0
    while count < max_events:
        for sub in range(int(STEP_S)):  # one virtual second per round
            now = t + sub
            for w in range(2 * n):
                feed(ev.Heartbeat(at=now + w / (2 * n), worker_id=engines[w // 2] if w % 2 == 0 else trainers[w // 2]))
            for e in engines:
                feed(ev.ProgressReported(at=now + 0.5, worker_id=e, step=step, done=sub, total=int(STEP_S)))
            feed(ev.MiniBatchDone(at=now + 0.6, worker_id=trainers[0], step=step, done=sub, total=int(STEP_S)))
            feed(ev.Tick(at=now + 0.7))
            feed(ev.Tick(at=now + 0.99))
            while acks:
                pending, acks[:] = list(acks), []
                for a in pending:
                    feed(ev.OpReported(at=now + 0.8, worker_id=a.worker_id, op_id=a.op_id, ok=True))
        t += STEP_S
        feed(ev.StepReported(at=t, worker_id=trainers[0], timing=step_timing(step, state.split)))
        step += 1
    every = [x for v in times.values() for x in v]
    per_type = {k: round(statistics.median(v), 2) for k, v in sorted(times.items()) if v}
    return {
        "events": len(every),
        "p50": round(percentile(every, 0.5) or 0, 2), "p99": round(percentile(every, 0.99) or 0, 2),
        "p50_by_event": per_type,
        "per_step_report": {"steps": len(step_work),
                            "us_p50": round(statistics.median(s["us"] for s in step_work), 1) if step_work else None,
                            "facts_mean": round(statistics.fmean(s["facts"] for s in step_work), 1) if step_work else None,
                            "commands_mean": round(statistics.fmean(s["commands"] for s in step_work), 1)
                            if step_work else None},
    }


def open_guards() -> Any:
    """Guards that let every imbalanced step start a resize: what decision latency measures."""
    from dynaresized.core.guards import GuardConfig

    return GuardConfig(signal_run=1, min_dwell_s=0.0, cooldown_steps=0, payback_safety=0.0)


def step_timing(step: int, split: Any) -> Any:
    """Steps that alternate between a slow rollout and a slow training: the policy moves devices
    back and forth, a resize per step."""
    from dynaresized.domain import StepTiming

    slow, fast = STEP_S * 0.9, STEP_S * 0.4
    rollout_s, train_s = (slow, fast) if step % 2 == 0 else (fast, slow)
    return StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, weight_sync_s=0.1,
                      rollout_devices=split.rollout, train_devices=split.train)


# -- the worker hosts -----------------------------------------------------------------------------


def host_main(args: dict[str, Any]) -> int:
    """One process hosting many light workers: a raw DEALER per worker, each with its own
    identity `<worker_id>#<process>`, hello (with a secret), token and heartbeats.

    Options of the spec that scale.py leaves out (benchmarks/soak.py sets them): `queue_empty`,
    each engine reports its queue empty for the next rollout step once a step, the engines
    spread over the step's second half (so that a lending policy lends them to the training
    step running); `chatty` (a worker id) and `chatty_per_s`, that engine sends the same
    `queue_empty` over and over at that rate; `measure` (a path), the heartbeat RTTs and the
    longest time a worker went without an answer (`ack_silence_max_s`) are recorded from when
    it exists (from the start without it)."""
    import zmq

    from dynaresized import wire
    from dynaresized.domain import StepTiming, Split, WorkerKind

    raise_fd_limit()
    endpoint, first, count = args["endpoint"], args["first"], args["count"]
    out, stop = Path(args["out"]), Path(args["stop"])
    reporter, step_s = args["reporter"], args["step_s"]
    reports_dry, chatty_id, chatty_per_s = args.get("queue_empty", False), args.get("chatty", ""), args.get("chatty_per_s", 0.0)
    measure = Path(args["measure"]) if args.get("measure") else None
    measured_from = None if measure else time.monotonic()  # when the RTTs and silences began to count
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65536)
    encoder, decoder = wire.encode, wire.daemon_decoder()
    workers: list[dict[str, Any]] = []
    for i in range(first, first + count):
        device = device_names(i + 1)[-1]
        for kind, prefix in ((WorkerKind.ROLLOUT_ENGINE, "eng"), (WorkerKind.TRAINER_RANK, "tr")):
            wid, process = f"{prefix}-{i}", uuid.uuid4().hex
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"{wid}#{process}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            workers.append({"index": len(workers), "id": wid, "kind": kind, "device": device, "process": process, "sock": s,
                            "secret": secrets.token_hex(16), "token": "", "seq": 0, "sent": {},
                            "acked": -math.inf, "asked": -math.inf, "reported": -math.inf,
                            "incarnation": 0, "backoff": 0.0, "silence": 0.0})
    by_sock = {w["sock"]: w for w in workers}
    poller = zmq.Poller()
    for w in workers:
        poller.register(w["sock"], zmq.POLLIN)

    def hello(w: dict[str, Any]) -> None:
        w["sock"].send(encoder(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=w["id"], kind=w["kind"],
                                          devices=(w["device"],), pid=os.getpid(), process=w["process"],
                                          secret=w["secret"])))
        w["hello_at"] = time.monotonic()

    # Re-registration as our client does it (`DynaresizeClient._reregister`): a worker the daemon
    # forgot stops sending, says hello once, and again only if no welcome came, after a pause
    # that doubles (with jitter) up to a quarter of the heartbeat timeout. A hello for every
    # refused message multiplied the hellos of a slow daemon (each a new registration whose
    # token made the next messages stale: 172,000 refusals in one run at 4,096 devices).
    rehellos: list[tuple[float, int]] = []  # (when, worker index): hellos due

    def forgotten(w: dict[str, Any], now: float) -> None:
        if not w["token"]:
            return  # already saying hello again
        w["token"], w["backoff"] = "", 0.1
        heapq.heappush(rehellos, (now, w["index"]))

    def rehello_due(now: float) -> None:
        while rehellos and rehellos[0][0] <= now:
            _, i = heapq.heappop(rehellos)
            w = workers[i]
            if w["token"]:
                continue  # welcomed meanwhile
            hello(w)
            w["backoff"] = min(w["backoff"] * 2, HEARTBEAT_TIMEOUT_S / 4)
            # no welcome within twice the interval: again, after the pause (as the client)
            heapq.heappush(rehellos, (now + max(HEARTBEAT_S * 2, 1.0) + random.uniform(0.5, 1.0) * w["backoff"], i))

    rtts: list[float] = []
    errors: dict[str, int] = {}
    first_op: dict[str, float] = {}  # resize id -> when its first op arrived here (time.time)
    ops_answered = 0
    step_sent: dict[int, float] = {}

    def answered(w: dict[str, Any], now: float) -> None:
        """An answer from the daemon (a heartbeat_ack or a welcome): the silence it ends."""
        if measured_from is not None and w["acked"] > -math.inf:
            w["silence"] = max(w["silence"], now - max(w["acked"], measured_from))
        w["acked"] = now

    def receive(timeout_ms: float) -> None:
        nonlocal ops_answered
        for sock, _ in poller.poll(timeout_ms):
            w = by_sock[sock]
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.time()
                msg = decoder.decode(data)
                if type(msg) is wire.HeartbeatAck:
                    answered(w, time.monotonic())
                    sent = w["sent"].pop(msg.seq, None)
                    if sent is not None and measured_from is not None:
                        rtts.append(time.monotonic() - sent)
                elif type(msg) is wire.OpCommand:
                    first_op.setdefault(msg.resize_id, now)
                    sock.send(encoder(wire.OpResult(worker_id=w["id"], op_id=msg.op_id, ok=True, token=w["token"])))
                    ops_answered += 1
                elif type(msg) is wire.Welcome:
                    if msg.incarnation >= w["incarnation"]:  # several hellos answered: the newest is current
                        w["token"], w["incarnation"] = msg.token, msg.incarnation
                    answered(w, time.monotonic())
                elif type(msg) is wire.Error:
                    errors[msg.reason or msg.code.value] = errors.get(msg.reason or msg.code.value, 0) + 1
                    if (msg.reason in ("stale_token", "not_registered", "missing_token")
                            and (not msg.token or msg.token == w["token"])):  # not a copy sent before a welcome
                        forgotten(w, time.monotonic())

    for w in workers:
        hello(w)
    deadline = time.monotonic() + 30 + 0.05 * len(workers)
    while any(not w["token"] for w in workers) and time.monotonic() < deadline:
        receive(50)
        for w in workers:  # a hello lost in a queue that was not drained yet: say it again
            if not w["token"] and time.monotonic() - w["hello_at"] > 20:
                hello(w)
    Path(args["ready"]).write_text(str(sum(bool(w["token"]) for w in workers)))
    engines = [w for w in workers if w["kind"] is WorkerKind.ROLLOUT_ENGINE]
    trainer0 = next((w for w in workers if w["id"] == "tr-0"), None)
    chatty = next((w for w in engines if w["id"] == chatty_id), None)
    dry_step, dry_sent, dry_total = -1, 0, 0  # the step whose engines report, how many did, in all
    chatty_due = chatty_sent = 0  # the chatty engine's reports due so far, and sent (none while it says hello)
    t0 = time.monotonic()
    hb_sent = prog_sent = beats = asked = 0  # heartbeat slots passed, progress reports, heartbeats sent, acks asked
    last_step, last_mb = -1, -1
    split = Split(train=args["devices"] // 2, rollout=args["devices"] - args["devices"] // 2)
    while not stop.exists():
        now = time.monotonic()
        if measured_from is None and measure is not None and measure.exists():
            measured_from = now
        # heartbeats and progress spread evenly over their interval, as independent processes
        # would; a worker's beat half an interval after its report (not at the same instant)
        due = int(((now - t0) / HEARTBEAT_S - 0.5) * len(workers))
        rehello_due(now)
        while hb_sent < due:
            w = workers[hb_sent % len(workers)]
            hb_sent += 1
            if not w["token"]:
                continue  # saying hello again: no beats meanwhile (as the client)
            # as our client does: no beat after another message within the interval unless an
            # answer is due (the last ack, and the last ask, came a quarter of the heartbeat
            # timeout ago)
            ack = now - max(w["acked"], w["asked"]) >= HEARTBEAT_TIMEOUT_S / 4
            if not ack and now - w["reported"] < HEARTBEAT_S:
                continue
            w["seq"] += 1
            if ack:
                asked += 1
                w["asked"] = now
                w["sent"][w["seq"]] = time.monotonic()
                if len(w["sent"]) > 64:  # acks that never came: keep the record bounded
                    w["sent"].pop(next(iter(w["sent"])))
            w["sock"].send(encoder(wire.Heartbeat(worker_id=w["id"], seq=w["seq"], token=w["token"], ack=ack)))
            beats += 1
        due = int((now - t0) / PROGRESS_S * len(engines))
        step, into = int(time.time() / step_s), (time.time() % step_s) / step_s
        while prog_sent < due:
            w = engines[prog_sent % len(engines)]
            prog_sent += 1
            if not w["token"]:
                continue
            w["sock"].send(encoder(wire.Progress(worker_id=w["id"], step=step, done=int(into * 100), total=100,
                                                 token=w["token"])))
            w["reported"] = now
        if reports_dry:
            if step != dry_step:
                dry_step, dry_sent = step, 0
            # engine i runs dry at (0.5 + 0.4 i / engines) of the step: for the next step, whose
            # rollout runs while this step trains
            due = min(len(engines), int(max(0.0, into - 0.5) / 0.4 * len(engines)))
            while dry_sent < due:
                w = engines[dry_sent]
                dry_sent += 1
                if w["token"]:
                    dry_total += 1
                    w["sock"].send(encoder(wire.QueueEmpty(worker_id=w["id"], step=step + 1, token=w["token"])))
                    w["reported"] = now
        if chatty is not None:
            due = int((now - t0) * chatty_per_s)
            for _ in range(due - chatty_due if chatty["token"] else 0):
                chatty["sock"].send(encoder(wire.QueueEmpty(worker_id=chatty["id"], step=step + 1,
                                                            token=chatty["token"])))
                chatty_sent += 1
            chatty_due = due
        if reporter and trainer0 is not None:
            tok, sock = trainer0["token"], trainer0["sock"]
            mb = int(into * MINI_BATCHES)
            if step != last_step and last_step >= 0:
                slow, fast = step_s * 0.9, step_s * 0.4
                r, t = (slow, fast) if last_step % 2 == 0 else (fast, slow)
                step_sent[last_step] = time.time()
                sock.send(encoder(wire.StepReport(worker_id="tr-0", token=tok, timing=StepTiming(
                    step=last_step, rollout_s=r, train_s=t, weight_sync_s=0.1,
                    rollout_devices=split.rollout, train_devices=split.train))))
            if (step, mb) != (last_step, last_mb):
                sock.send(encoder(wire.MiniBatchDone(worker_id="tr-0", token=tok, step=step, done=mb,
                                                     total=MINI_BATCHES)))
            last_step, last_mb = step, mb
        receive(10)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    end = time.monotonic()
    if measured_from is not None:  # a worker still waiting for an answer: its silence so far
        for w in workers:
            answered(w, end)
    out.write_text(json.dumps({"cpu_share": (usage.ru_utime + usage.ru_stime) / (time.monotonic() - t0), "rtts": rtts, "errors": errors, "first_op": first_op, "ops_answered": ops_answered,
                               "step_sent": step_sent, "heartbeats_sent": beats, "acks_asked": asked, "progress_sent": prog_sent,
                               "queue_empty_sent": dry_total, "chatty_sent": chatty_sent,
                               "ack_silence_max_s": max((w["silence"] for w in workers), default=0.0)}))
    for w in workers:
        w["sock"].close(0)
    ctx.term()
    return 0


# -- the daemon ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_text(state_dir: Path, worker_ep: str, control_ep: str, n: int, batch_window_ms: float | None = None,
                metrics_port: int = 0, lending: bool = False) -> str:
    """The daemon's configuration: the hysteresis policy with its guards opened; with `lending`,
    it lends too, and loans cost next to nothing (it lends whenever an engine is idle)."""
    devices = device_names(n)
    g = open_guards()
    loans = ("\n[loan_costs]\nto_training_s = 0.01\nto_rollout_s = 0.01\nreturn_s = 0.01\nlead_s = 0.0\n"
             if lending else "")
    return f"""
[daemon]
state_dir = "{state_dir}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = {metrics_port}
{"" if batch_window_ms is None else f"batch_window_ms = {batch_window_ms}"}
log_format = "json"
log_level = "info"

[cluster]
devices = {json.dumps(devices)}
training = {json.dumps(devices[: n // 2])}

[policy]
name = "hysteresis"
options = {{ lending = {"true" if lending else "false"} }}

[guards]
signal_run = {g.signal_run}
min_dwell_s = {g.min_dwell_s}
cooldown_steps = {g.cooldown_steps}
payback_safety = {g.payback_safety}

[costs]
to_training_s = 0.01
to_rollout_s = 0.01
{loans}"""


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def log_bytes(state_dir: Path) -> int:
    return sum(p.stat().st_size for p in state_dir.glob("events.sqlite*") if p.is_file())


def status(control_ep: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    from dynaresized import wire
    from dynaresized.control import control_request

    try:
        return control_request(control_ep, wire.StatusRequest(), timeout_s).data
    except (TimeoutError, RuntimeError):
        return None


class Served(NamedTuple):
    """A daemon serving registered worker hosts (`serving`)."""

    daemon: subprocess.Popen[bytes]
    registered_s: float  # from its start to every host's workers registered


@contextlib.contextmanager
def serving(tmp: Path, config: str, worker_ep: str, control_ep: str, n: int, hosts: int, step_s: float,
            **host_options: Any) -> Iterator[Served]:
    """`dynaresized serve` on `config` (tmp/config.toml, its output in tmp/daemon.log) and `hosts`
    worker-host processes (`host_main`, the n devices split between them, `host_options` added to
    each spec), once every host's workers are registered. Leaving it stops the hosts (each writes
    tmp/host-<i>.json: `host_results`), then the daemon."""
    cfg = tmp / "config.toml"
    cfg.write_text(config)
    daemon = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(cfg)],
                              stdout=(tmp / "daemon.log").open("wb"), stderr=subprocess.STDOUT,
                              preexec_fn=raise_fd_limit)
    procs: list[subprocess.Popen[bytes]] = []
    stop = tmp / "stop"
    started = time.monotonic()
    try:
        while status(control_ep, 0.5) is None:
            if daemon.poll() is not None or time.monotonic() - started > 60:
                raise RuntimeError(f"the daemon did not start: {(tmp / 'daemon.log').read_text()[-2000:]}")
        per = [n // hosts + (1 if i < n % hosts else 0) for i in range(hosts)]
        first = 0
        for i, count in enumerate(per):
            spec = {"endpoint": worker_ep, "first": first, "count": count, "reporter": i == 0, "step_s": step_s,
                    "devices": n, "out": str(tmp / f"host-{i}.json"), "stop": str(stop),
                    "ready": str(tmp / f"host-{i}.ready"), **host_options}
            procs.append(subprocess.Popen([sys.executable, str(HERE), "--host", json.dumps(spec)],
                                          stderr=(tmp / f"host-{i}.log").open("wb")))
            first += count
        deadline = time.monotonic() + 120 + 0.1 * n
        while not all((tmp / f"host-{i}.ready").exists() for i in range(hosts)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the worker hosts did not all register: "
                                   + " | ".join((tmp / f"host-{i}.log").read_text()[-500:] for i in range(hosts)))
            time.sleep(0.5)
        yield Served(daemon=daemon, registered_s=time.monotonic() - started)
        stop.touch()
        for p in procs:
            p.wait(timeout=120)
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def host_results(tmp: Path, hosts: int) -> list[dict[str, Any]]:
    """What each worker host wrote when it stopped (`host_main`)."""
    missing = [i for i in range(hosts) if not (tmp / f"host-{i}.json").exists()]
    if missing:
        raise RuntimeError("worker host(s) ended without their results: "
                           + " | ".join((tmp / f"host-{i}.log").read_text()[-1500:] for i in missing))
    return [json.loads((tmp / f"host-{i}.json").read_text()) for i in range(hosts)]


def worker_errors(results: list[dict[str, Any]]) -> dict[str, int]:
    """The daemon's refusals the hosts' workers received, by reason, summed over the hosts."""
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return errors


def bench_daemon(n: int, hosts: int, window_s: float, step_s: float, tmp: Path,
                 batch_window_ms: float | None = None) -> dict[str, Any]:
    from dynaresized.core import facts as fx

    state_dir = tmp / "state"
    worker_ep, control_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    hosts = max(1, min(hosts, n))
    with serving(tmp, config_text(state_dir, worker_ep, control_ep, n, batch_window_ms), worker_ep, control_ep,
                 n, hosts, step_s) as served:
        daemon, registered_s = served.daemon, served.registered_s
        time.sleep(max(2 * step_s, 5.0))  # steady state: heartbeats spread, a resize or two done
        load0 = os.getloadavg()[0]
        c0, w0, t0 = proc_cpu_s(daemon.pid), time.monotonic(), time.time()
        rss = []
        while time.monotonic() - w0 < window_s:
            time.sleep(1.0)
            rss.append(proc_rss_mib(daemon.pid))
        c1, w1, t1 = proc_cpu_s(daemon.pid), time.monotonic(), time.time()
        st = status(control_ep, 30.0)
    results = host_results(tmp, hosts)
    rtts = [x for r in results for x in r["rtts"]]
    errors = worker_errors(results)
    first_op: dict[str, float] = {}
    for r in results:
        for rid, at in r["first_op"].items():
            first_op[rid] = min(at, first_op.get(rid, at))
    sent = sorted((float(at), int(s)) for s, at in results[0]["step_sent"].items())
    # Each resize is the answer to the latest step report sent before its first op arrived.
    latencies = []
    for rid, at in sorted(first_op.items(), key=lambda x: x[1]):
        before = [s for s in sent if s[0] <= at]
        if before:
            latencies.append((at - before[-1][0]) * 1000)
    rows, facts, bytes_per_fact = read_log(state_dir)
    in_window = sum(t0 <= e.recorded_at <= t1 for e in rows)
    lost, lost_after = workers_lost(rows, facts, t1)
    started_resizes = sum(isinstance(x, fx.ResizeStarted) for x in facts)
    replay = bench_replay(state_dir / "events.sqlite")
    live = None if st is None else sum(w["status"] == "live" for w in st["workers"])
    return {
        "workers": 2 * n, "hosts": hosts, "register_s": round(registered_s, 1),
        "window_s": round(w1 - w0, 1), "load_avg_1m": round(load0, 1),
        "daemon_cpu_share": round((c1 - c0) / (w1 - w0), 4),
        "daemon_rss_mib": round(max(rss), 1) if rss else None,
        "decision_latency_ms": {"p50": round(percentile(latencies, 0.5), 1) if latencies else None,
                                "p99": round(percentile(latencies, 0.99), 1) if latencies else None,
                                "resizes": len(latencies)},
        "heartbeat_rtt_ms": {"p50": round((percentile(rtts, 0.5) or 0) * 1000, 1),
                             "p99": round((percentile(rtts, 0.99) or 0) * 1000, 1),
                             "max": round(max(rtts, default=0) * 1000, 1), "acks": len(rtts),
                             "sent": sum(r["heartbeats_sent"] for r in results),
                             "asked": sum(r["acks_asked"] for r in results)},
        "workers_lost": lost, "workers_lost_after_window": lost_after, "live_at_end": live, "resizes_started": started_resizes,
        "worker_errors": errors,
        "host_cpu_share_max": round(max(r["cpu_share"] for r in results), 3),
        "facts_per_s": round(in_window / (t1 - t0), 1), "log_bytes_per_fact": round(bytes_per_fact, 1),
        "log_bytes_per_hour": round(in_window / (t1 - t0) * 3600 * bytes_per_fact),
        
        **replay,
    }


def read_log(state_dir: Path) -> tuple[list[Any], list[Any], float]:
    """The daemon's log read whole, once it has stopped: its records, their facts, and its bytes
    per fact with the WAL checkpointed into the file."""
    from dynaresized.core import facts as fx
    from dynaresized.store import open_recorder

    recorder = open_recorder(state_dir / "events.sqlite", read_only=True)
    try:
        rows = list(recorder.read_all())
        facts = [fx.decode_fact(e.data) for e in rows]
    finally:
        recorder.close()
    with contextlib.closing(sqlite3.connect(state_dir / "events.sqlite")) as db:  # the WAL into the file
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return rows, facts, log_bytes(state_dir) / max(len(rows), 1)


def workers_lost(rows: list[Any], facts: list[Any], until: float) -> tuple[int, int]:
    """Workers the daemon declared lost up to `until` (what a run measures), and after it: once
    the hosts stop, a daemon still finishing a resize whose ops nobody answers any more loses
    them all."""
    from dynaresized.core import facts as fx

    lost_at = [e.recorded_at for e, x in zip(rows, facts, strict=True) if isinstance(x, fx.WorkerLost)]
    lost = sum(at <= until for at in lost_at)
    return lost, len(lost_at) - lost


def bench_replay(path: Path) -> dict[str, Any]:
    """The daemon's start-up replay at its worst: decode the latest snapshot, then read and fold
    `snapshot_every` facts (the most that can follow a snapshot), whatever the log's length."""
    from dynaresized.core.facts import decode_fact
    from dynaresized.core.state import ClusterState, decode_state, encode_state, mutate
    from dynaresized.daemon.config import DaemonSection
    from dynaresized.store import FactLog, open_recorder

    every = DaemonSection().snapshot_every
    recorder = open_recorder(path, read_only=True)
    try:
        t0 = time.perf_counter()
        state = FactLog(recorder, snapshot_every=every).replay()  # this run's own log, as the daemon would
        replay_run_s = time.perf_counter() - t0
        rows = list(recorder.read("cluster"))
    finally:
        recorder.close()
    tail = rows[-every:]
    base = ClusterState()
    for e in rows[: len(rows) - len(tail)]:
        base = mutate(base, decode_fact(e.data))
    blob = encode_state(base)
    t0 = time.perf_counter()
    s = decode_state(blob)
    for e in tail:
        s = mutate(s, decode_fact(e.data))
    fold_s = time.perf_counter() - t0
    scale = every / max(len(tail), 1)
    return {"facts_in_log": len(rows), "replay_run_s": round(replay_run_s, 3),
            "snapshot_bytes": len(blob),
            "replay_hour_s": round(fold_s * scale, 3),
            "replay_hour_note": f"snapshot decode + fold of {len(tail)} facts, scaled to {every}"}


def bench_simulate(n: int, timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, "-m", "dynaresized.cli", "simulate", "--scenario", "longtail-stationary",
            "--steps", "200", "--gpus", str(n), "--json"]
    t0 = time.monotonic()
    try:
        subprocess.run(argv, capture_output=True, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"simulate_s": None, "simulate_timed_out": timeout_s}
    return {"simulate_s": round(time.monotonic() - t0, 1)}


# -- the curve ----------------------------------------------------------------------------------


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p["devices"] for p in points]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    series = [
        (axes[0][0], "daemon CPU (share of one core)", [p["daemon"]["daemon_cpu_share"] for p in points], 0.25),
        (axes[0][1], "decision latency p99 (ms)", [p["daemon"]["decision_latency_ms"]["p99"] for p in points], 100),
        (axes[0][2], "heartbeat answer, slowest (ms)", [p["daemon"]["heartbeat_rtt_ms"]["max"] for p in points],
         HEARTBEAT_TIMEOUT_S * 1000),
        (axes[1][0], "core step p99 (µs per event)", [p["core_step_us"]["p99"] for p in points], 500),
        (axes[1][1], "daemon RSS (MiB)", [p["daemon"]["daemon_rss_mib"] for p in points], None),
        (axes[1][2], "simulate, 200 steps (s)", [p.get("simulate_s") for p in points], 60),
    ]
    for ax, title, ys, target in series:
        xs = [x for x, y in zip(n, ys, strict=True) if y is not None]
        ax.plot(xs, [y for y in ys if y is not None], marker="o")
        if target is not None:
            label = "heartbeat timeout" if target == HEARTBEAT_TIMEOUT_S * 1000 else "target at 1,024"
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label=label)
            ax.legend()
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (2 workers each)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    fig.suptitle("one dynaresized daemon: cost against cluster size")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--host":
        return host_main(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="8,64,512,1024,4096", help="comma-separated device counts")
    parser.add_argument("--hosts", type=int, default=4, help="worker host processes")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady state measured")
    parser.add_argument("--step-s", type=float, default=STEP_S, help="the job's RL step, wall seconds")
    parser.add_argument("--core-events", type=int, default=60_000, help="events timed through Core.step()")
    parser.add_argument("--simulate-timeout", type=float, default=600.0)
    parser.add_argument("--no-simulate", action="store_true")
    parser.add_argument("--no-daemon", action="store_true")
    parser.add_argument("--batch-window-ms", type=float, default=None,
                        help="the daemon's daemon.batch_window_ms (default: the daemon's own default)")
    parser.add_argument("--plot", metavar="FILE.png")
    args = parser.parse_args()
    raise_fd_limit()
    points = []
    for n in (int(x) for x in args.devices.split(",")):
        point: dict[str, Any] = {"devices": n, "core_step_us": bench_core(n, args.core_events)}
        print(f"{n} devices: core done", file=sys.stderr, flush=True)
        if not args.no_daemon:
            with tempfile.TemporaryDirectory(prefix="dynaresized-scale-") as d:
                point["daemon"] = bench_daemon(n, args.hosts, args.window, args.step_s, Path(d), args.batch_window_ms)
            print(f"{n} devices: daemon done", file=sys.stderr, flush=True)
        if not args.no_simulate:
            point.update(bench_simulate(n, args.simulate_timeout))
        points.append(point)
        print(json.dumps(point), file=sys.stderr, flush=True)
    result = {"benchmark": "scale", "machine": {"cpus": os.cpu_count()}, "points": points,
              "targets_at_1024": {"daemon_cpu_share": "<= 0.25", "decision_latency_ms_p99": "<= 100",
                                  "core_step_us_p99": "<= 500", "replay_hour_s": "<= 5", "simulate_s": "<= 60"},
              "targets_at_4096": {"heartbeat_rtt_ms_max": f"< {HEARTBEAT_TIMEOUT_S * 1000:g} (the timeout)",
                                  "workers_lost": "0"}}
    if args.plot and all("daemon" in p for p in points):
        plot(points, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
