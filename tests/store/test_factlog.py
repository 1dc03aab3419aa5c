"""The fact log on every recorder: the core's facts in, the same cluster state out."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from structlog.testing import capture_logs

from dynaresized.core import ClusterState, Core, CoreConfig
from dynaresized.core import events as ev
from dynaresized.core.facts import StepObserved, fact_type
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import load_policy
from dynaresized.core.state import encode_state
from dynaresized.domain import Pool, StepTiming, WorkerKind
from dynaresized.store import ConcurrencyError, CorruptLogError, FactLog, Recorder
from tests.store.conftest import RecorderFactory

DEVICES = tuple(f"node0:gpu{i}" for i in range(8))


class Cluster:
    """A core driven like the daemon drives it: every step's facts are appended (and a
    snapshot maybe taken) before its commands would be sent; every command is acknowledged."""

    def __init__(self, factlog: FactLog, state: ClusterState | None = None) -> None:
        guards = GuardConfig(min_dwell_s=0, cooldown_steps=2, signal_run=2)
        self.core = Core(CoreConfig(guards=guards), load_policy("hysteresis"))
        self.factlog = factlog
        self.state = state if state is not None else ClusterState()
        self.now = 0.0
        self.step = 0

    def feed(self, event: ev.Event) -> None:
        self.state, facts, commands = self.core.step(self.state, event)
        self.factlog.append(facts)
        self.factlog.maybe_snapshot(self.state)
        for c in commands:
            self.feed(ev.OpReported(at=event.at, worker_id=c.worker_id, op_id=c.op.op_id, ok=True))

    def start(self) -> None:
        self.feed(ev.Configure(at=0, devices=DEVICES, pools=(Pool.TRAINING,) * 6 + (Pool.ROLLOUT,) * 2))
        for i, d in enumerate(DEVICES):
            self.feed(ev.WorkerHello(at=0, worker_id=f"engine-{i}", kind=WorkerKind.ROLLOUT_ENGINE, devices=(d,)))
            self.feed(ev.WorkerHello(at=0, worker_id=f"trainer-{i}", kind=WorkerKind.TRAINER_RANK, devices=(d,)))

    def run_steps(self, n: int, rollout_s: float, train_s: float) -> None:
        for _ in range(n):
            self.now += 10
            split = self.state.split
            for i, d in enumerate(DEVICES):
                if d in self.state.pool_devices(Pool.ROLLOUT):
                    self.feed(ev.ProgressReported(at=self.now, worker_id=f"engine-{i}", step=self.step, done=3,
                                                  total=8))
            timing = StepTiming(step=self.step, rollout_s=rollout_s, train_s=train_s,
                                rollout_devices=split.rollout, train_devices=split.train)
            self.feed(ev.StepReported(at=self.now, worker_id="trainer-0", timing=timing))
            self.step += 1


def facts_in(recorder: Recorder) -> list[str]:
    return [e.type for e in recorder.read("cluster")]


def test_replay_equals_the_live_state_with_and_without_snapshots(make_recorder: RecorderFactory) -> None:
    recorder = make_recorder()
    cluster = Cluster(FactLog(recorder, snapshot_every=7))
    cluster.start()
    cluster.run_steps(6, rollout_s=255, train_s=100)  # rollout slower: devices move to it
    cluster.run_steps(8, rollout_s=80, train_s=200)  # then back
    assert cluster.state.resizes_committed >= 2
    types = facts_in(recorder)
    assert {"resize_started", "op_acked", "op_completed", "resize_committed", "step_observed"} <= set(types)
    assert len(types) == cluster.state.version == cluster.factlog.version
    snapshot = recorder.load_snapshot("cluster")
    assert snapshot is not None and cluster.state.version - snapshot[0] < 7
    assert FactLog(recorder).replay().durable() == cluster.state.durable()
    assert FactLog(recorder).replay(use_snapshot=False).durable() == cluster.state.durable()


def test_a_restarted_daemon_continues_the_log(make_recorder: RecorderFactory) -> None:
    recorder = make_recorder()
    first = Cluster(FactLog(recorder, snapshot_every=5))
    first.start()
    first.run_steps(4, rollout_s=255, train_s=100)
    if make_recorder.kind == "sqlite":
        first.factlog.close()
        recorder = make_recorder()  # the same file, as a restarted daemon opens it
    factlog = FactLog(recorder, snapshot_every=5)
    assert factlog.version == first.state.version
    second = Cluster(factlog, state=factlog.replay())
    second.step, second.now = first.step, first.now
    assert second.state.durable() == first.state.durable()
    second.feed(ev.DaemonStarted(at=second.now + 1))
    second.run_steps(6, rollout_s=80, train_s=200)
    assert FactLog(recorder).replay().durable() == second.state.durable()
    assert FactLog(recorder).replay(use_snapshot=False).durable() == second.state.durable()


def test_a_second_writer_on_the_stream_is_stopped(recorder: Recorder) -> None:
    ours, theirs = FactLog(recorder), FactLog(recorder)
    fact = StepObserved(at=1.0, worker_id="trainer-0", timing=StepTiming(step=0, rollout_s=1, train_s=1))
    ours.append([fact])
    with pytest.raises(ConcurrencyError, match="stream 'cluster' is at version 1, but the append expected version 0"):
        theirs.append([fact])
    ours.append([fact, fact])
    assert ours.version == 3 and facts_in(recorder) == [fact_type(fact)] * 3
    ours.append([])  # nothing to record: no write
    assert recorder.last_position() == 3


def test_snapshots_every_n_facts_and_only_of_recorded_state(recorder: Recorder) -> None:
    factlog = FactLog(recorder, snapshot_every=3)
    taken = []
    for n, fact in enumerate(_facts(7), start=1):
        factlog.append([fact])
        taken.append(factlog.maybe_snapshot(_fold_first(recorder, n)))
    assert taken == [False, False, True, False, False, True, False]
    assert recorder.load_snapshot("cluster") == (6, encode_state(_fold_first(recorder, 6)))
    factlog.append(list(_facts(1)))
    with pytest.raises(ValueError, match="folded 7 facts but stream 'cluster' holds 8"):
        factlog.maybe_snapshot(_fold_first(recorder, 7))
    with pytest.raises(ValueError, match="snapshot_every must be >= 1"):
        FactLog(recorder, snapshot_every=0)


def _fold_first(recorder: Recorder, n: int) -> ClusterState:
    from dynaresized.core.facts import decode_fact
    from dynaresized.core.state import fold

    return fold(decode_fact(e.data) for e in recorder.read("cluster", limit=n))


def _facts(n: int) -> Iterable[StepObserved]:
    for i in range(n):
        yield StepObserved(at=float(i), worker_id="trainer-0", timing=StepTiming(step=i, rollout_s=1, train_s=1))


@pytest.mark.parametrize("bad", ["undecodable", "wrong_version"])
def test_an_unusable_snapshot_falls_back_to_a_full_replay(recorder: Recorder, bad: str) -> None:
    factlog = FactLog(recorder)
    factlog.append(list(_facts(5)))
    expected = _fold_first(recorder, 5)
    if bad == "undecodable":
        recorder.save_snapshot("cluster", 5, b"\xc1 not msgpack")
    else:
        recorder.save_snapshot("cluster", 5, encode_state(_fold_first(recorder, 3)))  # claims 5, holds 3
    with capture_logs() as logs:
        state = FactLog(recorder).replay()
    assert state.durable() == expected.durable()
    assert [e["event"] for e in logs] == ["store.snapshot_unusable"]
    assert "replaying the whole log" in logs[0]["reason"]


def test_a_record_that_is_not_a_fact_stops_the_replay(recorder: Recorder) -> None:
    FactLog(recorder).append(list(_facts(2)))
    recorder.append("cluster", 2, [("step_observed", b"\x93\x01\x02\x03")])
    with pytest.raises(CorruptLogError, match=r"stream 'cluster' version 3 \(position 3, type 'step_observed'\)"):
        FactLog(recorder).replay()
