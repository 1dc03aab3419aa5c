"""The resize state machine driven event by event: the transition table, a resize op by op in
both directions, rollback, degraded, timeouts, lost workers, daemon restarts and refusals."""

from __future__ import annotations

import math

import pytest

from dynaresized.core import ClusterState, IllegalTransition, Phase, Refused, SendOp
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.machine import TRANSITIONS
from dynaresized.core.state import PHASE_OF_OP, fold
from dynaresized.domain import (
    FORWARD_ORDER,
    UNDO,
    ActualState,
    Holding,
    OpKind,
    Pool,
    Split,
    StepTiming,
    WorkerKind,
    WorkerStatus,
    moving,
    placed,
)

from .cluster import Driver, boot, device, engine, make_core, snapshot, trainer

# -- helpers ---------------------------------------------------------------------------


def kinds(facts: list[f.Fact]) -> list[type]:
    return [type(x) for x in facts]


def assert_refused(d: Driver, event: ev.Event, code: str, *words: str) -> Refused:
    """The event is refused with `code`, its message names `words`, and nothing changed."""
    before = d.state
    frozen = snapshot(before)
    log_len = len(d.log)
    with pytest.raises(Refused) as info:
        d.send(event)
    assert info.value.code == code
    for w in words:
        assert w in info.value.message
    assert d.state is before
    assert snapshot(d.state) == frozen
    assert len(d.log) == log_len
    return info.value


def pools(state: ClusterState) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return state.pool_devices(Pool.TRAINING), state.pool_devices(Pool.ROLLOUT)


def step_event(worker: str, step: int, rollout_s: float, train_s: float, at: float, **kw: float) -> ev.StepReported:
    return ev.StepReported(at=at, worker_id=worker, timing=StepTiming(step=step, rollout_s=rollout_s,
                                                                      train_s=train_s, **kw))


# Resizes used throughout: (start split, target split, moved devices, sources, destinations, committers)
TO_ROLLOUT = ((3, 1), (2, 2), (device(2),), (trainer(2),), (engine(2),),
              (trainer(0), trainer(1), engine(2), engine(3)))
TO_TRAINING = ((1, 3), (2, 2), (device(3),), (engine(3),), (trainer(3),),
               (trainer(0), engine(1), engine(2), trainer(3)))
TWO_TO_ROLLOUT = ((4, 2), (2, 4), (device(2), device(3)), (trainer(2), trainer(3)), (engine(2), engine(3)),
                  (trainer(0), trainer(1), engine(2), engine(3), engine(4), engine(5)))
RESIZES = [pytest.param(TO_ROLLOUT, id="training->rollout"), pytest.param(TO_TRAINING, id="rollout->training"),
           pytest.param(TWO_TO_ROLLOUT, id="two-devices")]


def targets_of(kind: OpKind, case: tuple) -> tuple[str, ...]:
    _, _, _, src, dst, committers = case
    return {OpKind.DRAIN: src, OpKind.RELEASE: src, OpKind.JOIN: dst, OpKind.RESTORE: dst,
            OpKind.COMMIT: committers}[kind]


def start(case: tuple, **core_kw: float) -> Driver:
    (train, rollout), (t_train, t_rollout), *_ = case
    d = boot(make_core(**core_kw), train, rollout)
    facts, _ = d.force(t_train, t_rollout)
    assert kinds(facts) == [f.ResizeStarted], facts
    return d


def expected_pools(state: ClusterState, devices: tuple[str, ...], land: Pool) -> tuple[tuple, tuple]:
    training = sorted(d for d, p in state.devices.items()
                      if p.pool is Pool.TRAINING or (d in devices and land is Pool.TRAINING))
    rollout = sorted(d for d in state.devices if d not in training)
    return tuple(training), tuple(rollout)


def advance_to(d: Driver, op_index: int) -> None:
    for _ in range(op_index):
        d.ack_current()


# -- the transition table ----------------------------------------------------------------

SAMPLE_EVENTS: dict[type, ev.Event] = {
    ev.Configure: ev.Configure(at=50.0, devices=("x:gpu0",), pools=(Pool.TRAINING,)),
    ev.DaemonStarted: ev.DaemonStarted(at=50.0),
    ev.Tick: ev.Tick(at=50.0),
    ev.WorkerHello: ev.WorkerHello(at=50.0, worker_id="new", kind=WorkerKind.TRAINER_RANK, devices=("x:gpu9",)),
    ev.Heartbeat: ev.Heartbeat(at=50.0, worker_id="tr0"),
    ev.WorkerBye: ev.WorkerBye(at=50.0, worker_id="tr0"),
    ev.StepReported: step_event("tr0", 0, 10.0, 10.0, 50.0),
    ev.ProgressReported: ev.ProgressReported(at=50.0, worker_id="eng3", step=0, done=1, total=2),
    ev.OpReported: ev.OpReported(at=50.0, worker_id="tr2", op_id="r1/0-drain", ok=True),
    ev.ResizeRequested: ev.ResizeRequested(at=50.0, target=Split(train=1, rollout=3)),
    ev.RegroupRequested: ev.RegroupRequested(at=50.0, devices=("n0:gpu3",), tp=1),
    ev.PauseRequested: ev.PauseRequested(at=50.0),
    ev.ResumeRequested: ev.ResumeRequested(at=50.0),
    ev.ShutdownRequested: ev.ShutdownRequested(at=50.0),
    ev.ConfigReloaded: ev.ConfigReloaded(at=50.0, policy="static", guards_changed={"signal_run": (1, 2)}),
    ev.ReloadRefused: ev.ReloadRefused(at=50.0, reason="the file does not parse"),
    ev.AbortRequested: ev.AbortRequested(at=50.0),
    ev.StateReported: ev.StateReported(at=50.0, worker_id="tr0", actual=ActualState(holding=Holding.SERVING)),
    ev.EngineQueueEmpty: ev.EngineQueueEmpty(at=50.0, worker_id="eng3", step=1, running=0),
    ev.MiniBatchDone: ev.MiniBatchDone(at=50.0, worker_id="tr0", step=0, done=1, total=4),
}


def in_phase(phase: Phase) -> Driver:
    """A 3:1 cluster with a training->rollout resize brought to `phase`."""
    if phase is Phase.STEADY:
        return boot(make_core(), 3, 1)
    if phase is Phase.RECONCILING:
        d = boot(make_core(), 3, 1)
        d.send(ev.WorkerHello(at=d.at(), worker_id=trainer(0), kind=WorkerKind.TRAINER_RANK, devices=(device(0),),
                              actual=ActualState(holding=Holding.RELEASED)))
        assert d.state.phase is phase
        return d
    d = start(TO_ROLLOUT)
    if phase is Phase.ROLLING_BACK:
        d.ack(trainer(2), ok=False, detail="engine crashed")
    elif phase is Phase.DEGRADED:
        advance_to(d, 4)
        d.ack(trainer(0), ok=False, detail="optimizer step failed")
    else:
        advance_to(d, [PHASE_OF_OP[k] for k in FORWARD_ORDER].index(phase))
    assert d.state.phase is phase
    return d


def test_sample_events_cover_every_event_type() -> None:
    every = set(ev.Event.__subclasses__())
    assert set(SAMPLE_EVENTS) == every
    handled = set().union(*(set(t) for t in TRANSITIONS.values()))
    assert handled == every, "an event type no phase accepts"
    assert set(TRANSITIONS) == set(Phase)


def test_the_table_forbids_exactly_these_transitions() -> None:
    illegal = {(p, t) for p in Phase for t in SAMPLE_EVENTS if t not in TRANSITIONS[p]}
    expected = {(p, ev.Configure) for p in Phase if p is not Phase.STEADY}
    expected |= {(Phase.STEADY, ev.OpReported), (Phase.DEGRADED, ev.OpReported)}
    assert illegal == expected


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_illegal_transition_raises_naming_phase_and_event_and_changes_nothing(phase: Phase) -> None:
    d = in_phase(phase)
    illegal = [t for t in SAMPLE_EVENTS if t not in TRANSITIONS[phase]]
    assert illegal, f"phase {phase.value} accepts every event"
    for event_type in illegal:
        event = SAMPLE_EVENTS[event_type]
        before = d.state
        frozen = snapshot(before)
        log_len = len(d.log)
        with pytest.raises(IllegalTransition) as info:
            d.send(event)
        assert info.value.phase is phase
        assert info.value.event is event
        assert phase.value in str(info.value) and event_type.__name__ in str(info.value)
        assert d.state is before and snapshot(d.state) == frozen and len(d.log) == log_len


def test_op_report_in_steady_is_illegal() -> None:
    d = boot(make_core(), 3, 1)
    frozen = snapshot(d.state)
    with pytest.raises(IllegalTransition, match="OpReported.*'steady'"):
        d.core.step(d.state, ev.OpReported(at=1.0, worker_id=trainer(0), op_id="r1/0-drain", ok=True))
    assert snapshot(d.state) == frozen


def test_configure_twice_is_refused() -> None:
    d = boot(make_core(), 3, 1)
    assert_refused(d, ev.Configure(at=1.0, devices=(device(0),), pools=(Pool.ROLLOUT,)), "already_configured")


@pytest.mark.parametrize(
    "event",
    [
        ev.Configure(at=0.0, devices=(), pools=()),
        ev.Configure(at=0.0, devices=("a", "a"), pools=(Pool.TRAINING, Pool.ROLLOUT)),
        ev.Configure(at=0.0, devices=("a", "b"), pools=(Pool.TRAINING,)),
        ev.Configure(at=0.0, devices=("a", "b"), pools=(Pool.TRAINING, Pool.ROLLOUT),
                     candidates=(Split(train=2, rollout=1),)),
        ev.Configure(at=0.0, devices=("a", "b"), pools=(Pool.TRAINING, Pool.ROLLOUT),
                     candidates=(Split(train=3, rollout=-1),)),
    ],
    ids=["empty", "duplicate", "pools-misaligned", "candidate-too-big", "candidate-negative"],
)
def test_bad_configure_is_refused(event: ev.Configure) -> None:
    assert_refused(Driver(make_core()), event, "bad_config")


# -- a resize, op by op ------------------------------------------------------------------


@pytest.mark.parametrize("case", RESIZES)
def test_full_resize_op_by_op(case: tuple) -> None:
    (train, rollout), (t_train, t_rollout), moved, *_ = case
    d = boot(make_core(), train, rollout)
    before_pools = pools(d.state)
    from_pool = Pool.TRAINING if t_train < train else Pool.ROLLOUT
    to_pool = from_pool.other
    facts, commands = d.force(t_train, t_rollout)
    assert kinds(facts) == [f.ResizeStarted]
    plan = facts[0].plan
    assert plan.devices == moved and (plan.from_pool, plan.to_pool) == (from_pool, to_pool)
    assert plan.before == Split(train, rollout) and plan.after == Split(t_train, t_rollout)
    assert [op.kind for op in plan.ops] == list(FORWARD_ORDER)
    for dev in moved:
        assert d.state.devices[dev] == moving(from_pool, to_pool)
    after_pools = expected_pools(d.state, moved, to_pool)

    for kind in FORWARD_ORDER:
        op = d.state.inflight.op
        assert op.kind is kind and d.state.phase is PHASE_OF_OP[kind]
        assert op.targets == targets_of(kind, case)
        # the commands that started this op: one per target, carrying the post-resize pools
        assert sorted(c.worker_id for c in commands) == sorted(op.targets)
        for c in commands:
            assert c.op == op and c.resize_id == plan.resize_id
            assert c.deadline == d.state.inflight.op_deadline
            assert (c.training, c.rollout) == after_pools
        *first, last = op.targets
        for w in first:
            facts, cmds = d.ack(w)
            assert kinds(facts) == [f.OpAcked] and cmds == []
            facts, cmds = d.ack(w)  # a duplicate answer counts once
            assert facts == [] and cmds == []
        facts, commands = d.ack(last)
        if kind is OpKind.COMMIT:
            assert kinds(facts) == [f.OpAcked, f.OpCompleted, f.ResizeCommitted]
            assert commands == []
        else:
            assert kinds(facts) == [f.OpAcked, f.OpCompleted]
            assert facts[1].op_id == op.op_id

    s = d.state
    assert s.phase is Phase.STEADY and s.inflight is None
    assert s.split == Split(t_train, t_rollout)
    assert all(s.devices[dev] == placed(to_pool) for dev in moved)
    assert pools(s) == after_pools and pools(s) != before_pools
    assert s.resizes_started == s.resizes_committed == 1
    assert s.history.last_resize_end_at == d.now
    assert d.replayed().durable() == s.durable()


def test_wrong_op_id_and_non_target_are_refused() -> None:
    d = start(TO_ROLLOUT)
    current = d.state.inflight.op.op_id
    assert_refused(d, ev.OpReported(at=d.at(), worker_id=trainer(2), op_id="r1/3-restore", ok=True),
                   "stale_op", "r1/3-restore", current)
    assert_refused(d, ev.OpReported(at=d.at(), worker_id=trainer(2), op_id="r0/0-drain", ok=False),
                   "stale_op")
    assert_refused(d, ev.OpReported(at=d.at(), worker_id=engine(0), op_id=current, ok=True),
                   "not_a_target", engine(0))
    assert_refused(d, ev.OpReported(at=d.at(), worker_id="ghost", op_id=current, ok=True), "unknown_worker")
    d.ack_current()
    # the answer to an op that already completed is stale, not a second ack
    assert_refused(d, ev.OpReported(at=d.at(), worker_id=trainer(2), op_id=current, ok=True), "stale_op")


@pytest.mark.parametrize("case", RESIZES)
@pytest.mark.parametrize("fail_at", range(4), ids=[k.value for k in FORWARD_ORDER[:4]])
def test_op_failure_rolls_back_with_undo_ops_in_reverse_order(case: tuple, fail_at: int) -> None:
    (train, rollout), target, moved, *_ = case
    d = start(case)
    plan = d.state.inflight.plan
    before_pools = expected_pools(d.state, moved, plan.from_pool)
    advance_to(d, fail_at)
    op = d.state.inflight.op
    assert op.kind is FORWARD_ORDER[fail_at]
    culprit = op.targets[-1]
    facts, commands = d.ack(culprit, ok=False, detail="CUDA error: out of memory")
    assert kinds(facts) == [f.OpFailed, f.ResizeAborted]
    assert facts[0].op_id == op.op_id and facts[0].worker_id == culprit
    assert "CUDA error: out of memory" in facts[0].reason and op.kind.value in facts[0].reason
    abort = facts[1]
    assert abort.reason == facts[0].reason and abort.resize_id == plan.resize_id

    touched = FORWARD_ORDER[: fail_at + 1]
    expected = [UNDO[k] for k in reversed(touched) if k in UNDO]
    assert [u.kind for u in abort.undo] == expected
    forward = {o.kind: o for o in plan.ops}
    for u in abort.undo:
        undone = next(k for k, v in UNDO.items() if v is u.kind)
        assert u.targets == forward[undone].targets  # every target is still live
        assert u.devices == moved
    assert len({u.op_id for u in abort.undo} | {o.op_id for o in plan.ops}) == len(abort.undo) + len(plan.ops)

    s = d.state
    assert s.phase is Phase.ROLLING_BACK
    assert all(s.devices[dev] == moving(plan.from_pool, plan.to_pool) for dev in moved)
    # the undo ops go out one at a time, in order, and tell workers the pools they return to
    for i, u in enumerate(abort.undo):
        assert d.state.inflight.op == u
        assert sorted(c.worker_id for c in commands) == sorted(u.targets)
        for c in commands:
            assert c.op == u
            assert (c.training, c.rollout) == before_pools
        commands = d.ack_current()
    assert kinds(d.log[-2:]) == [f.OpCompleted, f.ResizeRolledBack]
    assert d.log[-1].reason == abort.reason
    s = d.state
    assert s.phase is Phase.STEADY and s.inflight is None
    assert s.split == Split(train, rollout)
    assert all(s.devices[dev] == placed(plan.from_pool) for dev in moved)
    assert s.resizes_rolled_back == 1 and s.resizes_committed == 0
    assert s.history.last_resize_end_at == d.now
    assert d.replayed().durable() == s.durable()


@pytest.mark.parametrize("case", RESIZES)
def test_commit_failure_degrades_with_devices_in_the_new_pool(case: tuple) -> None:
    _, (t_train, t_rollout), moved, *_ = case
    d = start(case)
    plan = d.state.inflight.plan
    advance_to(d, 4)
    assert d.state.phase is Phase.COMMITTING
    facts, commands = d.ack(d.state.inflight.op.targets[0], ok=False, detail="allreduce hung")
    assert kinds(facts) == [f.OpFailed, f.Degraded] and commands == []
    assert facts[1].placed_in is plan.to_pool and "commit failed" in facts[1].reason
    s = d.state
    assert s.phase is Phase.DEGRADED and s.inflight is None
    assert s.split == Split(t_train, t_rollout)
    assert not any(p.is_moving for p in s.devices.values())
    assert "allreduce hung" in s.degraded_reason
    # degraded: no resize until an operator resumes
    facts, _ = d.force(plan.before.train, plan.before.rollout)
    assert kinds(facts) == [f.ProposalRejected] and facts[0].guard == "degraded"
    facts, _ = d.send(step_event(trainer(0), 1, 50.0, 10.0, d.at()))
    assert kinds(facts) == [f.StepObserved]
    facts, _ = d.send(ev.ResumeRequested(at=d.at(), requested_by="alice"))
    assert kinds(facts) == [f.ResizingResumed]
    assert d.state.phase is Phase.STEADY and d.state.degraded_reason == ""
    facts, _ = d.force(plan.before.train, plan.before.rollout)
    assert kinds(facts) == [f.ResizeStarted]
    assert d.replayed().durable() == d.state.durable()


@pytest.mark.parametrize("case", RESIZES)
def test_rollback_failure_degrades_with_devices_back_home(case: tuple) -> None:
    (train, rollout), _, moved, *_ = case
    d = start(case)
    plan = d.state.inflight.plan
    advance_to(d, 2)
    d.ack(d.state.inflight.op.targets[0], ok=False, detail="join failed")
    assert d.state.phase is Phase.ROLLING_BACK
    d.ack_current()  # evict ok
    facts, commands = d.ack(d.state.inflight.op.targets[0], ok=False, detail="engine will not wake")
    assert kinds(facts) == [f.OpFailed, f.Degraded] and commands == []
    assert facts[1].placed_in is plan.from_pool and facts[1].reason.startswith("rollback failed")
    assert d.state.phase is Phase.DEGRADED and d.state.split == Split(train, rollout)
    assert all(d.state.devices[dev] == placed(plan.from_pool) for dev in moved)
    assert d.replayed().durable() == d.state.durable()


def test_op_timeout_via_tick_rolls_back_then_degrades() -> None:
    d = start(TO_ROLLOUT, heartbeat_timeout_s=1e9, op_timeout_s=120.0)
    deadline = d.state.inflight.op_deadline
    assert deadline == d.now + 120.0
    facts, commands = d.send(ev.Tick(at=deadline))
    assert facts == [] and commands == []  # the deadline itself is still in time
    facts, commands = d.send(ev.Tick(at=deadline + 0.5))
    assert kinds(facts) == [f.OpFailed, f.ResizeAborted]
    assert facts[0].worker_id is None
    assert "drain timed out" in facts[0].reason and trainer(2) in facts[0].reason
    assert [c.op.kind for c in commands] == [OpKind.RESUME]
    assert d.state.inflight.op_deadline == deadline + 0.5 + 120.0
    facts, _ = d.send(ev.Tick(at=deadline + 0.5 + 121.0))
    assert kinds(facts) == [f.OpFailed, f.Degraded]
    assert facts[1].placed_in is Pool.TRAINING and "resume timed out" in facts[1].reason
    assert d.state.split == Split(3, 1) and d.state.phase is Phase.DEGRADED
    assert d.replayed().durable() == d.state.durable()


def test_op_timeout_mid_resize_undoes_what_was_done() -> None:
    d = start(TO_TRAINING, heartbeat_timeout_s=1e9)
    advance_to(d, 2)  # drain, release done; join in flight
    facts, commands = d.send(ev.Tick(at=d.state.inflight.op_deadline + 1))
    assert kinds(facts) == [f.OpFailed, f.ResizeAborted]
    assert [u.kind for u in facts[1].undo] == [OpKind.EVICT, OpKind.RECLAIM, OpKind.RESUME]
    assert [c.worker_id for c in commands] == [trainer(3)]


def test_commit_timeout_degrades_in_the_new_pool() -> None:
    d = start(TO_ROLLOUT, heartbeat_timeout_s=1e9)
    advance_to(d, 4)
    facts, _ = d.send(ev.Tick(at=d.state.inflight.op_deadline + 1))
    assert kinds(facts) == [f.OpFailed, f.Degraded] and facts[1].placed_in is Pool.ROLLOUT
    assert d.state.split == Split(2, 2)


@pytest.mark.parametrize("case", RESIZES)
@pytest.mark.parametrize("abort_at", range(4), ids=[k.value for k in FORWARD_ORDER[:4]])
def test_abort_requested_rolls_back_a_forward_op(case: tuple, abort_at: int) -> None:
    d = start(case)
    advance_to(d, abort_at)
    op = d.state.inflight.op
    facts, commands = d.send(ev.AbortRequested(at=d.at(), requested_by="alice", reason="drain is stuck"))
    assert kinds(facts)[:2] == [f.OpFailed, f.ResizeAborted]
    assert facts[0].op_id == op.op_id and facts[0].worker_id is None
    assert facts[1].reason == "aborted by alice: drain is stuck"
    expected = [UNDO[k] for k in reversed(FORWARD_ORDER[: abort_at + 1]) if k in UNDO]
    assert [u.kind for u in facts[1].undo] == expected
    assert {c.op.kind for c in commands} == {expected[0]}
    d.finish()
    assert d.state.split == Split(*case[0])
    assert d.state.resizes_rolled_back == 1


@pytest.mark.parametrize("phase", [Phase.STEADY, Phase.COMMITTING, Phase.ROLLING_BACK, Phase.DEGRADED],
                         ids=lambda p: p.value)
def test_abort_requested_is_a_no_op_past_the_point_of_no_return_or_without_a_resize(phase: Phase) -> None:
    d = in_phase(phase)
    before = d.state
    facts, commands = d.send(ev.AbortRequested(at=d.at(), requested_by="alice"))
    assert facts == [] and commands == []
    assert d.state == before


# -- lost workers -----------------------------------------------------------------------


def test_heartbeat_deadline_declares_a_worker_lost_and_rolls_back() -> None:
    d = start(TO_TRAINING, heartbeat_timeout_s=10.0)
    advance_to(d, 2)  # join in flight on tr3
    assert d.state.inflight.op.targets == (trainer(3),)
    t = d.at(1.0)
    for w in sorted(d.state.workers):
        if w != trainer(3):
            d.send(ev.Heartbeat(at=t, worker_id=w))
    facts, commands = d.send(ev.Tick(at=10.5))  # tr3 last seen at 0
    assert kinds(facts) == [f.WorkerLost, f.OpFailed, f.ResizeAborted, f.OpCompleted]
    assert facts[0].worker_id == trainer(3) and "no heartbeat" in facts[0].reason
    assert facts[1].worker_id == trainer(3) and "lost during join" in facts[1].reason
    undo = facts[2].undo
    assert [u.kind for u in undo] == [OpKind.EVICT, OpKind.RECLAIM, OpKind.RESUME]
    assert undo[0].targets == ()  # nobody left to evict from: completes at once
    assert undo[1].targets == (engine(3),)
    assert [(c.worker_id, c.op.kind) for c in commands] == [(engine(3), OpKind.RECLAIM)]
    assert d.state.workers[trainer(3)].status is WorkerStatus.LOST
    d.finish()
    assert d.state.split == Split(1, 3) and d.state.resizes_rolled_back == 1
    assert d.replayed().durable() == d.state.durable()


def test_worker_lost_during_rollback_does_not_block_it() -> None:
    d = start(TO_ROLLOUT)
    advance_to(d, 2)
    d.ack(engine(2), ok=False, detail="no")
    assert d.state.inflight.op.kind is OpKind.EVICT
    facts, _ = d.send(ev.WorkerBye(at=d.at(), worker_id=engine(2)))
    assert kinds(facts) == [f.WorkerLeft, f.OpCompleted]
    assert d.state.inflight.op.kind is OpKind.RECLAIM
    d.finish()
    assert d.state.split == Split(3, 1) and d.state.phase is Phase.STEADY


def test_worker_lost_during_commit_does_not_block_it() -> None:
    d = start(TO_ROLLOUT)
    advance_to(d, 4)
    d.ack(trainer(0))
    facts, _ = d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(1)))
    assert kinds(facts) == [f.WorkerLeft]
    d.ack(engine(2))
    facts, _ = d.ack(engine(3))
    assert kinds(facts) == [f.OpAcked, f.OpCompleted, f.ResizeCommitted]
    assert d.state.split == Split(2, 2)


def test_uninvolved_worker_loss_does_not_disturb_a_resize() -> None:
    d = start(TO_ROLLOUT)
    # engine 0 sits on a training device: it is in no op of this resize
    facts, _ = d.send(ev.WorkerBye(at=d.at(), worker_id=engine(0)))
    assert kinds(facts) == [f.WorkerLeft]
    assert d.state.phase is Phase.DRAINING
    d.finish()
    assert d.state.resizes_committed == 1


# -- daemon restart and reconciliation ----------------------------------------------------


def test_daemon_restart_mid_resize_gives_a_fresh_deadline_and_reconciles_on_hello() -> None:
    d = start(TO_ROLLOUT, heartbeat_timeout_s=10.0, op_timeout_s=120.0)
    advance_to(d, 4)
    commit = d.state.inflight.op
    d.ack(trainer(0))
    d.ack(engine(2))
    old_deadline = d.state.inflight.op_deadline
    # the daemon dies; a new one folds the log and starts long after the old deadline
    restarted = Driver(d.core, d.replayed(), now=old_deadline + 100.0)
    restarted.log = list(d.log)
    t = restarted.now
    facts, commands = restarted.send(ev.DaemonStarted(at=t))
    assert kinds(facts) == [f.DaemonRestarted] and commands == []
    assert facts[0].op_deadline == t + 120.0
    assert restarted.state.inflight.op_deadline == t + 120.0
    assert restarted.state.inflight.acked == (trainer(0), engine(2))
    facts, _ = restarted.send(ev.Tick(at=t + 5.0))  # every live worker has a fresh grace period
    assert facts == []
    # a pending target re-registers: it gets the same op again, with the new deadline
    facts, commands = restarted.send(ev.WorkerHello(at=t + 6.0, worker_id=trainer(1), kind=WorkerKind.TRAINER_RANK,
                                                    devices=(device(1),)))
    assert kinds(facts) == [f.WorkerRegistered] and facts[0].worker.incarnation == 2
    assert [(c.worker_id, c.op) for c in commands] == [(trainer(1), commit)]
    assert commands[0].deadline == t + 120.0
    # one that already answered does not
    facts, commands = restarted.send(ev.WorkerHello(at=t + 6.0, worker_id=engine(2),
                                                    kind=WorkerKind.ROLLOUT_ENGINE, devices=(device(2),)))
    assert kinds(facts) == [f.WorkerRegistered] and commands == []
    restarted.finish()
    assert restarted.state.split == Split(2, 2)
    assert restarted.replayed().durable() == restarted.state.durable()


def test_daemon_restart_without_a_resize_and_after_shutdown() -> None:
    d = boot(make_core(), 3, 1)
    d.send(ev.ShutdownRequested(at=d.at()))
    assert d.state.stopping
    facts, _ = d.send(ev.DaemonStarted(at=d.at()))
    assert kinds(facts) == [f.DaemonRestarted] and facts[0].op_deadline is None
    assert not d.state.stopping


# -- serialization, pause, shutdown ----------------------------------------------------------


def test_forced_resize_while_one_is_in_flight_is_rejected() -> None:
    d = start(TO_ROLLOUT)
    advance_to(d, 1)
    inflight = d.state.inflight
    devices = dict(d.state.devices)
    facts, commands = d.force(1, 3)
    assert kinds(facts) == [f.ProposalRejected] and commands == []
    assert facts[0].guard == "in_flight" and "r1" in facts[0].reason and facts[0].target == Split(1, 3)
    assert d.state.inflight == inflight and d.state.devices == devices
    assert d.state.resizes_started == 1


def test_forced_resize_to_the_current_split_or_below_minimum_is_rejected() -> None:
    d = boot(make_core(), 3, 1)
    facts, _ = d.force(3, 1)
    assert facts[0].guard == "candidates"
    facts, _ = d.force(4, 0)
    assert facts[0].guard == "min_pool"
    facts, _ = d.force(2, 1)
    assert facts[0].guard == "candidates" and "all 4 devices" in facts[0].reason
    assert d.state.inflight is None and d.state.resizes_started == 0


def test_forced_resize_without_a_worker_to_take_over_is_rejected() -> None:
    d = boot(make_core(), 3, 1)
    for i in range(4):
        d.send(ev.WorkerBye(at=d.at(), worker_id=engine(i)))
    facts, _ = d.force(2, 2)
    assert kinds(facts) == [f.ProposalRejected] and facts[0].guard == "capacity"
    assert "rollout-engine" in facts[0].reason


def test_pause_and_resume() -> None:
    d = boot(make_core(policy="hysteresis"), 3, 1)
    facts, _ = d.send(ev.PauseRequested(at=d.at(), requested_by="alice", reason="debugging"))
    assert kinds(facts) == [f.ResizingPaused] and facts[0].reason == "debugging"
    facts, _ = d.send(ev.PauseRequested(at=d.at()))
    assert facts == []  # already paused
    facts, _ = d.send(step_event(trainer(0), 0, 100.0, 10.0, d.at(), rollout_devices=1, train_devices=3))
    assert kinds(facts) == [f.StepObserved]  # the policy is not consulted while paused
    facts, _ = d.send(ev.ResumeRequested(at=d.at(), requested_by="alice"))
    assert kinds(facts) == [f.ResizingResumed] and not d.state.paused
    facts, _ = d.send(ev.ResumeRequested(at=d.at()))
    assert facts == []  # nothing to resume
    facts, _ = d.send(step_event(trainer(0), 1, 100.0, 10.0, d.at(), rollout_devices=1, train_devices=3))
    assert kinds(facts) == [f.StepObserved, f.ResizeStarted]
    assert facts[1].plan.to_pool is Pool.ROLLOUT
    assert d.replayed().durable() == d.state.durable()


def test_shutdown_starts_no_new_resize_but_finishes_the_one_in_flight() -> None:
    d = boot(make_core(policy="hysteresis"), 3, 1)
    d.force(2, 2)
    facts, _ = d.send(ev.ShutdownRequested(at=d.at()))
    assert kinds(facts) == [f.ShutdownStarted]
    facts, _ = d.send(ev.ShutdownRequested(at=d.at()))
    assert facts == []
    d.finish()
    assert d.state.resizes_committed == 1
    facts, _ = d.send(step_event(trainer(0), 0, 100.0, 10.0, d.at(), rollout_devices=2, train_devices=2))
    assert kinds(facts) == [f.StepObserved]
    facts, _ = d.force(1, 3)
    assert kinds(facts) == [f.ProposalRejected] and facts[0].guard == "stopping"
    assert d.state.inflight is None


# -- refusals ---------------------------------------------------------------------------


def test_hello_refusals() -> None:
    d = boot(make_core(), 3, 1)
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id="eng9", kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(0), "n7:gpu0")), "unknown_device", "n7:gpu0")
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id="eng9", kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(1),)), "device_owned", device(1), engine(1))
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id=engine(0), kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(0), device(1))), "device_owned", engine(1))
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id=engine(0), kind=WorkerKind.TRAINER_RANK,
                                     devices=(device(0),)), "device_owned", trainer(0))
    d.send(ev.WorkerBye(at=1.0, worker_id=engine(3)))
    d.send(ev.WorkerBye(at=1.0, worker_id=trainer(3)))
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id=engine(0), kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(3),)), "conflict", engine(0), device(0))
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id=engine(0), kind=WorkerKind.TRAINER_RANK,
                                     devices=(device(3),)), "conflict", engine(0))
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id="x", kind=WorkerKind.ROLLOUT_ENGINE, devices=()),
                   "bad_request")
    assert_refused(d, ev.WorkerHello(at=1.0, worker_id="x", kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(3), device(3))), "bad_request")


def test_hello_that_is_allowed() -> None:
    d = boot(make_core(), 3, 1)
    # the same worker saying hello again (a reconnect) is a new incarnation
    facts, _ = d.send(ev.WorkerHello(at=2.0, worker_id=engine(1), kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(1),)))
    assert facts[0].worker.incarnation == 2
    # a device whose worker left can be taken by another one
    d.send(ev.WorkerBye(at=3.0, worker_id=engine(3)))
    facts, _ = d.send(ev.WorkerHello(at=4.0, worker_id="eng-new", kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(3),)))
    assert kinds(facts) == [f.WorkerRegistered]
    # a worker that left may come back on other devices
    d.send(ev.WorkerBye(at=5.0, worker_id=engine(2)))
    facts, _ = d.send(ev.WorkerHello(at=6.0, worker_id=engine(3), kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(device(2),)))
    assert facts[0].worker.devices == (device(2),) and facts[0].worker.incarnation == 2


def test_heartbeat_bye_step_progress_from_unknown_or_departed_workers_are_refused() -> None:
    d = boot(make_core(), 3, 1)
    assert_refused(d, ev.Heartbeat(at=1.0, worker_id="ghost"), "unknown_worker", "ghost")
    assert_refused(d, ev.WorkerBye(at=1.0, worker_id="ghost"), "unknown_worker")
    assert_refused(d, step_event("ghost", 0, 1.0, 1.0, 1.0), "unknown_worker")
    assert_refused(d, ev.ProgressReported(at=1.0, worker_id="ghost", step=0, done=0, total=1), "unknown_worker")
    d.send(ev.WorkerBye(at=1.0, worker_id=engine(3)))
    assert_refused(d, ev.Heartbeat(at=2.0, worker_id=engine(3)), "not_registered", "gone")
    assert_refused(d, ev.WorkerBye(at=2.0, worker_id=engine(3)), "not_registered")


def test_heartbeat_keeps_a_worker_alive_and_is_not_a_fact() -> None:
    d = boot(make_core(heartbeat_timeout_s=10.0), 3, 1)
    facts, commands = d.send(ev.Heartbeat(at=8.0, worker_id=engine(3)))
    assert facts == [] and commands == [] and d.state.last_seen[engine(3)] == 8.0
    facts, _ = d.send(ev.Tick(at=15.0))
    lost = sorted(x.worker_id for x in facts)
    assert kinds(facts) == [f.WorkerLost] * 7 and engine(3) not in lost
    assert d.state.is_live(engine(3))
    assert d.replayed().durable() == d.state.durable()


def test_any_accepted_report_keeps_a_worker_alive_as_a_heartbeat_does() -> None:
    """A worker that reports needs no heartbeat beside (docs/protocol.md, "Stay registered"):
    progress, an idle report, a mini-batch and a state report each count; a refused report
    does not, and no report is a fact of liveness (when a worker was heard from is soft)."""
    d = boot(make_core(heartbeat_timeout_s=10.0), 2, 2)
    d.send(ev.ProgressReported(at=8.0, worker_id=engine(2), step=0, done=1, total=4))
    d.send(ev.EngineQueueEmpty(at=8.0, worker_id=engine(3), step=0, running=0))
    d.send(ev.MiniBatchDone(at=8.0, worker_id=trainer(0), step=0, done=1, total=4))
    d.send(ev.StateReported(at=8.0, worker_id=trainer(1), actual=d.state.workers[trainer(1)].actual))
    with pytest.raises(Refused):
        d.send(ev.ProgressReported(at=8.0, worker_id=engine(0), step=0, done=5, total=4))  # impossible
    assert {w: d.state.last_seen[w] for w in (engine(2), engine(3), trainer(0), trainer(1))} == dict.fromkeys(
        (engine(2), engine(3), trainer(0), trainer(1)), 8.0)
    facts, _ = d.send(ev.Tick(at=15.0))
    lost = sorted(x.worker_id for x in facts if isinstance(x, f.WorkerLost))
    assert lost == sorted([engine(0), engine(1), trainer(2), trainer(3)])
    assert d.replayed().durable() == d.state.durable()


def test_stale_step_is_refused() -> None:
    d = boot(make_core(), 3, 1)
    d.send(step_event(trainer(0), 5, 10.0, 10.0, 1.0))
    assert_refused(d, step_event(trainer(0), 5, 10.0, 10.0, 2.0), "stale_step", "step 5")
    assert_refused(d, step_event(trainer(0), 3, 10.0, 10.0, 2.0), "stale_step")
    d.send(step_event(trainer(0), 6, 10.0, 10.0, 2.0))
    assert d.state.last_step == 6


def test_steps_are_reported_by_one_worker_while_it_is_live() -> None:
    """The first worker to report a step is the job's reporter: a report from any other live
    worker is refused (an engine's report would count the step twice or out of order), and
    changes nothing, until the reporter is gone; then the next one to report takes over."""
    d = boot(make_core(), 3, 1)
    d.send(step_event(trainer(0), 5, 10.0, 10.0, 1.0))
    assert_refused(d, step_event(engine(0), 6, 10.0, 10.0, 2.0), "not_the_reporter", repr(trainer(0)))
    assert_refused(d, step_event(trainer(1), 6, 10.0, 10.0, 2.0), "not_the_reporter")
    d.send(ev.WorkerBye(at=3.0, worker_id=trainer(0)))
    d.send(step_event(trainer(1), 6, 10.0, 10.0, 4.0))
    assert d.state.step_reporter == trainer(1) and d.state.last_step == 6


@pytest.mark.parametrize("field", ["rollout_s", "train_s", "weight_sync_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0])
def test_bad_step_values_are_refused(field: str, value: float) -> None:
    d = boot(make_core(), 3, 1)
    timing = {"rollout_s": 10.0, "train_s": 10.0, "weight_sync_s": 0.0, field: value}
    event = ev.StepReported(at=1.0, worker_id=trainer(0), timing=StepTiming(step=0, **timing))
    assert_refused(d, event, "bad_value", field)


@pytest.mark.parametrize("field", ["loan_home_share", "next_done_share"])
@pytest.mark.parametrize("value", [math.nan, -0.1, 1.5])
def test_shares_of_the_next_step_outside_0_to_1_are_refused(field: str, value: float) -> None:
    d = boot(make_core(), 3, 1)
    timing = StepTiming(step=0, rollout_s=10.0, train_s=10.0, **{field: value})
    assert_refused(d, ev.StepReported(at=1.0, worker_id=trainer(0), timing=timing), "bad_value", field)


@pytest.mark.parametrize("step,done,total,tokens", [(0, 3, 2, 0), (0, -1, 2, 0), (0, 1, 2, -5), (-1, 0, 1, 0)])
def test_impossible_progress_is_refused(step: int, done: int, total: int, tokens: int) -> None:
    d = boot(make_core(), 3, 1)
    assert_refused(d, ev.ProgressReported(at=1.0, worker_id=engine(3), step=step, done=done, total=total,
                                          tokens=tokens), "bad_value")


def test_progress_is_soft_state() -> None:
    d = boot(make_core(), 3, 1)
    facts, _ = d.send(ev.ProgressReported(at=1.0, worker_id=engine(3), step=0, done=5, total=8, tokens=900))
    assert facts == [], "a thousand engines report every second: not a fact each"
    assert d.state.progress_of(engine(3)).done == 5 and d.state.samples(0) == (5, 8)
    assert d.replayed().durable() == d.state.durable()
    # a log written before progress became soft state replays as it did
    old = fold([f.ProgressObserved(at=1.0, worker_id=engine(3), step=0, done=5, total=8, tokens=900)], d.replayed())
    assert old.progress_of(engine(3)) == d.state.progress_of(engine(3)) and old.samples(0) == (5, 8)


def test_send_op_is_a_command_not_a_fact() -> None:
    d = boot(make_core(), 3, 1)
    facts, commands = d.force(2, 2)
    assert all(isinstance(c, SendOp) for c in commands)
    assert not any(isinstance(x, SendOp) for x in facts)


def test_a_tick_that_loses_everyone_ends_the_resize_and_sends_nothing() -> None:
    d = start(TO_TRAINING, heartbeat_timeout_s=10.0)
    facts, commands = d.send(ev.Tick(at=100.0))
    # eng1 (a committer) is lost first and aborts the drain, which sends resume to eng3; the same
    # tick then declares eng3 lost, so that command must not leave
    assert f.ResizeRolledBack in kinds(facts)
    assert kinds(facts).count(f.WorkerLost) == 8
    assert commands == []
    assert d.state.inflight is None and d.state.split == Split(1, 3)


def test_commands_go_only_to_workers_live_at_the_end_of_the_step() -> None:
    d = start(TO_ROLLOUT, heartbeat_timeout_s=10.0)
    advance_to(d, 2)  # join in flight on eng2; tr2 drained and released
    t = d.now + 10.5  # tr2's answers count as heartbeats: silent since the last of them
    for w in sorted(d.state.workers):
        if w not in (engine(2), trainer(2)):
            d.send(ev.Heartbeat(at=t - 1, worker_id=w))
    facts, commands = d.send(ev.Tick(at=t))
    # eng2 lost -> abort, evict has nobody, reclaim goes to tr2 -- who is lost in the same tick
    assert kinds(facts)[:3] == [f.WorkerLost, f.OpFailed, f.ResizeAborted]
    assert [x.worker_id for x in facts if isinstance(x, f.WorkerLost)] == [engine(2), trainer(2)]
    assert kinds(facts)[-1] is f.ResizeRolledBack
    assert commands == []
    assert d.replayed().durable() == d.state.durable()


def _hello(d: Driver, i: int, kind: WorkerKind, process: str, here: bool = False) -> tuple[list[f.Fact], list]:
    name = engine(i) if kind is WorkerKind.ROLLOUT_ENGINE else trainer(i)
    return d.send(ev.WorkerHello(at=d.at(), worker_id=name, kind=kind, devices=(device(i),), process=process,
                                 registered_here=here))


def test_a_worker_restarting_mid_resize_counts_as_lost_and_rolls_the_resize_back() -> None:
    d = boot(make_core(), 2, 2)
    for i in range(4):
        for kind in WorkerKind:
            _hello(d, i, kind, f"{kind.value}{i}-first")
    d.force(3, 1)  # node 3's engine drains and releases, its trainer joins
    d.ack_current()  # drain done
    assert d.state.phase is Phase.RELEASING
    # engine 3's process dies and a new one registers before any heartbeat deadline
    facts, commands = _hello(d, 3, WorkerKind.ROLLOUT_ENGINE, "rollout-engine3-second")
    assert kinds(facts)[0] is f.WorkerLost and "restarted" in facts[0].reason
    assert f.ResizeAborted in kinds(facts) and kinds(facts)[-2:] == [f.ResizeRolledBack, f.WorkerRegistered]
    assert commands == []  # nothing to undo on the dead process
    assert d.state.split == Split(2, 2) and d.state.devices[device(3)].pool is Pool.ROLLOUT
    assert d.state.workers[engine(3)].incarnation == 3
    assert d.replayed().durable() == d.state.durable()


def test_the_same_process_saying_hello_again_is_a_reconnect_not_a_loss() -> None:
    d = boot(make_core(), 2, 2)
    for i in range(4):
        for kind in WorkerKind:
            _hello(d, i, kind, f"{kind.value}{i}")
    d.force(3, 1)
    d.ack_current()
    facts, commands = _hello(d, 3, WorkerKind.ROLLOUT_ENGINE, "rollout-engine3", here=True)
    assert facts == [] and d.state.workers[engine(3)].incarnation == 2  # its registration stands
    assert [c.op.kind for c in commands] == [OpKind.RELEASE]  # its pending op, re-sent
    assert d.state.inflight is not None


def test_a_worker_with_only_the_commit_left_leaving_does_not_abort_the_resize() -> None:
    d = boot(make_core(), 2, 2)
    d.force(3, 1)  # node 3 moves to training; trainers 0 and 1 only have to commit
    d.ack_current()  # drain
    d.ack_current()  # release
    assert d.state.phase is Phase.JOINING
    facts, _ = d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(0)))
    assert kinds(facts) == [f.WorkerLeft] and d.state.phase is Phase.JOINING
    d.finish()
    assert d.state.split == Split(3, 1) and d.state.resizes_committed == 1
    assert d.state.resizes_rolled_back == 0
    assert d.replayed().durable() == d.state.durable()


def test_a_moving_devices_worker_leaving_still_aborts_the_resize() -> None:
    d = boot(make_core(), 2, 2)
    d.force(3, 1)
    d.ack_current()  # drain done; trainer 3 has the join ahead of it
    facts, _ = d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(3)))
    assert f.ResizeAborted in kinds(facts)
