"""The resize state machine: `Core.step(state, event) -> (state, facts, commands)`.

Which events a phase accepts is data (`TRANSITIONS`); a missing entry raises
`IllegalTransition` naming the phase and the event, and the state is left unchanged. Input
that a phase accepts but that is wrong (unknown device, stale operation) raises `Refused`,
also with the state unchanged: both are the sender's problem, and the shell tells the sender.

Each transition lives in the module of its family: `workers` (who is live), `resizes` (plans,
the execution every operation sequence shares, outcomes), `loans`, `regroups` (and a step's
tail), `reconcile`. This module holds the tables, `Core`, and where the families meet: a step
report and its boundary, an engine that runs dry, the end of a sequence (`ENDINGS`); and the
operator's and the daemon's own events (configure, restart, pause, resume, shutdown, reload).
Emits StepObserved, PolicyHeld, EngineQueueEmptyObserved, ClusterConfigured, DaemonRestarted,
ResizingPaused, ResizingResumed, ShutdownStarted, ConfigReloaded, ReloadRefused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import costmodel, loans, reconcile, regroups, resizes, workers
from dynaresized.core.config import CoreConfig
from dynaresized.core.loans import loan_view, plan_loan
from dynaresized.core.policy import ObservedView, Policy, ResizeCosts
from dynaresized.core.reconcile import divergence, wrong_engine
from dynaresized.core.regroups import plan_regroup
from dynaresized.core.resizes import acked_set, plan_resize
from dynaresized.core.state import ClusterState, InFlight, Phase, mutate, seen_at
from dynaresized.core.tx import (
    Command,
    CoreLike,
    Handler,
    IllegalTransition,
    QueryState,
    Refused,
    SendOp,
    Tx,
    require_worker,
)
from dynaresized.domain import PlanKind, Pool, WorkerKind

__all__ = [
    "ENDINGS", "TRANSITIONS", "Command", "Core", "CoreConfig", "Handler", "IllegalTransition", "QueryState",
    "Refused", "SendOp",
    # where they were before the core was split by family: tests and tools import them from here
    "acked_set", "divergence", "loan_view", "plan_loan", "plan_regroup", "plan_resize", "wrong_engine",
]
_pending = resizes.pending  # tests/core/test_scale.py imports it from here, by its name before the split


class Core:
    """The resize state machine: `step` an event into facts and commands. Its `config` and
    `policy` are what every transition reads (`tx.CoreLike`)."""

    def __init__(self, config: CoreConfig, policy: Policy) -> None:
        self.config = config
        self.policy = policy

    def step(self, state: ClusterState, event: ev.Event) -> tuple[ClusterState, list[f.Fact], list[Command]]:
        handler = TRANSITIONS[state.phase].get(type(event))
        if handler is None:
            raise IllegalTransition(state.phase, event)
        tx = Tx(state)
        handler(self, tx, event)
        if type(event) in _HEARD_FROM and tx.state.is_live(event.worker_id):  # type: ignore[attr-defined]
            tx.state = seen_at(tx.state, event.worker_id, event.at)  # type: ignore[attr-defined]
        if tx.state.phase is Phase.STEADY and not tx.state.stopping and (
                type(event) is ev.Tick or (tx.facts and any(type(x) in reconcile.RECHECK for x in tx.facts))):
            reconcile.reconcile_next(self, tx, event.at)
        # A Tick can declare a worker lost after an earlier loss in the same Tick sent it an undo
        # or commit op; such a command contradicts this step's own facts and nobody could answer it
        # (a hello re-sends what is still pending), so only commands to live workers leave.
        commands = [c for c in tx.commands if tx.state.is_live(c.worker_id)]
        return tx.state, tx.facts, commands

    def step_answers(self, state: ClusterState, answers: Sequence[ev.OpReported]) -> tuple[
            ClusterState, list[f.Fact], list[Command]]:
        """`step` of each of `answers` in order, their facts and commands together: for the
        answers of one op's targets arriving at once (an op to every device of a wide loan).
        Until the last of them the op is owed to a live target that has not answered (the
        last one's worker), so stepping an answer before it only folds its `OpAcked`: that is
        all done for them, and the last is stepped as any event. Anything else (a failure, a
        stale or duplicate answer, a worker not live) is stepped one by one; an answer `step`
        refuses raises as there, and nothing of the batch is kept (the daemon, which answers
        each sender, steps them one by one)."""
        fl = state.inflight
        if len(answers) < 2 or fl is None or TRANSITIONS[state.phase].get(ev.OpReported) is not resizes.on_op_reported:
            return self._step_each(state, answers)
        targets, acked, seen = resizes.target_set(fl), resizes.acked_set(fl), set()
        for a in answers:
            if (not a.ok or a.actual is not None or a.op_id != fl.op.op_id or a.worker_id not in targets
                    or a.worker_id in acked or a.worker_id in seen or not state.is_live(a.worker_id)):
                return self._step_each(state, answers)
            seen.add(a.worker_id)
        facts: list[f.Fact] = []
        for a in answers[:-1]:
            fact = f.OpAcked(at=a.at, op_id=a.op_id, worker_id=a.worker_id, detail=a.detail, actual=None)
            state = seen_at(mutate(state, fact), a.worker_id, a.at)  # as `step` does: an answer is a beat
            facts.append(fact)
        state, last, commands = self.step(state, answers[-1])
        return state, facts + last, commands

    def _step_each(self, state: ClusterState, events: Sequence[ev.Event]) -> tuple[
            ClusterState, list[f.Fact], list[Command]]:
        facts: list[f.Fact] = []
        commands: list[Command] = []
        for event in events:
            state, more, sent = self.step(state, event)
            facts.extend(more)
            commands.extend(sent)
        return state, facts, commands

    def end_sequence(self, tx: Tx, at: float) -> None:
        """The sequence in flight did its last op (`resizes.advance`): what follows, by `ENDINGS`."""
        _end_sequence(self, tx, at)

    # -- views ---------------------------------------------------------------------
    def view(self, state: ClusterState, now: float) -> ObservedView:
        learned = state.cost_per_device_s
        costs = ResizeCosts(
            to_training_s=learned.get("rollout->training", self.config.costs.to_training_s),
            to_rollout_s=learned.get("training->rollout", self.config.costs.to_rollout_s),
        )
        remaining = None
        if self.config.steps_total is not None:
            remaining = max(self.config.steps_total - state.last_step - 1, 0)
        # the next rollout step, done before its step report (one-step off: at every boundary)
        fresh = state.rollout_done
        done = fresh if fresh is not None and fresh[0] > state.last_step else (-1, -1.0)
        return ObservedView(
            now=now,
            step=state.last_step,
            split=state.split,
            candidates=state.candidates,
            recent=state.recent,
            costs=costs,
            steps_remaining=remaining,
            history=state.step_history,
            rollout_loan_costs=loans.loan_costs(self, state, Pool.ROLLOUT),
            tail_binds=costmodel.tail_binds(self.config.pipeline),
            rollout_done_step=done[0],
            rollout_done_s=done[1],
        )


# -- steps and their boundary ----------------------------------------------------------


def _observe_step(core: CoreLike, tx: Tx, e: ev.StepReported) -> None:
    require_worker(tx.state, e.worker_id)
    reporter = tx.state.step_reporter
    if reporter and reporter != e.worker_id and tx.state.is_live(reporter):
        # One worker of the job reports the steps: the first that does, for as long as it is live.
        raise Refused("not_the_reporter",
                      f"worker {reporter!r} reports this job's steps (it sent the first step report and is live); "
                      f"a step report from {e.worker_id!r} would count a step twice or out of order")
    t = e.timing
    if t.step <= tx.state.last_step:
        raise Refused("stale_step", f"step {t.step} is not after the last observed step {tx.state.last_step}")
    for name in ("rollout_s", "train_s", "weight_sync_s"):
        value = getattr(t, name)
        if not math.isfinite(value) or value < 0:
            raise Refused("bad_value", f"{name}={value!r} must be a finite number of seconds >= 0")
    if t.lengths is not None and (problem := t.lengths.problem()) is not None:
        raise Refused("bad_value", problem)
    for name in ("loan_home_share", "next_done_share"):
        share = getattr(t, name)
        if share is not None and not 0 <= share <= 1:
            raise Refused("bad_value", f"{name}={share!r} must be a share of the next step's samples, from 0 to 1")
    tx.emit(f.StepObserved(at=e.at, worker_id=e.worker_id, timing=t))
    loans.check_loans(tx, e.at, t.step, Pool.ROLLOUT, t.rollout_s)
    resizes.check_outcome(core, tx, e.at)


def on_step_steady(core: CoreLike, tx: Tx, e: ev.StepReported) -> None:
    _observe_step(core, tx, e)
    if tx.state.tail_due:
        # the tail's engine first (trainers lent into it go home after: `_end_sequence`)
        regroups.tail_back(core, tx, e.at)
        if tx.state.inflight is not None:
            return  # the policy is asked once the engines are back (`_after_tail_back`)
    _boundary(core, tx, e.at, e.timing.step)


def on_step_observe(core: CoreLike, tx: Tx, e: ev.StepReported) -> None:
    _observe_step(core, tx, e)


def _boundary(core: CoreLike, tx: Tx, at: float, step: int, why: str = "") -> None:
    """A step boundary's work: lent devices go home, and the policy has its say on step `step`
    (a resize it proposes starts once they are home; paused or stopping, it is not asked)."""
    s = tx.state
    lent = s.lent_devices()
    if s.paused or s.stopping:
        if lent:
            loans.return_loans(core, tx, at, None, "", why=why)
        return
    view = core.view(s, at)
    undo = resizes.undo_proposal(s)
    if undo is not None:
        # a resize judged worse early goes back now: only the safety checks hold an undo back
        if lent:
            loans.return_loans(core, tx, at, undo, resizes.UNDO_SOURCE, why=why, hysteresis=False)
        else:
            resizes.decide(core, tx, view, undo, resizes.UNDO_SOURCE, hysteresis=False, at=at)
        return
    proposal = core.policy(view)
    if lent:
        loans.return_loans(core, tx, at, proposal, core.policy.name, why=why)
        return
    if proposal is None:
        held = getattr(core.policy, "last_reason", "") or "the policy proposed no resize"
        tx.emit(f.PolicyHeld(at=at, source=core.policy.name, step=step, split=s.split, reason=held))
        return
    resizes.decide(core, tx, view, proposal, core.policy.name, hysteresis=core.policy.guarded, at=at)


def on_engine_queue_empty(core: CoreLike, tx: Tx, e: ev.EngineQueueEmpty) -> None:
    w = require_worker(tx.state, e.worker_id)
    if w.kind is not WorkerKind.ROLLOUT_ENGINE:
        raise Refused("bad_request", f"worker {e.worker_id!r} is a {w.kind.value}; only engines report their queue")
    if e.step < 0 or e.running < 0 or e.tokens_left < 0:
        raise Refused("bad_value", f"step={e.step} running={e.running} tokens_left={e.tokens_left} is impossible")
    if e.step <= tx.state.last_step:
        # Late: that step's report already arrived (it cleared the idle engines); recorded, the
        # engine would look lendable while it serves the next step.
        return
    fl = tx.state.inflight
    if fl is not None and not set(w.devices).isdisjoint(fl.plan.devices):
        # Sent before the engine heard of the resize, regroup or loan now moving its devices
        # (it drains first): what it ran dry in is over for it. Recorded, a regrouped engine
        # would look dry before it served a step.
        return
    s = tx.state
    if not (e.running == 0 and e.step == s.dry_step and w.devices[0] in s.dry
            and all(t[0] != w.devices[0] for t in s.tails)):
        # A repeat (the same engine dry again in the same step) would change nothing: no fact
        # (issue 42: 40,000 of them were 40,000 facts). The policy is asked as for the first.
        tx.emit(f.EngineQueueEmptyObserved(at=e.at, worker_id=e.worker_id, device=w.devices[0], step=e.step,
                                           running=e.running, tokens_left=e.tokens_left))
    regroups.consider_tail(core, tx, e.at)
    loans.consider_loan(core, tx, e.at)


# -- the end of an operation sequence --------------------------------------------------


Ending = Callable[[CoreLike, Tx, InFlight, float], None]


def _loan_landed(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> None:
    """A loan landed (`loans.landed`); trainers lent to the rollout may join a tail's engine."""
    if not loans.landed(core, tx, fl, at) and fl.plan.to_pool is Pool.ROLLOUT:
        regroups.consider_tail(core, tx, at)  # trainers lent for the tail join its engine


ENDINGS: dict[PlanKind, Ending] = {
    PlanKind.RESIZE: resizes.committed,
    PlanKind.LOAN: _loan_landed,
    PlanKind.RETURN: loans.returned,
    PlanKind.REGROUP: regroups.committed,
}
"""Plan kind -> what ends a sequence of that kind once its last op is acknowledged (its end fact
and what follows it); a sequence rolled back ends as `resizes.rolled_back`, a reconcile as
`reconcile.finish_reconcile`."""


def _end_sequence(core: CoreLike, tx: Tx, at: float) -> None:
    """The sequence in flight did its last op: its end (`ENDINGS`; a rollback's, a reconcile's),
    then a tail regroup's engine goes back if the step is over, and a boundary put off for it runs."""
    fl = tx.state.inflight
    assert fl is not None
    if fl.reconciling:
        reconcile.finish_reconcile(tx, fl.plan.resize_id, fl.reconciling, at)
        return
    ending = resizes.rolled_back if fl.rolling_back else ENDINGS[fl.plan.kind]
    ending(core, tx, fl, at)
    regroups.tail_back(core, tx, at)
    if fl.source == "tail" and fl.plan.kind is PlanKind.REGROUP:
        _after_tail_back(core, tx, at)


def _after_tail_back(core: CoreLike, tx: Tx, at: float) -> None:
    """The step boundary's work, put off while the tail's engine was undone (`_boundary`)."""
    if tx.state.inflight is None:
        _boundary(core, tx, at, tx.state.last_step, why="the tail's engine is undone")


# -- the operator and the daemon -------------------------------------------------------


def on_configure(core: CoreLike, tx: Tx, e: ev.Configure) -> None:
    if tx.state.configured:
        raise Refused("already_configured", "the cluster inventory is already in the log")
    if not e.devices or len(set(e.devices)) != len(e.devices):
        raise Refused("bad_config", "devices must be a non-empty list of distinct ids")
    if len(e.pools) != len(e.devices):
        raise Refused("bad_config", "every device needs an initial pool")
    for c in e.candidates:
        if c.total != len(e.devices) or c.train < 0 or c.rollout < 0:
            raise Refused("bad_config", f"candidate split {c} does not cover the {len(e.devices)} devices")
    tx.emit(f.ClusterConfigured(at=e.at, devices=e.devices, pools=e.pools, candidates=e.candidates))


def on_daemon_started(core: CoreLike, tx: Tx, e: ev.DaemonStarted) -> None:
    deadline = e.at + core.config.op_timeout_s if tx.state.inflight is not None else None
    tx.emit(f.DaemonRestarted(at=e.at, op_deadline=deadline))


def on_pause(core: CoreLike, tx: Tx, e: ev.PauseRequested) -> None:
    if not tx.state.paused:
        tx.emit(f.ResizingPaused(at=e.at, requested_by=e.requested_by, reason=e.reason))


def on_config_reloaded(core: CoreLike, tx: Tx, e: ev.ConfigReloaded) -> None:
    tx.emit(f.ConfigReloaded(at=e.at, policy=e.policy, options=e.options, guards_changed=e.guards_changed,
                             restart_only=e.restart_only))


def on_reload_refused(core: CoreLike, tx: Tx, e: ev.ReloadRefused) -> None:
    tx.emit(f.ReloadRefused(at=e.at, reason=e.reason))


def on_resume(core: CoreLike, tx: Tx, e: ev.ResumeRequested) -> None:
    degraded = tx.state.phase is Phase.DEGRADED
    if tx.state.paused or degraded:
        tx.emit(f.ResizingResumed(at=e.at, requested_by=e.requested_by))
    s = tx.state
    if degraded and s.lent_devices() and s.inflight is None and not s.stopping:
        # A loan that could neither land nor go back (its undo failed), or whose return failed:
        # its step is over or it never served. Home now, not at a step report that may not come.
        loans.return_loans(core, tx, e.at, None, "", why="resumed after a failed loan")


def on_shutdown(core: CoreLike, tx: Tx, e: ev.ShutdownRequested) -> None:
    if not tx.state.stopping:
        tx.emit(f.ShutdownStarted(at=e.at))


# -- the table -------------------------------------------------------------------------


_HEARD_FROM: frozenset[type] = frozenset({
    ev.ProgressReported, ev.EngineQueueEmpty, ev.MiniBatchDone, ev.StepReported, ev.OpReported, ev.StateReported,
})
"""A worker's accepted messages that prove it alive as a heartbeat does (a worker that reports
needs no heartbeat beside: docs/protocol.md, "Stay registered")."""


_ALWAYS: dict[type, Handler] = {
    ev.Tick: workers.on_tick,
    ev.DaemonStarted: on_daemon_started,
    ev.WorkerHello: workers.on_hello,
    ev.Heartbeat: workers.on_heartbeat,
    ev.WorkerBye: workers.on_bye,
    ev.StateReported: workers.on_state_reported,
    ev.ProgressReported: loans.on_progress,
    ev.PauseRequested: on_pause,
    ev.ResumeRequested: on_resume,
    ev.ShutdownRequested: on_shutdown,
    ev.AbortRequested: resizes.on_abort_requested,
    ev.EngineQueueEmpty: on_engine_queue_empty,
    ev.MiniBatchDone: loans.on_mini_batch_done,
    ev.ConfigReloaded: on_config_reloaded,
    ev.ReloadRefused: on_reload_refused,
}  # type: ignore[dict-item]


_RESIZING: dict[type, Handler] = {
    **_ALWAYS,
    ev.StepReported: on_step_observe,
    ev.OpReported: resizes.on_op_reported,
    ev.ResizeRequested: resizes.on_resize_requested_busy,
    ev.RegroupRequested: resizes.on_resize_requested_busy,
}  # type: ignore[dict-item]


TRANSITIONS: dict[Phase, dict[type, Handler]] = {
    Phase.STEADY: {
        **_ALWAYS,
        ev.Configure: on_configure,
        ev.StepReported: on_step_steady,
        ev.ResizeRequested: resizes.on_resize_requested_steady,
        ev.RegroupRequested: regroups.on_regroup_requested_steady,
    },  # type: ignore[dict-item]
    Phase.DRAINING: _RESIZING,
    Phase.RELEASING: _RESIZING,
    Phase.JOINING: _RESIZING,
    Phase.RESTORING: _RESIZING,
    Phase.COMMITTING: _RESIZING,
    Phase.ROLLING_BACK: _RESIZING,
    Phase.RECONCILING: _RESIZING,
    Phase.DEGRADED: {
        **_ALWAYS,
        ev.StepReported: on_step_observe,
        ev.ResizeRequested: resizes.on_resize_requested_busy,
        ev.RegroupRequested: resizes.on_resize_requested_busy,
    },  # type: ignore[dict-item]
}
"""Phase x event type -> handler. Anything missing is an IllegalTransition."""
