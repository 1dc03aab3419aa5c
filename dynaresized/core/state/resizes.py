"""The fold of a resize, of what every operation sequence shares (acks, completions, an abort,
its rollback, a degraded end) and of a resize's outcome. Folds ResizeStarted, OpAcked, OpCompleted,
OpFailed, ResizeAborted, ResizeCommitted, ResizeRolledBack, Degraded, PredictionChecked, ResizeJudged."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.state.cluster import (
    PHASE_OF_OP,
    ClusterState,
    InFlight,
    Outcome,
    Phase,
    on,
    place,
    regrouped,
    set_actual,
    unengined,
)
from dynaresized.domain import Placement, PlanKind, Pool, ResizePlan, moving, placed


@on(f.ResizeStarted)
def _(s: ClusterState, e: f.ResizeStarted) -> ClusterState:
    plan = e.plan
    s = place(s, plan.devices, moving(plan.from_pool, plan.to_pool))
    inflight = InFlight(
        plan=plan,
        source=e.source,
        reason=e.reason,
        started_at=e.at,
        ops=plan.ops,
        index=0,
        op_started_at=e.at,
        op_deadline=e.op_deadline,
    )
    outcome = Outcome(resize_id=plan.resize_id, predicted_step_s=e.predicted_step_s,
                      predicted_step_s_after=e.predicted_step_s_after, measured_step_s=e.measured_step_s,
                      cost_s=e.predicted_cost_s, payback_steps=e.payback_steps,
                      measured_s_per_token=e.measured_s_per_token, before=plan.before, source=e.source)
    return replace(
        s,
        inflight=inflight,
        phase=PHASE_OF_OP[plan.ops[0].kind],
        resizes_started=s.resizes_started + 1,
        outcome=outcome,
        undo_to=None,
    )


@on(f.OpAcked)
def _(s: ClusterState, e: f.OpAcked) -> ClusterState:
    assert s.inflight is not None
    if e.actual is not None and e.worker_id in s.workers:
        s = set_actual(s, e.worker_id, e.actual)
    return replace(s, inflight=replace(s.inflight, acked=s.inflight.acked + (e.worker_id,)))


@on(f.OpCompleted)
def _(s: ClusterState, e: f.OpCompleted) -> ClusterState:
    fl = s.inflight
    assert fl is not None
    nxt = fl.index + 1
    if nxt >= len(fl.ops):
        return replace(s, inflight=replace(fl, index=nxt, acked=()))
    inflight = replace(
        fl, index=nxt, acked=(), op_started_at=e.at, op_deadline=e.next_deadline or e.at
    )
    if fl.reconciling:
        phase = Phase.RECONCILING
    else:
        phase = Phase.ROLLING_BACK if fl.rolling_back else PHASE_OF_OP[fl.ops[nxt].kind]
    return replace(s, inflight=inflight, phase=phase)


@on(f.OpFailed)
def _(s: ClusterState, e: f.OpFailed) -> ClusterState:
    return s  # what follows (abort, degraded) is its own fact


@on(f.ResizeAborted)
def _(s: ClusterState, e: f.ResizeAborted) -> ClusterState:
    fl = s.inflight
    assert fl is not None
    inflight = replace(
        fl,
        ops=e.undo,
        index=0,
        acked=(),
        rolling_back=True,
        abort_reason=e.reason,
        op_started_at=e.at,
        op_deadline=e.op_deadline or e.at,
    )
    return replace(s, inflight=inflight, phase=Phase.ROLLING_BACK)


@on(f.ResizeCommitted)
def _(s: ClusterState, e: f.ResizeCommitted) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = place(unengined(s, plan.devices), plan.devices, placed(plan.to_pool))
    costs = dict(s.cost_per_device_s)
    per_device = e.duration_s / max(len(plan.devices), 1)
    old = costs.get(plan.direction)
    costs[plan.direction] = per_device if old is None else 0.5 * old + 0.5 * per_device
    outcome = s.outcome
    if outcome is not None and outcome.resize_id == e.resize_id:
        outcome = replace(outcome, committed=True)
    s = replace(s, phase=Phase.STEADY, recent=(), resizes_committed=s.resizes_committed + 1, cost_per_device_s=costs,
                outcome=outcome)
    return _end_resize(s, e.at, e.step)


def _settled(plan: ResizePlan, pool: Pool) -> Placement:
    """Where a device of `plan` rests in `pool`: a loan's device keeps its home recorded."""
    home = plan.from_pool if plan.kind is PlanKind.LOAN else plan.to_pool
    if plan.kind is PlanKind.RESIZE or pool is home:
        return placed(pool)
    return placed(pool, home=home)


@on(f.ResizeRolledBack)
def _(s: ClusterState, e: f.ResizeRolledBack) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = place(s, plan.devices, _settled(plan, plan.from_pool))
    undone = 1 if plan.kind is PlanKind.RESIZE else 0  # a loan rolled back is not a resize's
    s = replace(s, phase=Phase.STEADY, resizes_rolled_back=s.resizes_rolled_back + undone,
                outcome=_outcome_without(s.outcome, plan.resize_id))
    return _end_resize(s, e.at, e.step)


@on(f.Degraded)
def _(s: ClusterState, e: f.Degraded) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    if plan.kind is PlanKind.REGROUP and not s.inflight.rolling_back:  # type: ignore[union-attr]
        s = regrouped(s, plan)  # its commit failed: past the point of no return, rolled forward
    if plan.kind is PlanKind.RESIZE and e.placed_in is plan.to_pool:
        s = unengined(s, plan.devices)  # a resize's engines that left the rollout pool are gone
    s = place(s, plan.devices, _settled(plan, e.placed_in))
    degraded = 1 if plan.kind is PlanKind.RESIZE else 0  # a loan that degraded is not a resize's
    s = replace(s, phase=Phase.DEGRADED, degraded_reason=e.reason, outcome=_outcome_without(s.outcome, plan.resize_id),
                resizes_degraded=s.resizes_degraded + degraded)
    return _end_resize(s, e.at, e.step)


def _end_resize(state: ClusterState, at: float, step: int) -> ClusterState:
    if state.inflight is not None and state.inflight.plan.kind is not PlanKind.RESIZE:
        # A loan is not a resize for the guards: dwell and cooldown count from real resizes.
        return replace(state, inflight=None)
    return replace(
        state,
        inflight=None,
        history=replace(state.history, last_resize_end_at=at, last_resize_end_step=step),
    )


def _outcome_without(outcome: Outcome | None, resize_id: str) -> Outcome | None:
    """A resize that did not land is not measured; a loan's ending leaves the one measured alone."""
    return None if outcome is not None and outcome.resize_id == resize_id else outcome


# -- the outcome ------------------------------------------------------------------------


@on(f.PredictionChecked)
def _(s: ClusterState, e: f.PredictionChecked) -> ClusterState:
    outcome = s.outcome
    if outcome is not None and outcome.resize_id == e.resize_id:
        outcome = replace(outcome, checked=True)
    return replace(s, outcome=outcome, last_prediction=e,
                   resize_accuracy=s.resize_accuracy.add(e.error_s, e.measured_step_s_after))


@on(f.ResizeJudged)
def _(s: ClusterState, e: f.ResizeJudged) -> ClusterState:
    outcome = None if s.outcome is not None and s.outcome.resize_id == e.resize_id else s.outcome
    history = replace(s.history, payback_factor=e.payback_factor)
    return replace(s, outcome=outcome, last_verdict=e, history=history, undo_to=e.undo_to)
