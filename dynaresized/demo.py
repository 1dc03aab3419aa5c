"""`dynaresized demo`: the whole system on one machine, in about a minute.

It starts the real daemon on loopback with a temporary state directory, one process per
simulated device (each hosting that device's engine and trainer workers, attached through the
real client over real ZeroMQ), runs a long-tail RL workload from the simulator's model at
accelerated time, prints the pools step by step, why each resize happened, and the loans of
idle devices inside steps (engines to the training step in progress, trainers with nothing to
train to the rollout) with the reasons of the first three and then one step in twenty (read from
the daemon's event log, as an operator would; `--keep` keeps it for `dynaresized events`), and ends with the time the same run would have taken on the
static split and on the best static split with the same router.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from dynaresized import wire
from dynaresized.core import facts as f
from dynaresized.core.idle import percent
from dynaresized.core.state import ClusterState, mutate
from dynaresized.domain import OpKind, Pool, Split, StepTiming
from dynaresized.explain import accuracy, explain


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the daemon with simulated workers on a long-tail RL workload (~1 min)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="longtail-drift", help="built-in scenario or a trace .jsonl")
    p.add_argument("--profile", default="qwen3-8b-h20x8", help="built-in cluster profile or a .toml")
    p.add_argument("--policy", default="hysteresis", help="resize policy (static, hysteresis, greedy, planner)")
    p.add_argument("--steps", type=int, default=200, help="RL steps to run (default 200)")
    p.add_argument("--speedup", type=float, default=4000.0, help="simulated seconds per real second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object at the end")
    p.add_argument("--keep", action="store_true", help="keep the state directory (its path is printed)")
    p.set_defaults(run=run)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(state: Path, cluster: Any, policy: str, speedup: float, steps: int) -> tuple[str, str, str]:
    worker_ep, control_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    training = [d for d, p in zip(cluster.devices, cluster.initial_pools, strict=True) if p is Pool.TRAINING]
    per_device = {pool: sum(cluster.op_seconds(k, pool) for k in (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN,
                                                                   OpKind.RESTORE, OpKind.COMMIT))
                  for pool in Pool}
    candidates = [str(c) for c in cluster.profile.candidate_splits()]
    # what a loan costs on this cluster, as an operator would write it down for theirs
    loans = "\n".join(f"{k} = {v:.6f}" for k, v in msgspec.structs.asdict(cluster.profile.loan_costs()).items())
    text = f"""
[daemon]
state_dir = "{state}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = 0
tick_interval_s = 0.1
log_format = "json"
log_level = "warning"
time_scale = {speedup}
[cluster]
devices = {json.dumps(list(cluster.devices))}
training = {json.dumps(training)}
candidates = {json.dumps(candidates)}
[policy]
name = "{policy}"
[guards]
min_dwell_s = 60.0
cooldown_steps = 10
signal_run = 3
[core]
# simulated seconds (daemon.time_scale): 10 s and 60 s of wall time
heartbeat_timeout_s = {10 * speedup}
op_timeout_s = {60 * speedup}
steps_total = {steps}
[costs]
to_training_s = {per_device[Pool.TRAINING]:.6f}
to_rollout_s = {per_device[Pool.ROLLOUT]:.6f}
[loan_costs]
{loans}
"""
    path = state.parent / "config.toml"
    path.write_text(text)
    return str(path), worker_ep, control_ep


def _bar(split: Split, moving: int = 0) -> str:
    return "T" + "■" * split.train + " R" + "□" * split.rollout + (f" ~{moving}" if moving else "")


def run(args: argparse.Namespace) -> int:
    from dynaresized.control import control_request
    from dynaresized.core.facts import decode_fact
    from dynaresized.sim.cluster import VirtualCluster
    from dynaresized.sim.pipeline import best_static_config, static_total
    from dynaresized.store import open_recorder

    cluster = VirtualCluster.builtin(args.scenario, args.profile, seed=args.seed, steps=args.steps)
    steps = cluster.steps
    root = Path(tempfile.mkdtemp(prefix="dynaresized-demo-"))
    state = root / "state"
    config, worker_ep, control_ep = _config(state, cluster, args.policy, args.speedup, steps)
    initial = Split(train=sum(p is Pool.TRAINING for p in cluster.initial_pools),
                    rollout=sum(p is Pool.ROLLOUT for p in cluster.initial_pools))
    out = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    say(f"dynaresized demo: {args.scenario} on {args.profile} ({len(cluster.devices)} devices, start {initial}), "
        f"policy {args.policy}, {steps} steps at {args.speedup:g}x")
    say(f"  daemon: {worker_ep} (control {control_ep}), event log {state / 'events.sqlite'}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    daemon = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", config],
                              stdout=(root / "daemon.log").open("wb"), stderr=subprocess.STDOUT, env=env)
    devices: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                control_request(control_ep, wire.StatusRequest(), 0.5)
                break
            except TimeoutError:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    say((root / "daemon.log").read_text())
                    raise SystemExit("dynaresized demo: the daemon did not start") from None
        clock_ep = f"tcp://127.0.0.1:{_free_port()}"
        for i, device in enumerate(cluster.devices):
            cmd = [sys.executable, "-m", "dynaresized.backends.sim", "--endpoint", worker_ep, "--device", device,
                   "--scenario", args.scenario, "--profile", args.profile, "--seed", str(args.seed),
                   "--steps", str(steps), "--speedup", str(args.speedup), "--clock-endpoint", clock_ep]
            leader = ["--leader", "--control-endpoint", control_ep] if i == 0 else []
            devices.append(subprocess.Popen(cmd + leader, env=env,
                                            stdout=subprocess.DEVNULL, stderr=(root / f"device{i}.log").open("wb")))
        say(f"  {len(devices)} device processes started (engine + trainer worker each); training...\n")
        summary = _follow(state, devices[0], steps, say, open_recorder, decode_fact)
    finally:
        for p in devices:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        for p in [*devices, daemon]:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    model = cluster.stages
    static_initial = static_total(model, initial)
    best_config, own = best_static_config(model, len(cluster.devices))
    best_split, best_total = own.split, own.total_s
    dynamic = summary["total_time_s"]
    result = {
        "scenario": args.scenario, "profile": args.profile, "policy": args.policy, "steps": summary["steps"],
        "total_time_s": round(dynamic, 1), "resizes": summary["resizes"], "final_split": summary["final_split"],
        "static_split": str(initial), "static_total_time_s": round(static_initial, 1),
        "speedup_vs_static_split": round(static_initial / dynamic, 4) if dynamic else None,
        "best_static_split": str(best_split), "best_static_total_time_s": round(best_total, 1),
        "speedup_vs_best_static": round(best_total / dynamic, 4) if dynamic else None,
        "best_static_config": f"{best_config.split}/TP-{best_config.tp}",
        "best_static_config_total_time_s": round(best_config.total_s, 1),
        "speedup_vs_best_static_config": round(best_config.total_s / dynamic, 4) if dynamic else None,
        "router": model.router, "loans": summary["loans"], "devices_lent": summary["devices_lent"],
        "wall_s": round(summary["wall_s"], 1), "state_dir": str(state) if args.keep else None,
        "idle_ratio": {pool: None if t.ratio is None else round(t.ratio, 4) for pool, t in summary["idle"].items()},
        # the daemon's prediction check: resizes' step time, loans' stage end (`LoanChecked`)
        "predictions_checked": {k: a["checked"] for k, a in summary["accuracy"].items()},
        "prediction_mae_s": {k: _rounded(a["mae_s"], 2) for k, a in summary["accuracy"].items()},
        "prediction_relative_error": {k: _rounded(a["relative_error"], 4) for k, a in summary["accuracy"].items()},
    }
    say("")
    say(f"done: {summary['steps']} steps, {summary['resizes']} resize(s), final split {summary['final_split']}, "
        f"{summary['loans']} loan(s) of idle devices inside steps ({summary['devices_lent']} device-steps)")
    if not dynamic:  # nothing ran: say where to look, not a division by zero
        say(f"dynaresized demo: no step finished; the leader's log: {root / 'device0.log'}, the daemon's: "
            f"{root / 'daemon.log'}")
        return 1
    say(f"  simulated time with {args.policy}: {dynamic / 3600:7.2f} h")
    say(f"  on the static split {initial}:     {static_initial / 3600:7.2f} h  "
        f"(dynamic is {static_initial / dynamic:.2f}x faster)")
    say(f"  on the best static split {best_split} (chosen with hindsight, same {model.router} router): "
        f"{best_total / 3600:.2f} h  ({best_total / dynamic:.3f}x)")
    say(f"  on the best static configuration {best_config.split}/TP-{best_config.tp} (split x engine size, "
        f"hindsight): {best_config.total_s / 3600:.2f} h  ({best_config.total_s / dynamic:.3f}x"
        + ("; below 1: the demo's engines are one device each, `dynaresized plan` says where to start)"
           if best_config.total_s < dynamic else ")"))
    for pool, t in summary["idle"].items():
        say(f"  idle {pool:<9} {percent(t.ratio):>7} of its device time ({t.idle_s / 3600:.2f} of "
            f"{(t.busy_s + t.idle_s) / 3600:.2f} device-hours; {t.steps} steps accounted, {t.unknown_steps} unknown)")
    checked = [words for k, a in summary["accuracy"].items() if (words := accuracy(k, a))]
    if checked:
        say(f"  predictions {'; '.join(checked)}")
    say(f"  wall time {summary['wall_s']:.1f}s; the daemon's log: `dynaresized events --state-dir {state}`"
        if args.keep else f"  wall time {summary['wall_s']:.1f}s")
    if args.json:
        print(json.dumps(result))
    if summary["steps"] != steps:  # keep what tells why
        say(f"dynaresized demo: the run stopped after {summary['steps']} of {steps} steps; the leader's log: "
            f"{root / 'device0.log'}, the daemon's: {root / 'daemon.log'}")
        return 1
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _lent(lent: dict[Pool, list[str]]) -> str:
    """The step line's loans, one direction each: "  lent to training gpu6; to rollout gpu0, gpu1"."""
    parts = [f"to {pool.value} {', '.join(devices)}" for pool, devices in lent.items() if devices]
    return f"  lent {'; '.join(parts)}" if parts else ""


def _follow(state: Path, leader: subprocess.Popen[bytes], steps: int, say: Any,
            open_recorder: Any, decode_fact: Any, settle_s: float = 10.0) -> dict[str, Any]:
    """Tail the daemon's event log until the leader has run every step. The leader's last step
    report may still be on its way into the log when the leader exits: after the exit the log
    is read on until every step is in it, for up to `settle_s`."""
    started = time.monotonic()
    exited_at: float | None = None
    recorder = open_recorder(state / "events.sqlite", read_only=True)
    position, seen_steps, total, resizes, loans, lent = 0, 0, 0.0, 0, 0, 0
    lent_this_step: dict[Pool, list[str]] = {Pool.TRAINING: [], Pool.ROLLOUT: []}  # by the pool lent to
    cluster = ClusterState()  # the log folded as the daemon folds it: its idle figures
    split = None
    prev: StepTiming | None = None  # the step reported before
    last_rejection = ""
    try:
        while True:
            done = leader.poll() is not None
            for stored in recorder.read_all(after_position=position):
                position = stored.position
                fact = decode_fact(stored.data)
                cluster = mutate(cluster, fact)
                if isinstance(fact, f.StepObserved):
                    t = fact.timing
                    # one-step off: step k is generated beside step k - 1's training, in window k
                    window_s = t.rollout_s if prev is None else max(t.rollout_s, prev.train_s) + t.weight_sync_s
                    total += window_s
                    prev = t
                    seen_steps += 1
                    # The split the daemon holds as the step is recorded (a resize committed at
                    # the previous boundary shows here), not the one the step started on; a
                    # lent device, or one on its way to a loan, counts in its home pool, and a
                    # device a resize is moving shows as ~.
                    split = cluster.split
                    moving = sum(p.is_moving and p.home is None for p in cluster.devices.values())
                    split = Split(train=split.train + sum(p.is_moving and p.home is Pool.TRAINING
                                                          for p in cluster.devices.values()),
                                  rollout=split.rollout + sum(p.is_moving and p.home is Pool.ROLLOUT
                                                              for p in cluster.devices.values()))
                    say(f"step {t.step:4d}  {_bar(split, moving):<22} rollout {t.rollout_s:7.1f}s  "
                        f"train {t.train_s:7.1f}s  window {window_s:7.1f}s{_lent(lent_this_step)}")
                    lent_this_step = {Pool.TRAINING: [], Pool.ROLLOUT: []}
                elif isinstance(fact, f.LoanStarted):
                    if not any(lent_this_step.values()) and (loans < 3 or seen_steps % 20 == 0):
                        say(f"  >> {explain(fact)}")  # the first loans, then one step in twenty
                    lent_this_step[fact.plan.to_pool].extend(d.split(":")[-1] for d in fact.plan.devices)
                    lent += len(fact.plan.devices)
                elif isinstance(fact, f.LoanLanded):
                    loans += 1
                elif isinstance(fact, f.ResizeStarted | f.ResizeCommitted | f.ResizeRolledBack | f.Degraded
                                | f.WorkerLost | f.PredictionChecked | f.ResizeJudged):
                    resizes += isinstance(fact, f.ResizeCommitted)
                    say(f"  >> {explain(fact)}")
                elif isinstance(fact, f.ProposalRejected) and fact.guard != last_rejection:
                    last_rejection = fact.guard  # one line per change of reason, not one per step
                    say(f"  .. {explain(fact)}")
            if done:
                exited_at = exited_at or time.monotonic()
                if seen_steps >= steps or time.monotonic() - exited_at > settle_s:
                    break
            time.sleep(0.1)
    finally:
        recorder.close()
    if prev is not None:
        total += prev.train_s + prev.weight_sync_s  # the last window trains the last step
    idle = {p.value: cluster.idle.pool(p) for p in Pool}
    return {"steps": seen_steps, "total_time_s": total, "resizes": resizes, "loans": loans, "devices_lent": lent,
            "final_split": str(split) if split else "", "wall_s": time.monotonic() - started,
            "idle": idle, "payback_factor": cluster.history.payback_factor,
            "accuracy": {"resize": cluster.resize_accuracy.summary(), "loan": cluster.loan_accuracy.summary()}}
