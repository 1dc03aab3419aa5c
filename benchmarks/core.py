"""Benchmark of the core and the event store. Prints ONE JSON object; asserts nothing on time.

* `step()` throughput of `dynaresized.core.Core` over a realistic mix of events: heartbeats,
  ticks, per-sample progress, step reports and full resizes (the hysteresis policy moves
  devices toward the slower stage; the stage that is slower flips every `--flip-every` steps)
  with every operation acknowledged. The events are generated once by driving a core and
  answering its commands, then replayed, timed, through a fresh core.
* Append throughput of the SQLite store (`synchronous=FULL`): one append per core step that
  produced facts (what the daemon does), and bulk batches.
* Replay of a `--facts`-fact log (default 1,000,000) from a SQLite file built from the same
  workload (without heartbeats: they make no facts) with a snapshot every `--snapshot-every`
  facts: with the snapshot (latest snapshot + fold of the rest) and without (fold of all).
* Compaction of that log (retention, docs/store.md): the daemon's steady case, one snapshot
  interval dropped after a snapshot, and a capped catch-up; replay after it must not change.

Targets (DESIGN/issue 2): >= 100,000 events/s through step(); replay of 1M facts from a
snapshot-bearing store <= 3 s. Usage: python benchmarks/core.py [--facts N] [--events N]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import platform
import pstats
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator

from dynaresized.core import ClusterState, Core, CoreConfig, SendOp
from dynaresized.core import events as ev
from dynaresized.core.facts import Fact
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import load_policy
from dynaresized.domain import Pool, StepTiming, WorkerKind
from dynaresized.store import FactLog, SQLiteRecorder
from dynaresized.store.factlog import CATCH_UP_INTERVALS

STEP_TARGET_EVENTS_PER_S = 100_000
REPLAY_TARGET_S = 3.0


# -- the workload ----------------------------------------------------------------------------


class Workload:
    """A virtual cluster of `devices` devices, each with a rollout engine and a trainer rank
    attached (so a device can serve either pool), running RL steps in virtual time."""

    def __init__(self, devices: int, heartbeats: bool, heartbeat_every_s: float, progress_every_s: float,
                 flip_every: int, samples: int) -> None:
        self.devices = tuple(f"node{i // 8}:gpu{i % 8}" for i in range(devices))
        self.heartbeats = heartbeats
        self.heartbeat_every_s = heartbeat_every_s
        self.progress_every_s = progress_every_s
        self.flip_every = flip_every
        self.samples = samples
        config = CoreConfig(
            guards=GuardConfig(),  # the defaults: threshold, run of 3, 60 s dwell, 10-step cooldown, payback
            heartbeat_timeout_s=30.0 if heartbeats else 1e12,
        )
        self.core = Core(config, load_policy("hysteresis"))
        self.state = ClusterState()
        self.acks: list[ev.OpReported] = []

    def feed(self, event: ev.Event) -> tuple[list[Fact], list[SendOp]]:
        self.state, facts, commands = self.core.step(self.state, event)
        for c in commands:
            # Every worker acknowledges its operation at the next sub-tick.
            self.acks.append(ev.OpReported(at=0.0, worker_id=c.worker_id, op_id=c.op.op_id, ok=True))
        return facts, commands

    def events(self) -> Iterator[ev.Event]:
        """Endless: yields each event after the previous one has been fed."""
        n = len(self.devices)
        pools = tuple(Pool.TRAINING if i < n // 2 else Pool.ROLLOUT for i in range(n))
        yield ev.Configure(at=0.0, devices=self.devices, pools=pools)
        workers = []
        for i, d in enumerate(self.devices):
            for kind, prefix in ((WorkerKind.ROLLOUT_ENGINE, "engine"), (WorkerKind.TRAINER_RANK, "trainer")):
                workers.append(f"{prefix}-{i}")
                yield ev.WorkerHello(at=0.5, worker_id=workers[-1], kind=kind, devices=(d,))
        engines_of = {d: f"engine-{i}" for i, d in enumerate(self.devices)}
        t = 1.0
        step = 0
        tick = min(self.heartbeat_every_s, self.progress_every_s)
        while True:
            split = self.state.split
            rollout_heavy = (step // self.flip_every) % 2 == 0
            rollout_work, train_work = (300.0, 150.0) if rollout_heavy else (150.0, 300.0)
            rollout_work *= n / 8
            train_work *= n / 8
            rollout_s = rollout_work / max(split.rollout, 1)
            train_s = train_work / max(split.train, 1)
            step_s = max(rollout_s, train_s)
            sub = 0.0
            while sub < step_s:
                now = t + sub
                if self.heartbeats:
                    for w in workers:
                        yield ev.Heartbeat(at=now, worker_id=w)
                engines = [engines_of[d] for d in self.state.pool_devices(Pool.ROLLOUT)]
                done = min(int(self.samples * sub / rollout_s), self.samples) if rollout_s else self.samples
                for e in engines:
                    yield ev.ProgressReported(at=now, worker_id=e, step=step, done=done, total=self.samples,
                                              tokens=done * 900)
                yield ev.Tick(at=now)
                while self.acks:
                    pending, self.acks = self.acks, []
                    for a in pending:
                        yield ev.OpReported(at=now + 0.1, worker_id=a.worker_id, op_id=a.op_id, ok=True)
                sub += tick
            t += step_s
            timing = StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, weight_sync_s=0.5,
                                rollout_devices=split.rollout, train_devices=split.train,
                                samples=self.samples, response_tokens=self.samples * 900)
            yield ev.StepReported(at=t, worker_id="trainer-0", timing=timing)
            step += 1


def generate_events(count: int, **kw: object) -> tuple[list[ev.Event], ClusterState]:
    workload = Workload(heartbeats=True, **kw)  # type: ignore[arg-type]
    events: list[ev.Event] = []
    for e in workload.events():
        workload.feed(e)
        events.append(e)
        if len(events) >= count:
            break
    return events, workload.state


# -- step() throughput ----------------------------------------------------------------------


def bench_step(events: list[ev.Event], expected: ClusterState, profile: bool) -> dict[str, object]:
    core = Core(CoreConfig(guards=GuardConfig(), heartbeat_timeout_s=30.0), load_policy("hysteresis"))
    state = ClusterState()
    facts = commands = 0
    step = core.step
    started, cpu_started = time.perf_counter(), time.process_time()
    for e in events:
        state, fs, cs = step(state, e)
        facts += len(fs)
        commands += len(cs)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if state.durable() != expected.durable():
        raise AssertionError("the timed pass did not reach the generating pass's state: the core is not deterministic")

    # Per event type, one more pass timing each call (adds timer overhead to every number).
    state = ClusterState()
    spent: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    clock = time.perf_counter
    for e in events:
        t0 = clock()
        state, _, _ = step(state, e)
        spent[type(e).__name__] += clock() - t0
        counts[type(e).__name__] += 1

    result: dict[str, object] = {
        "events": len(events),
        "seconds": round(elapsed, 3),
        "cpu_seconds": round(cpu, 3),
        "events_per_s": round(len(events) / elapsed),
        "events_per_cpu_s": round(len(events) / cpu) if cpu > 0 else None,
        "target_events_per_s": STEP_TARGET_EVENTS_PER_S,
        "facts": facts,
        "commands": commands,
        "resizes_committed": state.resizes_committed,
        "resizes_rolled_back": state.resizes_rolled_back,
        "mix": dict(counts.most_common()),
        "us_per_event_by_type": {k: round(spent[k] / counts[k] * 1e6, 2) for k in counts},
    }
    if profile or len(events) / elapsed < STEP_TARGET_EVENTS_PER_S:
        result["profile_top"] = profile_step(core, events[: min(len(events), 100_000)])
    return result


def profile_step(core: Core, events: list[ev.Event]) -> list[dict[str, object]]:
    profiler = cProfile.Profile()
    state = ClusterState()
    profiler.enable()
    for e in events:
        state, _, _ = core.step(state, e)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]  # type: ignore[attr-defined]
    return [
        {
            "function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})",
            "calls": calls,
            "tottime_share": round(tt / total, 3),
            "cumtime_s": round(ct, 3),
        }
        for (file, line, name), (_cc, calls, tt, ct, _callers) in rows
    ]


# -- the store ---------------------------------------------------------------------------------


def bench_append(directory: str, per_step_appends: int) -> dict[str, object]:
    """Appends as the daemon makes them: one durable append per core step with facts."""
    workload = Workload(heartbeats=False, devices=16, heartbeat_every_s=5, progress_every_s=5, flip_every=40,
                        samples=512)
    path = os.path.join(directory, "append.sqlite")
    recorder = SQLiteRecorder(path)
    factlog = FactLog(recorder)
    appends = facts = 0
    started = time.perf_counter()
    for e in workload.events():
        fs, _ = workload.feed(e)
        if fs:
            factlog.append(fs)
            appends += 1
            facts += len(fs)
            if appends >= per_step_appends:
                break
    elapsed = time.perf_counter() - started
    recorder.close()
    return {
        "per_step_appends": appends,
        "per_step_appends_per_s": round(appends / elapsed),
        "per_step_facts_per_s": round(facts / elapsed),
        "note": "each append is one transaction, fsynced (synchronous=FULL) before it returns",
    }


def build_log(
    path: str, facts_wanted: int, snapshot_every: int | None, batch: int
) -> tuple[ClusterState, dict[str, object]]:
    """A log of `facts_wanted` facts from the heartbeat-free workload, appended in batches of
    about `batch`, with snapshots where the daemon would take them."""
    workload = Workload(heartbeats=False, devices=16, heartbeat_every_s=5, progress_every_s=5, flip_every=40,
                        samples=512)
    recorder = SQLiteRecorder(path)
    factlog = FactLog(recorder, snapshot_every=snapshot_every or 1 << 62)
    pending: list[Fact] = []
    total = 0
    core_s = append_s = 0.0
    snapshots = 0
    t0 = time.perf_counter()
    for e in workload.events():
        fs, _ = workload.feed(e)
        if not fs:
            continue
        pending.extend(fs)
        total += len(fs)
        if len(pending) >= batch or total >= facts_wanted:
            t1 = time.perf_counter()
            factlog.append(pending)
            pending = []
            # No snapshot on the last batch: measure the worst case, a restart just before
            # the next snapshot was due (about `snapshot_every` facts to fold).
            if snapshot_every is not None and total < facts_wanted and factlog.maybe_snapshot(workload.state):
                snapshots += 1
            append_s += time.perf_counter() - t1
            if total >= facts_wanted:
                break
    core_s = time.perf_counter() - t0 - append_s
    recorder.close()
    return workload.state, {
        "facts": total,
        "generate_s": round(core_s, 2),
        "append_s": round(append_s, 2),
        "bulk_facts_per_s": round(total / append_s),
        "batch": batch,
        "snapshots_taken": snapshots,
        "file_mb": round(os.path.getsize(path) / 1e6, 1),
    }


def timed_replay(path: str, use_snapshot: bool) -> tuple[float, float, ClusterState]:
    """Wall and CPU seconds to open the log and replay it (CPU time shows the work when other
    processes share the machine)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    recorder = SQLiteRecorder(path)
    state = FactLog(recorder).replay(use_snapshot=use_snapshot)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    recorder.close()
    return elapsed, cpu, state


def bench_replay(
    directory: str, facts: int, snapshot_every: int, batch: int
) -> tuple[dict[str, object], ClusterState]:
    """The replay's figures, and the state the log's workload reached (for `bench_compact`)."""
    path = os.path.join(directory, "replay.sqlite")
    live, built = build_log(path, facts, snapshot_every, batch)
    with_s, with_cpu, from_snapshot = timed_replay(path, use_snapshot=True)
    without_s, without_cpu, from_scratch = timed_replay(path, use_snapshot=False)
    matches = from_snapshot.durable() == live.durable() and from_scratch.durable() == live.durable()
    snap = SQLiteRecorder(path, read_only=True)
    latest = snap.load_snapshot("cluster")
    snap.close()
    return {
        **built,
        "snapshot_every": snapshot_every,
        "latest_snapshot_version": None if latest is None else latest[0],
        "facts_folded_after_snapshot": facts if latest is None else built["facts"] - latest[0],  # type: ignore[operator]
        "replay_s_with_snapshots": round(with_s, 3),
        "replay_s_without_snapshots": round(without_s, 3),
        "replay_cpu_s_with_snapshots": round(with_cpu, 3),
        "replay_cpu_s_without_snapshots": round(without_cpu, 3),
        "target_with_snapshots_s": REPLAY_TARGET_S,
        "replay_matches_live_state": matches,
        "note": "replay = open the file (writer, tail check) + load the latest snapshot + read, CRC-check, "
        "decode and fold every fact after it",
    }, live


def bench_compact(path: str, live: ClusterState, snapshot_every: int) -> dict[str, object]:
    """Compactions as the daemon runs them, timed on the replay's log: one that drops a single
    snapshot interval (a size bound a byte under the log), then a catch-up to half the log capped
    as the daemon caps it (CATCH_UP_INTERVALS intervals)."""
    recorder = SQLiteRecorder(path)
    in_use = recorder.compact("cluster").bytes_in_use  # no bound: drops nothing, measures
    started = time.perf_counter()
    one = recorder.compact("cluster", max_bytes=in_use - 1)
    one_s = time.perf_counter() - started
    started = time.perf_counter()
    capped = recorder.compact("cluster", max_bytes=in_use // 2, max_events=CATCH_UP_INTERVALS * snapshot_every)
    capped_s = time.perf_counter() - started
    matches = FactLog(recorder).replay().durable() == live.durable()
    recorder.close()
    return {
        "compact_one_interval_ms": round(one_s * 1000, 1),
        "compact_one_interval_facts": one.dropped_events,
        "compact_catch_up_ms": round(capped_s * 1000, 1),
        "compact_catch_up_facts": capped.dropped_events,
        "replay_after_compaction_matches": matches,
        "note": "each compaction is one fsynced transaction in the log writer's thread",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--facts", type=int, default=1_000_000, help="facts in the replayed log (default 1M)")
    parser.add_argument("--events", type=int, default=300_000, help="events through step() (default 300k)")
    parser.add_argument("--devices", type=int, default=16, help="devices in the virtual cluster (default 16)")
    parser.add_argument("--snapshot-every", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1_000, help="facts per append when building the log")
    parser.add_argument("--per-step-appends", type=int, default=500, help="fsynced appends to time")
    parser.add_argument("--profile", action="store_true", help="include a cProfile of step() even on target")
    parser.add_argument("--dir", default=None, help="where to put the SQLite files (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.facts < 1 or args.events < 1:
        parser.error("--facts and --events must be >= 1")

    events, live = generate_events(args.events, devices=args.devices, heartbeat_every_s=5.0, progress_every_s=5.0,
                                   flip_every=40, samples=512)
    step = bench_step(events, live, args.profile)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        append = bench_append(directory, args.per_step_appends)
        replay, live = bench_replay(directory, args.facts, args.snapshot_every, args.batch)
        compact = bench_compact(os.path.join(directory, "replay.sqlite"), live, args.snapshot_every)
    result = {
        "benchmark": "core",
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
        },
        "step_events_per_s": step["events_per_s"],
        "replay_facts": replay["facts"],
        "replay_1m_s_with_snapshots": replay["replay_s_with_snapshots"],
        "replay_1m_s_without_snapshots": replay["replay_s_without_snapshots"],
        "append_per_step_appends_per_s": append["per_step_appends_per_s"],
        "append_bulk_facts_per_s": replay["bulk_facts_per_s"],
        "compact_one_interval_ms": compact["compact_one_interval_ms"],
        "meets_step_target": step["events_per_s"] >= STEP_TARGET_EVENTS_PER_S,  # type: ignore[operator]
        "meets_replay_target": replay["replay_s_with_snapshots"] <= REPLAY_TARGET_S,  # type: ignore[operator]
        "step": step,
        "append": append,
        "replay": replay,
        "compact": compact,
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
