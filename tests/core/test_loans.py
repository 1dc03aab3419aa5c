"""Loans in the core: an idle engine lent to the training step in progress, as a serialized,
recorded, guarded op sequence with undo, that goes home at the step boundary."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from dynaresized.core import Core, IllegalTransition, Phase, Refused, fold
from dynaresized.core.machine import loan_view
from dynaresized.core.policy import LoanCosts, load_policy
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, Split, StepTiming, WorkerKind, placed

from .cluster import EAGER, Driver, boot, device, engine, make_core, snapshot, trainer

TRAIN, ROLLOUT = 2, 2  # n0:gpu0-1 train, n0:gpu2-3 generate
IDLE = device(3)


def lending_cluster(**guards: object) -> Driver:
    return boot(make_core(replace(EAGER, **guards), "hysteresis", op_timeout_s=30.0), TRAIN, ROLLOUT)


def pace(d: Driver, step: int = 0, seconds: float = 60.0, upto: int = 2, total: int = 8) -> None:
    """The trainer reports its first mini-batches, `seconds` apart."""
    for done in range(1, upto + 1):
        d.send(ev.MiniBatchDone(at=d.at(seconds), worker_id=trainer(0), step=step, done=done, total=total))


def idle(d: Driver, dev: int = 3, step: int = 1, running: int = 0) -> tuple[list[f.Fact], list]:
    return d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(dev), step=step, running=running))


def report_step(d: Driver, step: int, rollout_s: float = 10.0, train_s: float = 10.0) -> list[f.Fact]:
    facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
        step=step, rollout_s=rollout_s, train_s=train_s, rollout_devices=ROLLOUT, train_devices=TRAIN)))
    return facts


def test_an_idle_engine_is_lent_lands_and_goes_home_at_the_step_boundary():
    d = lending_cluster()
    pace(d)
    facts, commands = idle(d, running=2)  # queue empty, still decoding: not idle, no loan
    assert d.state.inflight is None and [type(x) for x in facts] == [f.EngineQueueEmptyObserved]
    facts, commands = idle(d)
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.kind is PlanKind.LOAN and started.plan.devices == (IDLE,)
    assert [op.kind for op in started.plan.ops] == [OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN]
    assert started.saves_s > started.cost_s and "lent n0:gpu3 to training at mini-batch 2/8" in started.reason
    assert [(c.worker_id, c.op.kind, c.plan) for c in commands] == [(engine(3), OpKind.DRAIN, PlanKind.LOAN)]
    assert d.state.phase is Phase.DRAINING and d.state.devices[IDLE].home is Pool.ROLLOUT
    d.finish()
    assert isinstance(d.log[-1], f.LoanLanded)
    assert d.state.devices[IDLE] == placed(Pool.TRAINING, home=Pool.ROLLOUT)
    assert d.state.split == Split(TRAIN, ROLLOUT) and d.state.lent_devices() == (IDLE,)
    assert d.state.history.last_resize_end_at is None  # a loan is not a resize for dwell/cooldown
    facts = report_step(d, 0)
    back = next(x for x in facts if isinstance(x, f.LoanReturnStarted))
    assert back.plan.kind is PlanKind.RETURN and back.plan.from_pool is Pool.TRAINING and back.then is None
    d.finish()
    assert isinstance(d.log[-1], f.LoanReturned) and d.state.devices[IDLE] == placed(Pool.ROLLOUT)
    assert d.replayed().durable() == d.state.durable()


def test_a_resize_asked_for_at_the_boundary_starts_once_the_loans_are_home():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.finish()
    facts = report_step(d, 0, rollout_s=100.0, train_s=10.0)  # hysteresis wants a bigger rollout pool
    back = next(x for x in facts if isinstance(x, f.LoanReturnStarted))
    assert back.then == Split(1, 3) and back.then_source == "hysteresis"
    d.finish()
    kinds = [type(x) for x in d.log]
    assert kinds.index(f.LoanReturned) < kinds.index(f.ResizeStarted) < kinds.index(f.ResizeCommitted)
    assert d.state.split == Split(1, 3) and d.state.lent_devices() == ()
    assert d.replayed().durable() == d.state.durable()


def test_a_failed_join_rolls_the_loan_back_home():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.ack_current()  # drain
    d.ack_current()  # release
    facts, commands = d.ack(trainer(3), ok=False, detail="NCCL timeout")
    assert any(isinstance(x, f.ResizeAborted) for x in facts)
    assert [c.op.kind for c in commands] == [OpKind.EVICT]
    d.finish()
    assert isinstance(d.log[-1], f.ResizeRolledBack)
    assert d.state.devices[IDLE] == placed(Pool.ROLLOUT) and d.state.phase is Phase.STEADY
    assert d.state.history.last_resize_end_at is None
    assert d.state.resizes_rolled_back == 0, "a loan rolled back is not a resize rolled back"
    assert d.replayed().durable() == d.state.durable()


def test_a_lost_trainer_mid_loan_rolls_back_across_a_daemon_restart():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.ack_current()  # drain
    d.ack_current()  # release: the join is now in flight on the lent device's trainer
    d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(3)))
    fl = d.state.inflight
    assert fl is not None and fl.rolling_back and [op.kind for op in fl.ops] == [OpKind.EVICT, OpKind.RECLAIM,
                                                                                  OpKind.RESUME]
    # the daemon restarts on its log mid-rollback: the fold resumes it, the engine answers
    restarted = Driver(d.core, fold(d.log), now=d.now)
    restarted.log = list(d.log)
    restarted.send(ev.DaemonStarted(at=restarted.at()))
    restarted.finish()
    assert isinstance(restarted.log[-1], f.ResizeRolledBack)
    assert restarted.state.devices[IDLE] == placed(Pool.ROLLOUT)
    assert restarted.replayed().durable() == restarted.state.durable()


def test_loans_are_serialized_with_resizes_and_refused_reports_change_nothing():
    d = lending_cluster()
    pace(d)
    idle(d)
    facts, _ = d.force(1, 3)
    assert any(isinstance(x, f.ProposalRejected) and x.guard == "in_flight" for x in facts)
    before = snapshot(d.state)
    with pytest.raises(Refused, match="only engines report their queue"):
        d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=trainer(1), step=1))
    with pytest.raises(Refused, match="only trainers report mini-batches"):
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=engine(1), step=0, done=1, total=2))
    with pytest.raises(Refused, match="impossible"):
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=3, total=2))
    with pytest.raises(Refused, match="impossible"):
        d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(2), step=1, running=-1))
    assert snapshot(d.state) == before


def test_a_loan_that_does_not_pay_is_refused_with_its_reason():
    d = lending_cluster(loan_safety=1000.0)
    pace(d)
    facts, _ = idle(d)
    rejected = [x for x in facts if isinstance(x, f.ProposalRejected)]
    assert len(rejected) == 1 and rejected[0].guard == "loan_payback" and rejected[0].target is None
    assert "not above cost" in rejected[0].reason and d.state.inflight is None


def test_loan_events_are_illegal_nowhere_and_recorded_while_a_resize_runs():
    d = lending_cluster()
    d.force(1, 3)
    assert d.state.phase is Phase.DRAINING
    facts, _ = idle(d, dev=2)  # recorded, but no loan while a resize is in flight
    assert [type(x) for x in facts] == [f.EngineQueueEmptyObserved]
    try:
        pace(d)
    except IllegalTransition as exc:  # pragma: no cover - the table must accept it
        raise AssertionError(exc) from exc


def test_an_engine_idle_in_the_step_that_ended_is_not_lent_in_the_next():
    d = lending_cluster()
    idle(d)  # idle in rollout step 1, before the trainer's pace is known: nothing to lend to
    assert d.state.dry == (IDLE,) and d.state.inflight is None
    report_step(d, 0)
    assert d.state.dry == ()
    pace(d, step=1)
    assert d.state.inflight is None, "the engine is busy with the new step's requests"


def test_a_queue_empty_that_arrives_after_its_step_was_reported_is_ignored():
    d = lending_cluster()
    report_step(d, 1)
    pace(d, step=2)
    facts, commands = idle(d, step=1)  # rollout step 1 ended before the report of step 1
    assert facts == [] and commands == [] and d.state.dry == ()
    assert d.state.inflight is None, "the engine serves step 2: not lendable"
    facts, _ = idle(d, step=2)
    assert any(isinstance(x, f.LoanStarted) for x in facts)  # the step in progress still lends


def test_a_lent_rank_that_left_at_its_steps_end_is_not_reconciled_before_the_return():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.finish()
    assert d.state.lent_devices() == (IDLE,)
    d.send(ev.StateReported(at=d.at(), worker_id=trainer(3), actual=ActualState(holding=Holding.SERVING)))
    # the step's last mini-batch: the lent rank leaves the group by itself
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=8, total=8))
    facts, commands = d.send(ev.StateReported(at=d.at(), worker_id=trainer(3),
                                              actual=ActualState(holding=Holding.RELEASED)))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts) and d.state.inflight is None
    now = d.at()
    d.heartbeat_all(now)
    facts, _ = d.send(ev.Tick(at=now))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts)
    facts = report_step(d, 0)
    assert any(isinstance(x, f.LoanReturnStarted) for x in facts)
    d.finish()
    assert d.state.devices[IDLE] == placed(Pool.ROLLOUT) and d.state.unconverged == {}


def test_a_lent_rank_that_leaves_before_its_steps_end_is_reconciled():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.finish()
    facts, _ = d.send(ev.StateReported(at=d.at(), worker_id=trainer(3), actual=ActualState(holding=Holding.RELEASED)))
    started = [x for x in facts if isinstance(x, f.ReconcileStarted)]
    assert started and started[0].worker_id == trainer(3) and started[0].desired is Holding.SERVING


TRAINERS = (device(0), device(1))


def nothing_to_train(d: Driver, step: int = 0) -> tuple[list[f.Fact], list]:
    return d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=0, total=0))


def test_trainers_with_nothing_to_train_are_lent_to_the_rollout_and_go_home_when_their_step_begins():
    d = lending_cluster()
    facts, commands = nothing_to_train(d)  # the first window: the trainer waits for rollout 0
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.kind is PlanKind.LOAN and started.plan.to_pool is Pool.ROLLOUT
    assert started.plan.devices == TRAINERS and "nothing to train yet" in started.reason
    assert [(c.worker_id, c.op.kind) for c in commands] == [(trainer(0), OpKind.DRAIN), (trainer(1), OpKind.DRAIN)]
    d.finish()
    assert isinstance(d.log[-1], f.LoanLanded)
    assert all(d.state.devices[x] == placed(Pool.ROLLOUT, home=Pool.TRAINING) for x in TRAINERS)
    assert d.state.split == Split(TRAIN, ROLLOUT)
    # rollout 0 is done: training step 0 begins, and its trainers come home first
    facts, commands = d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=8))
    back = next(x for x in facts if isinstance(x, f.LoanReturnStarted))
    assert back.plan.to_pool is Pool.TRAINING and back.plan.devices == TRAINERS
    assert back.reason == "training step 0 begins: 2 lent device(s) go home to training"
    d.finish()
    assert isinstance(d.log[-1], f.LoanReturned) and d.state.lent_devices() == ()
    assert all(d.state.devices[x] == placed(Pool.TRAINING) for x in TRAINERS)
    assert d.replayed().durable() == d.state.durable()


def test_trainers_are_free_after_their_last_mini_batch_only_until_the_step_boundary():
    d = lending_cluster(loan_safety=1e9)  # watch the view; lend nothing
    pace(d, upto=8)
    view = loan_view(d.core, d.state, d.at())
    assert view.free_trainers == TRAINERS and not view.queue_empty
    report_step(d, 0)
    # the next training step has begun and reported nothing yet: nobody is free (the record
    # of step 0's last mini-batch used to say all trainers were)
    assert d.state.mini_batch is None and loan_view(d.core, d.state, d.at()).free_trainers == ()


def test_the_queue_is_empty_only_for_the_rollout_step_in_progress():
    d = lending_cluster(loan_safety=1e9)
    nothing_to_train(d)  # rollout 0 runs
    assert not loan_view(d.core, d.state, d.at()).queue_empty
    idle(d, step=0)
    assert loan_view(d.core, d.state, d.at()).queue_empty
    pace(d, step=0, upto=1)  # window 1: training 0, rollout 1
    assert not loan_view(d.core, d.state, d.at()).queue_empty, "rollout 0's empty queue says nothing of rollout 1"
    idle(d, step=1)
    report_step(d, 0)
    pace(d, step=1, upto=1)  # window 2: rollout 2
    assert not loan_view(d.core, d.state, d.at()).queue_empty


def test_no_trainer_is_lent_to_a_rollout_whose_queue_is_empty():
    d = lending_cluster()
    nothing_to_train(d, step=0)
    d.finish()
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=8))
    d.finish()
    idle(d, step=1)  # rollout 1's queue is empty
    facts, _ = d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=8, total=8))
    assert not any(isinstance(x, f.LoanStarted) for x in facts) and d.state.inflight is None


def test_a_step_reported_while_a_loan_runs_sends_it_home_and_asks_the_policy_once_it_lands():
    d = lending_cluster()
    pace(d, upto=8)  # training step 0 done: its trainers are lent to rollout 1, still queued
    assert d.state.inflight is not None and d.state.inflight.plan.to_pool is Pool.ROLLOUT
    facts = report_step(d, 0, rollout_s=40.0, train_s=10.0)  # the boundary comes mid-loan
    assert not any(isinstance(x, f.LoanReturnStarted) for x in facts)
    d.finish()
    landed = next(i for i, x in enumerate(d.log) if isinstance(x, f.LoanLanded))
    assert any(isinstance(x, f.LoanReturnStarted) for x in d.log[landed:])
    assert d.state.lent_devices() == () and d.state.inflight is None
    assert d.replayed().durable() == d.state.durable()


def test_a_loan_whose_return_failed_goes_home_when_the_operator_resumes():
    d = lending_cluster()
    pace(d)
    idle(d)
    d.finish()  # lent n0:gpu3 to training
    report_step(d, 0)  # the step is over: its return starts
    d.ack_current()  # drain
    d.ack_current()  # release: the lent rank left the group
    d.ack(engine(3), ok=False, detail="engine did not start")  # join fails: back to training
    d.ack_current()  # evict
    facts, _ = d.ack(trainer(3), ok=False, detail="NCCL timeout")  # reclaim fails: degraded
    assert d.state.phase is Phase.DEGRADED and any(isinstance(x, f.Degraded) for x in facts)
    assert d.state.lent_devices() == (IDLE,), "placed in training, still lent"
    d.send(ev.StateReported(at=d.at(), worker_id=trainer(3), actual=ActualState(holding=Holding.DRAINED)))
    facts, commands = d.send(ev.ResumeRequested(at=d.at()))
    back = next(x for x in facts if isinstance(x, f.LoanReturnStarted))
    assert back.plan.devices == (IDLE,) and "resumed after a failed loan" in back.reason
    assert [(c.worker_id, c.op.kind) for c in commands] == [(trainer(3), OpKind.DRAIN)]
    d.finish()
    assert isinstance(d.log[-1], f.LoanReturned) and d.state.devices[IDLE] == placed(Pool.ROLLOUT)
    assert d.state.phase is Phase.STEADY and d.state.lent_devices() == ()
    assert d.replayed().durable() == d.state.durable()


def test_two_loans_in_one_step_go_home_together_named_after_the_latest():
    d = lending_cluster()
    pace(d)
    idle(d, dev=3)
    d.finish()
    facts, _ = idle(d, dev=2)  # the second engine runs dry later in the same step: lent too
    second = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert second.plan.resize_id == "l2" and second.plan.devices == (device(2),)
    d.finish()
    assert d.state.lent_devices() == (device(2), IDLE)
    back = next(x for x in report_step(d, 0) if isinstance(x, f.LoanReturnStarted))
    assert back.plan.resize_id.startswith("l2-home") and back.plan.devices == (device(2), IDLE)
    d.finish()
    assert isinstance(d.log[-1], f.LoanReturned) and d.state.lent_devices() == ()
    assert d.state.split == Split(TRAIN, ROLLOUT)
    assert d.replayed().durable() == d.state.durable()


def test_an_engine_that_has_not_converged_is_not_lent():
    d = lending_cluster()
    facts, _ = d.send(ev.WorkerHello(at=d.at(), worker_id=engine(3), kind=WorkerKind.ROLLOUT_ENGINE,
                                     devices=(IDLE,), process="p-eng3-again",
                                     actual=ActualState(holding=Holding.FAILED, detail="reclaim raised")))
    assert isinstance(facts[-1], f.WorkerUnconverged) and engine(3) in d.state.unconverged
    pace(d)
    facts, _ = idle(d, dev=3)  # idle, but what it holds is not what the log says: left out
    assert not any(isinstance(x, f.LoanStarted) for x in facts) and d.state.inflight is None
    assert IDLE not in loan_view(d.core, d.state, d.at()).idle_engines
    facts, _ = idle(d, dev=2)  # the engine that agrees with the log is lent
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.devices == (device(2),)
    d.finish()
    assert d.state.lent_devices() == (device(2),)
    assert d.replayed().durable() == d.state.durable()



def test_a_forced_resize_while_trainers_are_lent_plans_no_lent_device():
    """The property test's find: trainers lent to the rollout and landed, then an operator asks
    for 3:1. The plan moved n0:gpu1 'from the rollout', where it was only lent (its home is
    training). Lent devices are left out of a resize's plan, as held-back ones are."""
    d = lending_cluster()
    nothing_to_train(d)
    d.finish()
    assert set(d.state.lent_devices()) == set(TRAINERS)
    for i in (2, 3):  # the rollout's own devices lose the trainers that could take them over
        d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(i)))
    facts, _ = d.send(ev.ResizeRequested(at=d.at(), target=Split(train=3, rollout=1)))
    assert not any(isinstance(x, f.ResizeStarted) for x in facts)
    rejected = next(x for x in facts if isinstance(x, f.ProposalRejected))
    assert rejected.guard == "capacity" and "(2 lent until the step boundary)" in rejected.reason
    assert d.state.inflight is None and set(d.state.lent_devices()) == set(TRAINERS)
    assert all(d.state.devices[x] == placed(Pool.ROLLOUT, home=Pool.TRAINING) for x in TRAINERS)
    d.send(ev.WorkerHello(at=d.at(), worker_id=trainer(3), kind=WorkerKind.TRAINER_RANK, devices=(device(3),)))
    facts, _ = d.send(ev.ResizeRequested(at=d.at(), target=Split(train=3, rollout=1)))
    started = next(x for x in facts if isinstance(x, f.ResizeStarted))
    assert started.plan.devices == (device(3),) and started.plan.from_pool is Pool.ROLLOUT
    d.finish()
    assert d.state.split == Split(train=3, rollout=1)
    assert d.replayed().durable() == d.state.durable()


def test_trainers_are_lent_to_one_engine_that_serves_all_of_them():
    """verl's rollout worker is one engine on every hybrid slot: a loan of two trainers to it is
    one join, not a capacity refusal for want of an engine per device."""
    core = make_core(replace(EAGER), "hysteresis", op_timeout_s=30.0)
    d = Driver(core)
    devices = (device(0), device(1), device(2))
    d.send(ev.Configure(at=0.0, devices=devices, pools=(Pool.TRAINING, Pool.TRAINING, Pool.ROLLOUT),
                        candidates=(Split(2, 1),)))  # the split never changes, as in verl
    d.send(ev.WorkerHello(at=0.0, worker_id="trainer", kind=WorkerKind.TRAINER_RANK, devices=devices[:2]))
    d.send(ev.WorkerHello(at=0.0, worker_id="rollout", kind=WorkerKind.ROLLOUT_ENGINE, devices=devices))
    d.send(ev.StepReported(at=d.at(), worker_id="trainer", timing=StepTiming(
        step=1, rollout_s=100.0, train_s=10.0, rollout_devices=1, train_devices=2)))
    facts, commands = d.send(ev.MiniBatchDone(at=d.at(), worker_id="trainer", step=1, done=1, total=1))
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.devices == devices[:2] and started.plan.to_pool is Pool.ROLLOUT
    d.finish()
    assert isinstance(d.log[-1], f.LoanLanded) and d.state.lent_devices() == devices[:2]


def lend_and_return_trainers(d: Driver, step: int) -> tuple[f.LoanLanded, f.LoanReturned]:
    """One loan of the trainers to the rollout (nothing to train yet) and its way home."""
    nothing_to_train(d, step)
    d.finish()
    landed = d.log[-1]
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=0, total=8))
    d.finish()
    returned = d.log[-1]
    assert isinstance(landed, f.LoanLanded) and isinstance(returned, f.LoanReturned)
    return landed, returned


def test_measured_loans_replace_the_configured_loan_costs_of_their_direction():
    """As the measured resize costs replace [costs], the last 3 measured loans of a direction
    replace [loan_costs]' way home (and, to the rollout, to_rollout_s by their landings); the
    lead, to_training_s and the other direction stay configured; the state replays."""
    core = make_core(EAGER, "hysteresis", op_timeout_s=30.0)
    configured = LoanCosts(to_training_s=8.0, to_rollout_s=30.0, return_s=20.0, lead_s=25.0)
    d = boot(Core(replace(core.config, loan_costs=configured, learn_loan_costs=True), core.policy), TRAIN, ROLLOUT)
    before = loan_view(d.core, d.state, d.at())
    assert before.costs_to(Pool.ROLLOUT) == configured and before.costs == configured
    measured = [lend_and_return_trainers(d, step) for step in range(4)]
    assert len(d.state.loan_times) == 3  # the last 3 of the direction
    view = loan_view(d.core, d.state, d.at())
    lead = sum(x.duration_s for x, _ in measured[-3:]) / 3
    back = sum(y.duration_s for _, y in measured[-3:]) / 3
    learned = view.costs_to(Pool.ROLLOUT)
    assert (learned.to_rollout_s, learned.return_s) == pytest.approx((lead, back))
    assert (learned.lead_s, learned.to_training_s) == (configured.lead_s, configured.to_training_s)
    assert view.costs == configured  # no idle engine was lent to training: nothing learned that way
    assert lead < configured.to_rollout_s and back < configured.return_s
    assert d.replayed().durable() == d.state.durable()
    # [core] learn_loan_costs = false (the default) keeps the configured costs
    fixed = Core(replace(d.core.config, learn_loan_costs=False), d.core.policy)
    assert loan_view(fixed, d.state, d.at()).costs_to(Pool.ROLLOUT) == configured


def test_a_report_that_changes_nothing_writes_no_fact_and_decides_as_the_first_did():
    """40,000 identical `queue_empty` of one engine in one step are at most one fact (issue 42);
    a repeated mini-batch is none. The core decides as it would have on the first."""
    d = boot(make_core(replace(EAGER), "static", op_timeout_s=30.0), TRAIN, ROLLOUT)  # a policy that never lends
    pace(d)
    before = len(d.log)
    for _ in range(40_000):
        idle(d)
    assert [type(x) for x in d.log[before:]] == [f.EngineQueueEmptyObserved]
    assert d.state.dry == (IDLE,) and d.state.inflight is None
    mb = d.state.mini_batch
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=mb.step, done=mb.done, total=mb.total))
    assert len(d.log) == before + 1 and d.state.mini_batch == mb, "the pace measured stays"
    idle(d, running=2)  # not a repeat: it now decodes again
    assert isinstance(d.log[-1], f.EngineQueueEmptyObserved) and d.log[-1].running == 2
    assert d.replayed().durable() == d.state.durable()


def test_a_repeated_queue_empty_still_lends_as_the_first_would_have():
    d = lending_cluster()
    pace(d)
    for _ in range(3):
        facts, _ = idle(d)
    assert d.state.inflight is not None and d.state.inflight.plan.kind is PlanKind.LOAN
    assert sum(isinstance(x, f.EngineQueueEmptyObserved) for x in d.log) == 1


def test_a_job_that_reports_its_step_when_training_ends_had_its_rollout_running_since_training_began():
    """verl's fully async trainer reports a step when its training ends, then that the training
    is done: the next batch has been generating since the training began, not since the report.
    A rollout shorter than that training is done by now: no trainer is lent to it."""
    d = lending_cluster()
    for step, rollout_s in enumerate((50.0, 50.0, 50.0, 400.0)):
        began = d.at()
        d.send(ev.MiniBatchDone(at=began, worker_id=trainer(0), step=step, done=0, total=1))
        d.finish()
        d.at(100.0)
        report_step(d, step, rollout_s=rollout_s, train_s=100.0)
        facts, _ = d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=1, total=1))
        assert loan_view(d.core, d.state, d.at()).step_started_at == began
        started = [x for x in facts if isinstance(x, f.LoanStarted)]
        if rollout_s < 100.0:
            assert not started, started
        else:  # a rollout longer than the training: the trainers are lent for what is left of it
            assert started and started[0].plan.to_pool is Pool.ROLLOUT and started[0].plan.devices == TRAINERS


def test_a_step_reported_as_the_next_training_begins_started_at_the_report():
    """The simulator's order (and a one-step-off trainer's): the step report and the next
    training step's first report at one instant; the step in progress began then."""
    d = lending_cluster(loan_safety=1e9)
    nothing_to_train(d)
    d.send(ev.MiniBatchDone(at=d.at(50.0), worker_id=trainer(0), step=0, done=0, total=8))
    d.finish()
    pace(d, step=0, upto=8, seconds=5.0)
    report_step(d, 0)
    d.send(ev.MiniBatchDone(at=d.state.last_step_at, worker_id=trainer(0), step=1, done=0, total=8))
    assert loan_view(d.core, d.state, d.at()).step_started_at == d.state.last_step_at



def turned(d: Driver) -> list[f.Fact]:
    """Three steps whose rollout took half the training, then training step 3 done (rollout 4
    runs): the facts of its last mini-batch."""
    for step in range(4):
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=0, total=1))
        d.finish()
        d.at(100.0)
        if step < 3:
            report_step(d, step, rollout_s=50.0, train_s=100.0)
        facts, _ = d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=1, total=1))
        assert not any(isinstance(x, f.LoanStarted) for x in facts)
    return facts


def test_a_trainer_loan_refused_on_the_last_steps_is_asked_again_as_the_step_in_progress_shows_its_pace():
    """Issue 43, item 2: the workload turns (three steps whose rollout took half the training,
    then a long one): at the trainer's last mini-batch the last steps' model says the rollout is
    done, and the loan is refused; the engines' progress reports then show the step's own pace,
    the core asks again at the first sample done and at every 1/64 of the step's samples after,
    and the loan starts on the first ask that pays, named after it. Refusals there write nothing."""
    d = lending_cluster()
    refused = [x for x in turned(d) if isinstance(x, f.ProposalRejected)]
    assert refused and refused[0].guard == "loan_payback" and d.state.inflight is None
    written = len(d.log)
    # rollout 4 (one step off) nearly done at its pace (600 of 640): nothing pays, nothing is written
    facts, _ = d.send(ev.ProgressReported(at=d.at(), worker_id=engine(2), step=4, done=600, total=640))
    assert facts == [] and len(d.log) == written and d.state.inflight is None
    # much later, one sample more: that pace would pay, but no 1/64 mark (10 samples) is crossed
    facts, _ = d.send(ev.ProgressReported(at=d.at(10_000.0), worker_id=engine(2), step=4, done=601, total=640))
    assert facts == [] and d.state.inflight is None
    facts, _ = d.send(ev.ProgressReported(at=d.at(), worker_id=engine(2), step=4, done=610, total=640))
    started = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert started and started[0].plan.to_pool is Pool.ROLLOUT and started[0].plan.devices == TRAINERS
    assert "610/640 samples done in" in started[0].reason and "at that pace" in started[0].reason
    assert started[0].saves_s > started[0].cost_s
    d.finish()
    assert isinstance(d.log[-1], f.LoanLanded) and d.replayed().durable() == d.state.durable()
    # the step's first samples ask at once: a quarter done in ~100 s, ~300 s ahead at that pace
    first = lending_cluster()
    turned(first)
    facts, _ = first.send(ev.ProgressReported(at=first.at(), worker_id=engine(2), step=4, done=16, total=64))
    assert any(isinstance(x, f.LoanStarted) for x in facts)
    # turned off (the policy option `lend_from_progress = false`): the same reports lend nothing
    off = boot(Core(d.core.config, load_policy("hysteresis", {"lend_from_progress": False})), TRAIN, ROLLOUT)
    turned(off)
    facts, _ = off.send(ev.ProgressReported(at=off.at(), worker_id=engine(2), step=4, done=16, total=64))
    assert facts == [] and off.state.inflight is None
