"""Regroups: rollout devices that change the size of the engines they form (two TP-1 engines
become one TP-2 engine and back), as an op sequence serialized, recorded, undone and
reconciled like a resize's (issue 22, item 3)."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import SendOp
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.machine import plan_loan
from dynaresized.core.state import Phase
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, Split, StepTiming, WorkerKind

from .cluster import EAGER, Driver, boot, device, engine, make_core, trainer

PAIR = (device(2), device(3))
FORWARD = [OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT]


def regroup(d: Driver, devices: tuple[str, ...], tp: int) -> tuple[list[f.Fact], list]:
    return d.send(ev.RegroupRequested(at=d.at(), devices=devices, tp=tp, reason="test"))


def run_ops(d: Driver) -> list[SendOp]:
    """Acknowledge every op of the sequence in flight; every op sent on the way."""
    sent: list[SendOp] = []
    for _ in range(12):
        if d.state.inflight is None:
            return sent
        sent += [c for c in d.ack_current() if isinstance(c, SendOp)]
    raise AssertionError("the regroup did not finish")


def rejected(facts: list[f.Fact]) -> f.ProposalRejected:
    (r,) = [x for x in facts if isinstance(x, f.ProposalRejected)]
    return r


def test_two_engines_become_one_and_back() -> None:
    d = boot(make_core(), 2, 2)
    facts, cmds = regroup(d, PAIR, 2)
    (started,) = [x for x in facts if isinstance(x, f.RegroupStarted)]
    plan = started.plan
    assert plan.kind is PlanKind.REGROUP and plan.engines == (PAIR,) and plan.before == plan.after == Split(2, 2)
    assert [op.kind for op in plan.ops] == FORWARD
    assert all(op.targets == (engine(2), engine(3)) for op in plan.ops)
    assert {c.worker_id for c in cmds} == {engine(2), engine(3)} and cmds[0].op.kind is OpKind.DRAIN
    # Every op of a regroup names the engine it builds (its JOIN starts it on the leader).
    assert all(c.engine == PAIR and c.plan is PlanKind.REGROUP for c in cmds)
    assert d.state.phase is Phase.DRAINING and d.state.split == Split(2, 2)
    sent = cmds + run_ops(d)
    assert [k for k in dict.fromkeys(c.op.kind for c in sent)] == FORWARD
    assert all(c.engine == PAIR for c in sent)
    assert isinstance(d.log[-1], f.RegroupCommitted)
    s = d.state
    assert s.phase is Phase.STEADY and s.engines == {device(2): PAIR, device(3): PAIR}
    assert s.regroups_committed == 1 and s.split == Split(2, 2)
    assert s.desired(s.workers[engine(2)]) is Holding.SERVING  # leads the TP-2 engine
    assert s.desired(s.workers[engine(3)]) is Holding.RELEASED  # its device serves in engine 2's
    assert d.replayed().durable() == s.durable()

    facts, cmds = regroup(d, PAIR, 1)
    back = [x for x in facts if isinstance(x, f.RegroupStarted)][0].plan
    assert back.engines == ((device(2),), (device(3),)) and back.resize_id == "g2"
    # Going forward each engine is told its new engine: its own device (empty means that).
    sent = run_ops(d)
    assert all(c.engine == () for c in sent)
    assert d.state.engines == {} and d.state.desired(d.state.workers[engine(3)]) is Holding.SERVING
    assert d.replayed().durable() == d.state.durable()


def test_a_regroup_that_is_impossible_says_why_and_changes_nothing() -> None:
    d = boot(make_core(), 2, 4)
    cases = [
        ((device(0), device(1)), 2, "in training"),
        ((device(2), device(3), device(4)), 2, "do not form engines of 2"),
        ((device(2), device(3)), 1, "already serve"),
        ((device(2), "n9:gpu9"), 2, "not in this cluster"),
    ]
    for devices, tp, words in cases:
        version = d.state.version
        facts, cmds = regroup(d, devices, tp)
        assert words in rejected(facts).reason and rejected(facts).guard == "regroup", (devices, words)
        assert not cmds and d.state.version == version + 1 and d.state.inflight is None
    regroup(d, PAIR, 2)
    run_ops(d)
    facts, _ = regroup(d, (device(3), device(4)), 2)  # half of the TP-2 engine
    assert "name all of its devices" in rejected(facts).reason
    facts, _ = regroup(d, (device(4), device(5)), 2)
    facts, _ = regroup(d, (device(0), device(1)), 2)  # one sequence at a time
    assert rejected(facts).guard == "in_flight"


def test_a_refused_regroup_is_named_a_regroup_not_a_resize() -> None:
    """issue 45: the operator's refused regroup read "no resize (from operator), guard regroup"."""
    from dynaresized.explain import explain

    d = boot(make_core(), 2, 4)
    facts, _ = regroup(d, (device(0), device(1)), 2)
    refusal = rejected(facts)
    assert refusal.proposal is PlanKind.REGROUP
    assert explain(refusal).startswith("no regroup (from operator), guard regroup: ")
    facts, _ = d.send(ev.ResizeRequested(at=d.at(), target=Split(train=2, rollout=4)))
    assert explain(rejected(facts)).startswith("no resize to 2:4 (from operator), guard candidates: ")
    # a log written before refusals named what they refused: a loan guard still reads as a loan
    old = f.ProposalRejected(at=0.0, source="hysteresis", target=None, guard="loan_payback", reason="r")
    assert explain(old) == "no loan (from hysteresis), guard loan_payback: r"


def test_a_worker_of_several_devices_is_not_regrouped() -> None:
    d = Driver(make_core())
    d.send(ev.Configure(at=0, devices=PAIR, pools=(Pool.ROLLOUT, Pool.ROLLOUT)))
    d.send(ev.WorkerHello(at=0, worker_id="hybrid", kind=WorkerKind.ROLLOUT_ENGINE, devices=PAIR))
    facts, _ = regroup(d, PAIR, 2)
    assert "shapes its own engines" in rejected(facts).reason
    assert d.state.inflight is None


def test_a_failed_regroup_rolls_back_to_the_old_engines() -> None:
    d = boot(make_core(), 2, 2)
    regroup(d, PAIR, 2)
    d.ack_current()  # drain
    d.ack_current()  # release
    assert d.state.inflight.op.kind is OpKind.JOIN
    d.ack(engine(2))
    facts, cmds = d.ack(engine(3), ok=False, detail="no room for a TP-2 engine")
    (aborted,) = [x for x in facts if isinstance(x, f.ResizeAborted)]
    assert [op.kind for op in aborted.undo] == [OpKind.EVICT, OpKind.RECLAIM, OpKind.RESUME]
    # Undoing, each engine is told the engines the log still holds: its own.
    assert cmds and all(c.engine == () and c.op.kind is OpKind.EVICT for c in cmds)
    run_ops(d)
    assert isinstance(d.log[-1], f.ResizeRolledBack)
    s = d.state
    assert s.engines == {} and s.regroups_committed == 0 and s.resizes_rolled_back == 0
    assert s.phase is Phase.STEADY and s.split == Split(2, 2)
    assert d.replayed().durable() == s.durable()


def test_a_lost_engine_worker_rolls_a_regroup_back_and_a_restart_replays_it() -> None:
    d = boot(make_core(heartbeat_timeout_s=5.0), 2, 2)
    regroup(d, PAIR, 2)
    d.ack_current()
    # A daemon restart mid-regroup: the log replays to the same sequence, which goes on.
    replayed = d.replayed()
    assert replayed.durable() == d.state.durable() and replayed.inflight.plan.kind is PlanKind.REGROUP
    d.send(ev.DaemonStarted(at=d.at()))
    t = d.at(6.0)
    for w in sorted(d.state.workers):
        if w != engine(3):
            d.send(ev.Heartbeat(at=t - 1, worker_id=w))
    facts, _ = d.send(ev.Tick(at=t))
    assert any(isinstance(x, f.WorkerLost) and x.worker_id == engine(3) for x in facts)
    assert any(isinstance(x, f.ResizeAborted) for x in facts)
    run_ops(d)
    assert d.state.engines == {} and d.state.inflight is None


def test_a_commit_that_fails_rolls_forward_to_the_new_engines() -> None:
    d = boot(make_core(), 2, 2)
    regroup(d, PAIR, 2)
    for _ in range(4):
        d.ack_current()
    assert d.state.inflight.op.kind is OpKind.COMMIT
    facts, _ = d.ack(engine(2), ok=False, detail="router refused")
    assert any(isinstance(x, f.Degraded) for x in facts)
    assert d.state.engines == {device(2): PAIR, device(3): PAIR}
    assert d.replayed().durable() == d.state.durable()


def test_a_wide_engine_moves_whole() -> None:
    d = boot(make_core(), 2, 2)
    regroup(d, PAIR, 2)
    run_ops(d)
    facts, cmds = d.force(3, 1)  # half of the TP-2 engine: impossible
    r = rejected(facts)
    assert r.guard == "capacity" and "move whole" in r.reason and not cmds
    regroup(d, PAIR, 1)
    run_ops(d)
    facts, _ = d.force(3, 1)
    assert any(isinstance(x, f.ResizeStarted) for x in facts)


def test_a_wide_engine_is_lent_whole_once_the_worker_that_runs_it_has_run_dry() -> None:
    d = boot(make_core(replace(EAGER), "hysteresis", op_timeout_s=30.0), 2, 2)
    d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(2), step=1, running=0))
    assert d.state.dry == (device(2),)
    regroup(d, PAIR, 2)
    assert d.state.dry == (), "a regroup stops the engines: what they ran dry in is over"
    run_ops(d)
    for done in (1, 2):  # the trainer's pace: 60 s a mini-batch
        d.send(ev.MiniBatchDone(at=d.at(60.0), worker_id=trainer(0), step=0, done=done, total=8))
    # the follower holds nothing: its word alone lends nothing
    facts, _ = d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(3), step=1, running=0))
    assert d.state.lendable()[0] == () and not any(isinstance(x, f.LoanStarted) for x in facts)
    facts, cmds = d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(2), step=1, running=0))
    (started,) = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert started.plan.devices == PAIR
    assert {c.worker_id for c in cmds} == {engine(2), engine(3)} and all(c.engine == PAIR for c in cmds)
    d.finish()
    assert d.state.lent_devices() == PAIR and d.state.engines == {device(2): PAIR, device(3): PAIR}
    facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
        step=0, rollout_s=10.0, train_s=10.0, rollout_devices=2, train_devices=2)))
    assert any(isinstance(x, f.LoanReturnStarted) for x in facts)
    d.finish()
    assert d.state.lent_devices() == () and d.state.engines == {device(2): PAIR, device(3): PAIR}
    assert d.replayed().durable() == d.state.durable()
    # a loan of part of a wide engine is refused with its reason
    assert "a loan takes whole engines" in plan_loan(d.state, (device(2),), Pool.TRAINING, PlanKind.LOAN)


def test_an_engine_that_ran_dry_before_a_regroup_but_said_so_during_it_is_not_lent() -> None:
    """What CI met: the engines' reports that they ran dry in step 1 left after the regroup
    began (the test's blocking control call held them back), so the new TP-2 engine looked dry
    and was lent before it served a step; the step it should have served stalled until the
    boundary that the step itself had to reach. Reports from an engine whose devices a plan
    in flight moves are dropped: the engine drains first, whatever it ran dry in is over."""
    d = boot(make_core(replace(EAGER), "hysteresis", op_timeout_s=30.0), 2, 2)
    regroup(d, PAIR, 2)
    for w in (engine(2), engine(3)):  # late: sent at step 1's end, received after the regroup began
        facts, _ = d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=w, step=1, running=0))
        assert facts == []
    run_ops(d)
    assert d.state.dry == () and d.state.lendable()[0] == ()
    for done in (1, 2, 3):  # the trainer's pace is known from the second mini-batch on
        facts, _ = d.send(ev.MiniBatchDone(at=d.at(60.0), worker_id=trainer(0), step=1, done=done, total=8))
        assert not any(isinstance(x, f.LoanStarted) for x in facts), "lent before it served a step"
    facts, _ = d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(2), step=2, running=0))
    (started,) = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert started.plan.devices == PAIR
    assert d.replayed().durable() == d.state.durable()


def test_an_engine_that_runs_another_engine_than_the_log_is_converged() -> None:
    d = boot(make_core(), 2, 2)
    regroup(d, PAIR, 2)
    run_ops(d)
    # The leader restarted alone: it serves a TP-1 engine again.
    alone = ActualState(holding=Holding.SERVING, engine=())
    facts, cmds = d.send(ev.StateReported(at=d.at(), worker_id=engine(2), actual=alone))
    (rec,) = [x for x in facts if isinstance(x, f.ReconcileStarted)]
    assert rec.worker_id == engine(2)
    assert [op.kind for op in rec.plan.ops] == [OpKind.DRAIN, OpKind.RELEASE, OpKind.RECLAIM, OpKind.RESUME]
    assert cmds[0].engine == PAIR and cmds[0].plan is PlanKind.RECONCILE
    # It converges once it says it runs the wide engine.
    wide = ActualState(holding=Holding.SERVING, engine=PAIR)
    for _ in range(4):
        fl = d.state.inflight
        d.send(ev.OpReported(at=d.at(), worker_id=engine(2), op_id=fl.op.op_id, ok=True, actual=wide))
    assert isinstance(d.log[-1], f.ReconcileFinished) and d.log[-1].ok
    # A follower that serves (restarted alone) is released.
    facts, _ = d.send(ev.StateReported(at=d.at(), worker_id=engine(3), actual=ActualState(holding=Holding.SERVING)))
    (rec,) = [x for x in facts if isinstance(x, f.ReconcileStarted)]
    assert rec.desired is Holding.RELEASED and [op.kind for op in rec.plan.ops] == [OpKind.DRAIN, OpKind.RELEASE]


def test_an_engine_that_cannot_take_the_layout_is_left_out_not_reconciled_forever() -> None:
    d = boot(make_core(), 2, 2)
    regroup(d, PAIR, 2)
    run_ops(d)
    alone = ActualState(holding=Holding.SERVING)
    d.send(ev.StateReported(at=d.at(), worker_id=engine(2), actual=alone))
    for _ in range(4):
        fl = d.state.inflight
        d.send(ev.OpReported(at=d.at(), worker_id=engine(2), op_id=fl.op.op_id, ok=True, actual=alone))
    assert isinstance(d.log[-1], f.WorkerUnconverged) and "runs the engine" in d.log[-1].reason
    assert d.state.inflight is None and engine(2) in d.state.unconverged


def test_a_resize_moves_a_wide_engine_whole_and_its_devices_come_back_as_one_device_engines() -> None:
    d = boot(make_core(), 2, 4)
    regroup(d, PAIR, 2)  # gpu2+gpu3 one engine; gpu4, gpu5 one each
    run_ops(d)
    facts, _ = d.force(3, 3)  # one device: gpu5 alone, the wide engine stays
    assert [x for x in facts if isinstance(x, f.ResizeStarted)][0].plan.devices == (device(5),)
    d.finish()
    facts, cmds = d.force(5, 1)  # two more: the TP-2 engine whole (gpu4 alone would leave one)
    plan = [x for x in facts if isinstance(x, f.ResizeStarted)][0].plan
    assert plan.devices == PAIR and {c.worker_id for c in cmds} == {engine(2), engine(3)}
    assert all(c.engine == PAIR for c in cmds)  # the engine it leaves, named to both workers
    d.finish()
    s = d.state
    assert s.engines == {} and s.split == Split(5, 1) and s.pool_devices(Pool.ROLLOUT) == (device(4),)
    assert d.replayed().durable() == s.durable()
    facts, cmds = d.force(3, 3)  # back: one-device engines
    assert all(c.engine == () for c in cmds)
    d.finish()
    assert s.engines == {} and d.state.desired(d.state.workers[engine(3)]) is Holding.SERVING
