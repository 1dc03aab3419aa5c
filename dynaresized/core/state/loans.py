"""The fold of loans: engines run dry and mini-batches (what a loan may take), loans, their way
home and their measured times. Folds EngineQueueEmptyObserved, MiniBatchObserved, LoanStarted,
LoanLanded, LoanReturnStarted, LoanReturned, LoanChecked."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.state.cluster import (
    LOAN_TIMES_KEPT,
    PHASE_OF_OP,
    ClusterState,
    InFlight,
    LoanCheck,
    LoanTime,
    MiniBatch,
    Phase,
    on,
    place,
    undry,
)
from dynaresized.domain import Pool, moving, placed


@on(f.EngineQueueEmptyObserved)
def _(s: ClusterState, e: f.EngineQueueEmptyObserved) -> ClusterState:
    dry = () if e.step != s.dry_step else s.dry
    tails = () if e.step != s.dry_step else s.tails
    if e.step < s.dry_step:
        return s  # a late report of an older step
    if e.running == 0 and e.device not in dry:
        dry = dry + (e.device,)
    tails = tuple(t for t in tails if t[0] != e.device)
    if e.running > 0:
        tails = tails + ((e.device, e.running, e.tokens_left, e.at),)
    return replace(s, dry_step=e.step, dry=dry, tails=tails)


@on(f.MiniBatchObserved)
def _(s: ClusterState, e: f.MiniBatchObserved) -> ClusterState:
    old = s.mini_batch
    # the pace is measured between two finished mini-batches (a step's start includes its overhead)
    last = e.at - old.at if old is not None and old.step == e.step and e.done > old.done > 0 else 0.0
    began = e.at if e.done == 0 else s.train_began_at
    return replace(s, mini_batch=MiniBatch(e.step, e.done, e.total, e.at, last), train_began_at=began)


@on(f.LoanStarted)
def _(s: ClusterState, e: f.LoanStarted) -> ClusterState:
    s = _start_sequence(s, e, home=e.plan.from_pool)
    checks = s.loan_checks
    if e.check_step >= 0:
        checks = checks + (LoanCheck(e.plan.resize_id, e.plan.to_pool, e.check_step, e.at, e.ends_in_s,
                                     e.stage_elapsed_s, e.saves_s),)
    return replace(s, dry=undry(s, e.plan.devices), loans_started=s.loans_started + 1, loan_checks=checks)


@on(f.LoanChecked)
def _(s: ClusterState, e: f.LoanChecked) -> ClusterState:
    return replace(s, loan_checks=tuple(c for c in s.loan_checks if c.resize_id != e.resize_id),
                   loan_accuracy=s.loan_accuracy.add(e.error_s, e.measured_s))


@on(f.LoanLanded)
def _(s: ClusterState, e: f.LoanLanded) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = place(s, plan.devices, placed(plan.to_pool, home=plan.from_pool))
    times = _kept(s.loan_times + (LoanTime(plan.to_pool, e.duration_s),), plan.to_pool)
    return replace(s, inflight=None, phase=Phase.STEADY, loans_landed=s.loans_landed + 1, loan_times=times)


@on(f.LoanReturnStarted)
def _(s: ClusterState, e: f.LoanReturnStarted) -> ClusterState:
    return _start_sequence(s, e, home=e.plan.to_pool)


@on(f.LoanReturned)
def _(s: ClusterState, e: f.LoanReturned) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = place(s, plan.devices, placed(plan.to_pool))
    # the loan that went home is the latest one out of this direction (the pool it served)
    times = list(s.loan_times)
    for i in range(len(times) - 1, -1, -1):
        if times[i].to_pool is plan.from_pool and times[i].returned_s < 0:
            times[i] = replace(times[i], returned_s=e.duration_s)
            break
    return replace(s, inflight=None, phase=Phase.STEADY, loan_times=tuple(times))


def _start_sequence(s: ClusterState, e: f.LoanStarted | f.LoanReturnStarted, home: Pool) -> ClusterState:
    plan = e.plan
    s = place(s, plan.devices, moving(plan.from_pool, plan.to_pool, home=home))
    inflight = InFlight(plan=plan, source=e.source if isinstance(e, f.LoanStarted) else "loan",
                        reason=e.reason, started_at=e.at, ops=plan.ops, index=0, op_started_at=e.at,
                        op_deadline=e.op_deadline, step=s.last_step)
    if isinstance(e, f.LoanReturnStarted):
        inflight = replace(inflight, then=e.then, then_source=e.then_source, then_reason=e.then_reason,
                           then_predicted_step_s=e.then_predicted_step_s,
                           then_predicted_step_s_after=e.then_predicted_step_s_after)
    return replace(s, inflight=inflight, phase=PHASE_OF_OP[plan.ops[0].kind])


def _kept(times: tuple[LoanTime, ...], pool: Pool) -> tuple[LoanTime, ...]:
    """The last LOAN_TIMES_KEPT loans to `pool`, and every loan the other way."""
    mine = [i for i, t in enumerate(times) if t.to_pool is pool]
    drop = set(mine[:-LOAN_TIMES_KEPT])
    return tuple(t for i, t in enumerate(times) if i not in drop)
