"""Reconciliation, re-sending and registration in the core: a worker's reported actual state
against the log's desired state, driven event by event.

The first two tests are the scenarios that diverged before reconciliation existed: a trainer
that released its device and was declared lost before its answer arrived, and the engine mirror
case; both came back to a log that counted them in a pool they had left."""

from __future__ import annotations

import msgspec
import pytest

from dynaresized.core import Core, Phase, QueryState, Refused, SendOp
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, Split, StepTiming, WorkerKind
from dynaresized.protocol_doc import HOLDING_AFTER, LENT_FROM, LENT_TO, LOAN_STEPS

from .cluster import EAGER, Driver, device, engine, make_core, trainer


def held(holding: Holding, last_op: str = "") -> ActualState:
    return ActualState(holding=holding, last_op=last_op)


def boot_reporting(core: Core, train: int, rollout: int, at: float = 0.0) -> Driver:
    """Like cluster.boot, but every worker reports what it holds (as its launch pool has it)."""
    d = Driver(core, now=at)
    n = train + rollout
    pools = tuple([Pool.TRAINING] * train + [Pool.ROLLOUT] * rollout)
    d.send(ev.Configure(at=at, devices=tuple(device(i) for i in range(n)), pools=pools))
    for i in range(n):
        for kind, name in ((WorkerKind.ROLLOUT_ENGINE, engine(i)), (WorkerKind.TRAINER_RANK, trainer(i))):
            holding = Holding.SERVING if pools[i] is kind.pool else Holding.RELEASED
            d.send(ev.WorkerHello(at=at, worker_id=name, kind=kind, devices=(device(i),), process=f"p-{name}",
                                  actual=held(holding)))
    assert d.state.phase is Phase.STEADY and not d.state.inflight
    return d


def hello(d: Driver, name: str, kind: WorkerKind, i: int, actual: ActualState | None, *, process: str = "",
          previous_connected: bool = False, registered_here: bool = False) -> tuple[list[f.Fact], list]:
    return d.send(ev.WorkerHello(at=d.at(), worker_id=name, kind=kind, devices=(device(i),),
                                 process=process or f"p-{name}", actual=actual,
                                 previous_connected=previous_connected, registered_here=registered_here))


def ack(d: Driver, worker_id: str, actual: ActualState | None, ok: bool = True) -> tuple[list[f.Fact], list]:
    fl = d.state.inflight
    assert fl is not None
    return d.send(ev.OpReported(at=d.at(), worker_id=worker_id, op_id=fl.op.op_id, ok=ok, actual=actual))


def sent(commands: list) -> list[tuple[str, OpKind]]:
    return [(c.worker_id, c.op.kind) for c in commands if isinstance(c, SendOp)]


def lose(d: Driver, worker_id: str) -> list[f.Fact]:
    """Everyone else heartbeats; `worker_id` stays silent past the timeout."""
    t = d.at(11.0)
    for w in sorted(d.state.workers):
        if w != worker_id and d.state.is_live(w):
            d.send(ev.Heartbeat(at=t, worker_id=w))
    facts, _ = d.send(ev.Tick(at=t + 0.1))
    return facts


# -- the scenarios of the issue ----------------------------------------------------------


def test_trainer_lost_after_release_is_told_to_reclaim_when_it_comes_back() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    facts, commands = d.force(1, 3)  # moves n0:gpu1 training -> rollout
    assert d.state.inflight.plan.devices == (device(1),)
    ack(d, trainer(1), held(Holding.DRAINED))  # drain
    assert d.state.inflight.op.kind is OpKind.RELEASE
    # tr1 performs the release and leaves its group, but is declared lost before its answer arrives
    facts = lose(d, trainer(1))
    assert [type(x) for x in facts][:3] == [f.WorkerLost, f.OpFailed, f.ResizeAborted]
    assert any(isinstance(x, f.ResizeRolledBack) for x in facts)  # the undo had no live target
    assert d.state.devices[device(1)].pool is Pool.TRAINING  # the log: training
    # it comes back (same process) and says what it really holds
    facts, commands = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, held(Holding.RELEASED, "r1/1-release"))
    started = [x for x in facts if isinstance(x, f.ReconcileStarted)]
    assert started and started[0].desired is Holding.SERVING and started[0].actual is Holding.RELEASED
    assert sent(commands) == [(trainer(1), OpKind.RECLAIM)]
    assert d.state.phase is Phase.RECONCILING
    assert all(c.training == (device(0), device(1)) for c in commands)  # the pools do not change
    _, commands = ack(d, trainer(1), held(Holding.DRAINED))
    assert sent(commands) == [(trainer(1), OpKind.RESUME)]
    facts, _ = ack(d, trainer(1), held(Holding.SERVING))
    assert isinstance(facts[-1], f.ReconcileFinished) and facts[-1].ok
    assert d.state.phase is Phase.STEADY and d.state.inflight is None
    assert d.state.workers[trainer(1)].actual.holding is Holding.SERVING
    assert d.state.split == Split(2, 2)
    assert d.replayed().durable() == d.state.durable()


@pytest.mark.parametrize("released", [False, True], ids=["drained", "released"])
def test_engine_lost_mid_resize_is_converged_when_it_comes_back(released: bool) -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    d.force(3, 1)  # moves n0:gpu3 rollout -> training
    assert d.state.inflight.plan.devices == (device(3),)
    ack(d, engine(3), held(Holding.DRAINED))  # drained; then lost before the release answer
    facts = lose(d, engine(3))
    assert any(isinstance(x, f.ResizeRolledBack) for x in facts)
    assert d.state.devices[device(3)].pool is Pool.ROLLOUT
    actual = held(Holding.RELEASED if released else Holding.DRAINED)
    facts, commands = hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, actual)
    expected = [OpKind.RECLAIM, OpKind.RESUME] if released else [OpKind.RESUME]
    assert [op.kind for op in d.state.inflight.ops] == expected
    assert all(op.from_pool is Pool.ROLLOUT and op.targets == (engine(3),) for op in d.state.inflight.ops)
    assert sent(commands) == [(engine(3), expected[0])]
    for kind in expected:
        after = Holding.DRAINED if kind is OpKind.RECLAIM else Holding.SERVING
        ack(d, engine(3), held(after))
    assert d.state.phase is Phase.STEADY
    assert d.state.workers[engine(3)].actual.holding is Holding.SERVING
    # the next resize finds it serving and drains it as usual
    _, commands = d.force(3, 1)
    assert sent(commands) == [(engine(3), OpKind.DRAIN)]
    assert d.replayed().durable() == d.state.durable()


def test_a_worker_holding_a_device_the_log_gave_away_is_released() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    # tr3 says it is training, but n0:gpu3 is in the rollout pool: it must leave its group
    facts, commands = hello(d, trainer(3), WorkerKind.TRAINER_RANK, 3, held(Holding.SERVING))
    assert [op.kind for op in d.state.inflight.ops] == [OpKind.DRAIN, OpKind.RELEASE]
    assert all(op.from_pool is Pool.TRAINING for op in d.state.inflight.ops)
    ack(d, trainer(3), held(Holding.DRAINED))
    ack(d, trainer(3), held(Holding.RELEASED))
    assert d.state.phase is Phase.STEADY
    assert d.replayed().durable() == d.state.durable()


# -- workers that cannot converge ------------------------------------------------------------


def test_a_worker_whose_converging_op_fails_is_left_out_of_plans() -> None:
    d = boot_reporting(make_core(msgspec.structs.replace(EAGER, min_rollout=0)), 2, 2)
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.RELEASED))
    facts, _ = ack(d, engine(3), held(Holding.RELEASED), ok=False)
    assert [type(x) for x in facts][-2:] == [f.ReconcileFinished, f.WorkerUnconverged]
    assert not facts[-2].ok and "failed on eng3" in facts[-1].reason
    assert engine(3) in d.state.unconverged and d.state.phase is Phase.STEADY
    # no second attempt on its own: a reconcile loop would never end
    facts, _ = d.send(ev.StateReported(at=d.at(), worker_id=engine(2), actual=held(Holding.SERVING, "x")))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts)
    # n0:gpu3 is not planned while its engine has not converged; n0:gpu2 is
    _, commands = d.force(3, 1)
    assert d.state.inflight.plan.devices == (device(2),)
    d.finish()
    facts, _ = d.force(4, 0)
    rejected = [x for x in facts if isinstance(x, f.ProposalRejected)]
    assert rejected and "left out: a worker on them has not converged" in rejected[0].reason
    # once it reports a state that agrees with the log, it is back
    d.send(ev.StateReported(at=d.at(), worker_id=engine(3), actual=held(Holding.SERVING)))
    assert engine(3) not in d.state.unconverged
    assert d.replayed().durable() == d.state.durable()


def test_a_worker_that_reports_failed_is_unconverged_at_once() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    facts, commands = hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0,
                            ActualState(holding=Holding.FAILED, detail="optimizer step raised"))
    assert isinstance(facts[-1], f.WorkerUnconverged) and "optimizer step raised" in facts[-1].reason
    assert commands == [] and d.state.inflight is None


def test_acks_that_still_report_the_old_state_end_unconverged_not_in_a_loop() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.DRAINED))
    facts, commands = ack(d, engine(3), held(Holding.DRAINED))  # "resumed", yet still drained
    assert [type(x) for x in facts][-2:] == [f.ReconcileFinished, f.WorkerUnconverged]
    assert "still reports drained" in facts[-1].reason
    assert commands == [] and d.state.inflight is None


def test_a_worker_that_finished_its_job_is_not_reconciled() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    facts, commands = hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0, held(Holding.DONE))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts) and commands == []


def test_a_worker_that_does_not_report_is_never_reconciled() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    facts, commands = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, None)
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts) and commands == []


def test_a_reconcile_waits_for_the_resize_in_flight() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    d.force(1, 3)  # tr1 drains and releases
    facts, commands = hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.DRAINED))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts)
    assert d.state.inflight.reconciling == ""
    for actual in (Holding.DRAINED, Holding.RELEASED):
        ack(d, trainer(1), held(actual))
    ack(d, engine(1), held(Holding.SERVING))  # join
    ack(d, engine(1), held(Holding.SERVING))  # restore
    facts = []
    while d.state.inflight is not None and not d.state.inflight.reconciling:
        fl = d.state.inflight
        w = next(w for w in fl.op.targets if w not in fl.acked)
        new, _ = ack(d, w, d.state.workers[w].actual)
        facts += new
    assert any(isinstance(x, f.ResizeCommitted) for x in facts)
    assert d.state.inflight.reconciling == engine(3)  # started right after the commit
    assert [op.kind for op in d.state.inflight.ops] == [OpKind.RESUME]


def test_guards_see_a_reconcile_as_an_operation_in_flight() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.DRAINED))
    facts, commands = d.force(3, 1)
    assert isinstance(facts[0], f.ProposalRejected) and facts[0].guard == "in_flight"
    assert "reconcile c1 of eng3" in facts[0].reason and commands == []


def test_losing_the_worker_under_reconcile_ends_it_without_marking_it() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.RELEASED))
    facts = lose(d, engine(3))
    done = [x for x in facts if isinstance(x, f.ReconcileFinished)]
    assert done and not done[0].ok and engine(3) not in d.state.unconverged
    # back again: converged this time
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.RELEASED))
    assert d.state.inflight.reconciling == engine(3)


# -- re-sending and asking -------------------------------------------------------------------


def test_a_pending_op_is_re_sent_to_live_targets_that_have_not_answered() -> None:
    core = Core(make_core().config.__class__(guards=EAGER, op_resend_s=2.0), make_core().policy)
    d = boot_reporting(core, 3, 1)
    d.force(1, 3)  # two trainers drain: tr1 and tr2
    fl = d.state.inflight
    assert set(fl.op.targets) == {trainer(1), trainer(2)}
    ack(d, trainer(2), held(Holding.DRAINED))
    t0 = d.state.inflight.op_started_at
    _, commands = d.send(ev.Tick(at=t0 + 1.0))
    assert sent(commands) == []  # not yet
    _, commands = d.send(ev.Tick(at=t0 + 2.5))
    assert sent(commands) == [(trainer(1), OpKind.DRAIN)]  # only the one that has not answered
    _, commands = d.send(ev.Tick(at=t0 + 3.0))
    assert sent(commands) == []  # once per interval
    _, commands = d.send(ev.Tick(at=t0 + 4.6))
    assert sent(commands) == [(trainer(1), OpKind.DRAIN)]
    # the repeat's answer counts once; the resize goes on
    facts, _ = ack(d, trainer(1), held(Holding.DRAINED))
    assert d.state.inflight.op.kind is OpKind.RELEASE
    with pytest.raises(Refused) as info:  # the second copy of the same answer is stale
        d.send(ev.OpReported(at=d.at(), worker_id=trainer(1), op_id=fl.op.op_id, ok=True))
    assert info.value.code == "stale_op"
    assert d.state.durable() == d.replayed().durable()  # re-sending leaves no trace in the log


def test_the_daemon_asks_reporting_workers_for_their_state() -> None:
    core = Core(make_core().config.__class__(guards=EAGER, audit_interval_s=30.0), make_core().policy)
    d = boot_reporting(core, 1, 1)
    d.send(ev.WorkerHello(at=0.0, worker_id=trainer(1), kind=WorkerKind.TRAINER_RANK, devices=(device(1),),
                          process=f"p-{trainer(1)}"))  # a client that does not say what it holds
    d.heartbeat_all(30.0)
    _, commands = d.send(ev.Tick(at=31.0))
    asked = sorted(c.worker_id for c in commands if isinstance(c, QueryState))
    assert asked == sorted([engine(0), engine(1), trainer(0)])  # not the one that never says
    d.heartbeat_all(39.0)
    _, commands = d.send(ev.Tick(at=40.0))
    assert not [c for c in commands if isinstance(c, QueryState)]


def test_a_state_report_that_changes_nothing_records_nothing() -> None:
    d = boot_reporting(make_core(EAGER), 1, 1)
    facts, _ = d.send(ev.StateReported(at=d.at(), worker_id=engine(1), actual=held(Holding.SERVING)))
    assert facts == []


# -- duplicate processes ---------------------------------------------------------------------


def test_a_duplicate_process_is_refused_while_the_first_is_still_connected() -> None:
    d = boot_reporting(make_core(EAGER), 2, 2)
    before = d.state
    with pytest.raises(Refused) as info:
        hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0, held(Holding.SERVING), process="another",
              previous_connected=True)
    assert info.value.code == "duplicate_worker"
    assert "still open" in info.value.message and "another worker id" in info.value.message
    assert d.state is before
    # the same process saying hello again is neither a duplicate nor a new registration
    facts, _ = hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0, held(Holding.SERVING), previous_connected=True,
                     registered_here=True)
    assert facts == [] and d.state.workers[trainer(0)].incarnation == 1
    # a new process whose predecessor's connection is gone is a restart: the old one is lost
    facts, _ = hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0, held(Holding.SERVING), process="restarted")
    assert [type(x) for x in facts][:2] == [f.WorkerLost, f.WorkerRegistered]


def test_the_registered_process_saying_hello_again_keeps_its_registration() -> None:
    """Hellos that crossed a slow link, or one sent because no heartbeat answer came: each used
    to register anew, which made the token the worker held stale, so its next message was
    refused and it said hello again (chaos runs: registration churn until it was lost)."""
    core = Core(make_core().config.__class__(guards=EAGER, op_timeout_s=30.0), make_core().policy)
    d = boot_reporting(core, 2, 2)
    d.force(1, 3)
    assert d.state.inflight.op.targets == (trainer(1),)
    facts, commands = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, held(Holding.SERVING), registered_here=True)
    assert facts == [] and d.state.workers[trainer(1)].incarnation == 1 and d.state.is_live(trainer(1))
    assert sent(commands) == [(trainer(1), OpKind.DRAIN)]  # its answer may have been lost: asked again
    assert d.state.last_seen[trainer(1)] == d.now
    # what it says it holds is recorded as a report would be
    facts, _ = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, held(Holding.DRAINED), registered_here=True)
    assert [type(x) for x in facts] == [f.WorkerReported] and d.state.workers[trainer(1)].incarnation == 1
    # a hello the shell holds no registration for (the daemon restarted since) registers anew
    facts, _ = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, held(Holding.DRAINED))
    assert [type(x) for x in facts] == [f.WorkerRegistered] and d.state.workers[trainer(1)].incarnation == 2
    # and so does one after it was lost
    lose(d, trainer(1))
    assert not d.state.is_live(trainer(1))
    facts, _ = hello(d, trainer(1), WorkerKind.TRAINER_RANK, 1, held(Holding.DRAINED), registered_here=True)
    assert f.WorkerRegistered in [type(x) for x in facts] and d.state.workers[trainer(1)].incarnation == 3
    assert d.replayed().durable() == d.state.durable()


def test_an_unconverged_worker_is_tried_again_after_the_retry_interval() -> None:
    core = Core(make_core().config.__class__(guards=EAGER, reconcile_retry_s=5.0, heartbeat_timeout_s=1e9),
                make_core().policy)
    d = boot_reporting(core, 2, 2)
    hello(d, engine(3), WorkerKind.ROLLOUT_ENGINE, 3, held(Holding.RELEASED))
    facts, _ = ack(d, engine(3), held(Holding.RELEASED), ok=False)
    failed_at = facts[-1].at
    facts, commands = d.send(ev.Tick(at=failed_at + 4.0))
    assert not any(isinstance(x, f.ReconcileStarted) for x in facts)  # not yet
    facts, commands = d.send(ev.Tick(at=failed_at + 5.5))
    assert any(isinstance(x, f.ReconcileStarted) for x in facts)
    assert sent(commands) == [(engine(3), OpKind.RECLAIM)]
    assert engine(3) in d.state.unconverged  # still left out of plans while it is tried
    ack(d, engine(3), held(Holding.DRAINED))
    ack(d, engine(3), held(Holding.SERVING))
    assert engine(3) not in d.state.unconverged and d.state.phase is Phase.STEADY
    assert d.replayed().durable() == d.state.durable()


def test_a_worker_whose_converging_op_failed_after_it_acted_is_back_at_its_next_report() -> None:
    """Chaos seed 73: the last converging op's answer said "failed" (the failure was injected on
    the way) while it carried the state the log wants. The worker is left out at first; the next
    report, which repeats that state, brings it back: nothing else would (it is not retried, as
    it does not disagree with the log)."""
    d = boot_reporting(make_core(EAGER), 2, 2)
    hello(d, trainer(0), WorkerKind.TRAINER_RANK, 0, held(Holding.RELEASED))
    ack(d, trainer(0), held(Holding.DRAINED))  # reclaim
    facts, _ = ack(d, trainer(0), held(Holding.SERVING), ok=False)  # resume: acted, answer "failed"
    assert isinstance(facts[-1], f.WorkerUnconverged) and trainer(0) in d.state.unconverged
    facts, _ = d.send(ev.StateReported(at=d.at(), worker_id=trainer(0), actual=held(Holding.SERVING)))
    assert [type(x) for x in facts] == [f.WorkerReported]
    assert trainer(0) not in d.state.unconverged
    assert d.replayed().durable() == d.state.durable()


def test_the_daemons_own_stall_is_not_held_against_the_workers() -> None:
    """Chaos runs at load 50: the daemon got no CPU for 3 s, then ticked before reading the
    heartbeats waiting in its socket and declared all 8 workers lost. With `stall_s`, a tick
    that comes long after the previous one moves the heartbeat clocks by the blind time."""
    config = make_core().config.__class__(guards=EAGER, heartbeat_timeout_s=1.5, stall_s=0.5)
    d = boot_reporting(Core(config, make_core().policy), 2, 2)
    t = d.at()
    d.send(ev.Tick(at=t + 0.05))
    facts, _ = d.send(ev.Tick(at=t + 3.0))  # the daemon was blind for 2.95 s
    assert not any(isinstance(x, f.WorkerLost) for x in facts)
    # ticking normally again, the others heartbeating: engine 3, silent since boot (1.05 s
    # watched before the stall), is lost once watched silent for 1.5 s in all
    lost = []
    for i in range(1, 20):
        for w in sorted(d.state.workers):
            if w != engine(3) and d.state.is_live(w):
                d.send(ev.Heartbeat(at=t + 3.0 + 0.1 * i - 0.01, worker_id=w))
        facts, _ = d.send(ev.Tick(at=t + 3.0 + 0.1 * i))
        lost += [(x.worker_id, round(x.at - t, 1)) for x in facts if isinstance(x, f.WorkerLost)]
    assert lost == [(engine(3), 3.5)]
    # without stall_s (the simulator, tests that jump in time) every gap counts
    d = boot_reporting(make_core(msgspec.structs.replace(EAGER)), 2, 2)
    d.send(ev.Tick(at=d.at() + 0.05))
    facts, _ = d.send(ev.Tick(at=d.at() + 11.0))
    assert sum(isinstance(x, f.WorkerLost) for x in facts) == 8


def test_the_daemons_own_stall_is_not_held_against_the_op_in_flight() -> None:
    """Chaos run 363 of 1000, no fault injected: the daemon got no CPU for 5.2 s while a commit
    was in flight; its first tick after the stall found the commit's 4 s deadline past and
    degraded, with the four answers already waiting in its socket. The stall moves the op's
    deadline on too, as a recorded fact (the deadline is durable state)."""
    config = make_core().config.__class__(guards=EAGER, op_timeout_s=4.0, heartbeat_timeout_s=1.5, stall_s=0.5)
    d = boot_reporting(Core(config, make_core().policy), 2, 2)
    d.force(1, 3)
    fl = d.state.inflight
    t = fl.op_started_at
    d.heartbeat_all(t + 0.1)
    d.send(ev.Tick(at=t + 0.1))
    facts, _ = d.send(ev.Tick(at=t + 5.3))  # blind for 5.2 s
    stalled = [x for x in facts if isinstance(x, f.DaemonStalled)]
    assert stalled and abs(stalled[0].seconds - 5.2) < 1e-9
    assert not any(isinstance(x, (f.OpFailed, f.Degraded, f.WorkerLost)) for x in facts)
    assert d.state.inflight.op_deadline == pytest.approx(fl.op_deadline + 5.2)
    assert d.replayed().durable() == d.state.durable()
    d.send(ev.OpReported(at=t + 5.31, worker_id=trainer(1), op_id=fl.op.op_id, ok=True,
                         actual=held(Holding.DRAINED)))  # the answer that waited in the socket
    assert d.state.inflight.op.kind is OpKind.RELEASE
    # without stalls the next op's deadline holds as before: unanswered, the release times out
    # at the first tick past its 4 s
    started = d.state.inflight.op_started_at
    for i in range(1, 60):
        d.heartbeat_all(started + 0.1 * i)
        facts, _ = d.send(ev.Tick(at=started + 0.1 * i))
        if any(isinstance(x, f.OpFailed) for x in facts):
            break
    failed = next(x for x in facts if isinstance(x, f.OpFailed))
    assert "release timed out" in failed.reason and failed.at == pytest.approx(started + 4.1)


# -- a loan and its return, reported as docs/protocol.md's tables say ------------------


def lend(d: Driver, to_pool: Pool) -> Pool:
    """Start a loan to `to_pool` (an idle engine to training, or trainers with nothing to train
    to the rollout); the lent devices' home pool."""
    if to_pool is Pool.TRAINING:
        for done in (1, 2):
            d.send(ev.MiniBatchDone(at=d.at(60.0), worker_id=trainer(0), step=0, done=done, total=8))
        d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(3), step=1))
    else:
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=0))
    assert d.state.inflight is not None and d.state.inflight.plan.kind is PlanKind.LOAN
    return to_pool.other


def send_home(d: Driver, home: Pool) -> None:
    """The step boundary that sends the loan home: the step report, or the training step's start."""
    if home is Pool.ROLLOUT:
        d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
            step=0, rollout_s=10.0, train_s=10.0, rollout_devices=2, train_devices=2)))
    else:
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=8))
    assert d.state.inflight is not None and d.state.inflight.plan.kind is PlanKind.RETURN


def role(d: Driver, worker_id: str, home: Pool) -> str:
    return LENT_FROM if d.state.workers[worker_id].kind.pool is home else LENT_TO


def answer_as_the_tables_say(d: Driver, home: Pool, after_join: Holding | None = None) -> None:
    """Each target answers each op of the loan or return in flight with the holding that
    protocol_doc.LOAN_STEPS gives its role (`after_join`: what it reports after a join instead)."""
    while (fl := d.state.inflight) is not None:
        step = next(s for s in LOAN_STEPS[fl.plan.kind] if s.op is fl.op.kind)
        for w in fl.op.targets:
            holding = after_join if after_join is not None and step.op is OpKind.JOIN else step.reports(role(d, w, home))
            ack(d, w, held(holding))


def reconciles_at_the_next_tick(d: Driver) -> list[f.ReconcileStarted]:
    now = d.at()
    d.heartbeat_all(now)
    facts, _ = d.send(ev.Tick(at=now))
    return [x for x in facts if isinstance(x, f.ReconcileStarted)]


@pytest.mark.parametrize("to_pool", [Pool.TRAINING, Pool.ROLLOUT])
def test_workers_that_report_what_the_loan_tables_say_are_never_reconciled(to_pool: Pool) -> None:
    d = boot_reporting(make_core(EAGER, "hysteresis", op_timeout_s=30.0), 2, 2)
    home = lend(d, to_pool)
    devices = d.state.inflight.plan.devices
    on_lent = [w for w in sorted(d.state.workers) if d.state.workers[w].devices[0] in devices]
    for plan, ended in ((PlanKind.LOAN, f.LoanLanded), (PlanKind.RETURN, f.LoanReturned)):
        answer_as_the_tables_say(d, home)
        assert isinstance(d.log[-1], ended)
        last = LOAN_STEPS[plan][-1]
        for w in on_lent:  # the table's last row is what the log says each worker should hold
            worker = d.state.workers[w]
            assert worker.actual.holding is d.state.desired(worker) is last.reports(role(d, w, home)), (plan, w)
        assert reconciles_at_the_next_tick(d) == []
        if plan is PlanKind.LOAN:
            send_home(d, home)
    assert d.state.reconciles_started == 0 and d.state.lent_devices() == ()


def reconciled(d: Driver) -> list[tuple[str, Holding, Holding, list[OpKind]]]:
    """Tick and answer every reconcile that follows as a worker that does as it is told:
    (worker, desired, actual, ops) of each."""
    done = []
    started = reconciles_at_the_next_tick(d)
    while started:
        x = started[0]
        done.append((x.worker_id, x.desired, x.actual, [op.kind for op in x.plan.ops]))
        facts, _ = ack(d, x.worker_id, held(x.desired))
        started = [y for y in facts if isinstance(y, f.ReconcileStarted)]
    return done


@pytest.mark.parametrize("to_pool", [Pool.TRAINING, Pool.ROLLOUT])
def test_a_worker_that_stays_drained_after_a_loans_join_is_resumed_after_the_loan_and_its_return(
        to_pool: Pool) -> None:
    # What a client written from the old table reported: `drained` after a join, waiting for a
    # commit that a loan never sends. It takes no work, so the daemon must not count it serving.
    d = boot_reporting(make_core(EAGER, "hysteresis", op_timeout_s=30.0), 2, 2)
    home = lend(d, to_pool)
    for plan in (PlanKind.LOAN, PlanKind.RETURN):
        joined = d.state.inflight.plan.ops[-1].targets
        answer_as_the_tables_say(d, home, after_join=Holding.DRAINED)
        assert reconciled(d) == [(w, Holding.SERVING, Holding.DRAINED, [OpKind.RESUME]) for w in joined], plan
        if plan is PlanKind.LOAN:
            send_home(d, home)


@pytest.mark.parametrize("failed", [PlanKind.LOAN, PlanKind.RETURN])
def test_a_loan_or_return_whose_join_fails_is_rolled_back_to_the_tables_other_row(failed: PlanKind) -> None:
    d = boot_reporting(make_core(EAGER, "hysteresis", op_timeout_s=30.0), 2, 2)
    home = lend(d, Pool.TRAINING)
    if failed is PlanKind.RETURN:
        answer_as_the_tables_say(d, home)
        send_home(d, home)
    for step in LOAN_STEPS[failed][:-1]:
        for w in d.state.inflight.op.targets:
            ack(d, w, held(step.reports(role(d, w, home))))
    (joining,) = d.state.inflight.op.targets
    ack(d, joining, held(Holding.RELEASED), ok=False)
    while (fl := d.state.inflight) is not None:  # the undo ops, answered as the resize table says
        for w in fl.op.targets:
            ack(d, w, held(HOLDING_AFTER[fl.op.kind][0]))
    assert isinstance(d.log[-1], f.ResizeRolledBack)
    row = LOAN_STEPS[PlanKind.RETURN if failed is PlanKind.LOAN else PlanKind.LOAN][-1]  # home, or landed
    for w in (engine(3), trainer(3)):
        worker = d.state.workers[w]
        assert worker.actual.holding is d.state.desired(worker) is row.reports(role(d, w, home)), w
    assert reconciles_at_the_next_tick(d) == []
