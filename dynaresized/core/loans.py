"""Loans: what the lending policy sees, whether idle devices serve the other stage for the rest
of a step, and their way home at its boundary. Emits MiniBatchObserved, LoanStarted, LoanLanded,
LoanReturnStarted, LoanReturned (and ProposalRejected for a loan refused)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import costmodel, guards
from dynaresized.core.policy import EngineTail, LoanCosts, LoanProposal, LoanView, Proposal, TailProposal
from dynaresized.core.resizes import advance, plan_resize, start_resize, unique
from dynaresized.core.state import ClusterState, InFlight, Phase, Progress, progressed
from dynaresized.core.tx import CoreLike, Refused, Tx, reject, require_worker
from dynaresized.domain import DeviceId, OpKind, OpSpec, PlanKind, Pool, ResizePlan, Split, WorkerKind

_P = TypeVar("_P", LoanProposal, TailProposal)


def loan_view(core: CoreLike, state: ClusterState, now: float) -> LoanView:
    """What the lending policy sees: idle engines of the rollout step in progress, trainers
    whose part of the step is done (after its last mini-batch, or with nothing to train yet),
    and the trainer's measured mini-batch pace."""
    mb = state.mini_batch
    done = mb is not None and mb.done >= mb.total
    rollout_step = rollout_in_progress(state)
    idle, trainers = state.lendable()
    # no rollout step left to serve (the run's last training step): no trainer is free to lend
    last = core.config.steps_total is not None and rollout_step >= core.config.steps_total
    free = trainers if done and not last else ()
    samples_done, samples_total = state.samples(rollout_step)
    view = LoanView(
        now=now,
        split=state.split,
        idle_engines=idle,
        free_trainers=free,
        training_devices=len(state.pool_devices(Pool.TRAINING)),
        mini_batch_done=mb.done if mb is not None else 0,
        mini_batch_total=mb.total if mb is not None else 0,
        mini_batch_s=mb.last_s if mb is not None else 0.0,
        mini_batch_at=mb.at if mb is not None else -1.0,
        queue_empty=state.dry_step >= rollout_step,
        costs=loan_costs(core, state, Pool.TRAINING),
        rollout_costs=loan_costs(core, state, Pool.ROLLOUT),
        recent=state.recent,
        rollout_step=rollout_step,
        samples_done=samples_done,
        samples_total=samples_total,
        step_started_at=step_started_at(state),
        tail_binds=costmodel.tail_binds(core.config.pipeline),
    )
    if core.config.tail_costs is None:
        return view  # the daemon: no tail regroups, and no scan of every device for lent ones per report
    return msgspec.structs.replace(
        view,
        tails=tuple(EngineTail(devices=state.engine_of(d), running=n, tokens_left=left, at=t)
                    for d, n, left, t in state.tails if state.dry_step == rollout_step),
        tail_costs=core.config.tail_costs,
        lent_to_rollout=tuple(d for d in state.lent_devices() if state.devices[d].pool is Pool.ROLLOUT),
        tail_open=tail_open(state),
    )


def rollout_in_progress(state: ClusterState) -> int:
    """The rollout step in progress, the one the loan view's engines and samples are of.
    One-step off-policy: while the trainer trains step s the rollout generates s + 1; with
    nothing to train (0 of 0) it waits for the rollout of step s itself."""
    mb = state.mini_batch
    if mb is None:
        return state.last_step + 2
    return mb.step if mb.total == 0 else mb.step + 1


def step_started_at(state: ClusterState) -> float:
    """When the rollout in progress began (-1: unknown). The last step report, unless the
    training step that took the last batch began before it: a job that reports its step when
    the training ends (verl's fully async trainer) had the rollout of the next batch running
    since the training began. The first window has no step report: it began when the trainer
    said it had nothing to train."""
    last, began, mb = state.last_step_at, state.train_began_at, state.mini_batch
    if last >= 0:
        return began if 0 <= began < last and mb is not None and mb.total > 0 else last
    return mb.at if mb is not None and mb.total == 0 else -1.0


def loan_costs(core: CoreLike, state: ClusterState, to_pool: Pool) -> LoanCosts:
    """Configured, or learned from the last loans to `to_pool` (`CoreConfig.learn_loan_costs`)."""
    if not core.config.learn_loan_costs:
        return core.config.loan_costs
    return core.config.loan_costs.learned(state.loan_times, to_pool)


def free_to_plan(s: ClusterState) -> bool:
    """Steady, nothing in flight, neither paused nor stopping: a loan or a tail regroup may start."""
    return s.phase is Phase.STEADY and s.inflight is None and not s.paused and not s.stopping


def tail_open(s: ClusterState) -> bool:
    """A tail regroup's engine has not become the engines it was made of again."""
    return bool(s.tail_undo) and not all(s.engine_of(g[0]) == g for g in s.tail_undo)


def proposed(core: CoreLike, tx: Tx, at: float, propose: Callable[[LoanView], _P | None] | None,
             check: Callable[[LoanView, _P, guards.GuardConfig], guards.Rejection | None],
             kind: PlanKind, quiet: bool = False) -> _P | None:
    """What the lending policy's `propose` (its `propose_loan` or `propose_tail`; None: it has
    none) proposes on what it sees now, where a loan or tail regroup may start and the proposal
    passes its guard `check`; None otherwise (a proposal the guard refuses is recorded so,
    unless `quiet`)."""
    if propose is None or not free_to_plan(tx.state):
        return None
    view = loan_view(core, tx.state, at)
    proposal = propose(view)
    if proposal is None:
        return None
    rejection = check(view, proposal, core.config.guards)
    if rejection is not None:
        if not quiet:
            reject(tx, at, core.policy.name, None, rejection.guard, rejection.reason, kind)
        return None
    return proposal


def consider_loan(core: CoreLike, tx: Tx, at: float, quiet: bool = False) -> None:
    """Ask the lending policy whether to lend idle devices to the other stage for the rest of the
    step (`propose_loan`), and start the loan when its guard lets it (`quiet`: a refusal is not
    recorded; the same question was asked, and its refusal recorded, before)."""
    proposal = proposed(core, tx, at, getattr(core.policy, "propose_loan", None), guards.check_loan, PlanKind.LOAN,
                        quiet)
    if proposal is None:
        return
    plan = plan_loan(tx.state, proposal.devices, Pool(proposal.to_pool), PlanKind.LOAN)
    if isinstance(plan, str):
        if not quiet:
            reject(tx, at, core.policy.name, None, "capacity", plan, PlanKind.LOAN)
        return
    tx.emit(f.LoanStarted(at=at, plan=plan, source=core.policy.name, reason=proposal.reason,
                          op_deadline=at + core.config.op_timeout_s, saves_s=proposal.saves_s,
                          cost_s=proposal.cost_s, **_prediction(tx.state, at, proposal)))
    advance(core, tx, at, fresh=True)


def _prediction(state: ClusterState, at: float, proposal: LoanProposal) -> dict[str, float | int]:
    """What `LoanStarted` records of the policy's prediction, for `check_loans`: the step whose
    lent-to stage it is of, and (to the rollout) how long that rollout had run; nothing where the
    policy predicted nothing or the step's start is unknown."""
    if proposal.ends_in_s < 0:
        return {}
    if Pool(proposal.to_pool) is Pool.ROLLOUT:
        started = step_started_at(state)
        if started < 0:
            return {}
        return {"check_step": rollout_in_progress(state), "ends_in_s": proposal.ends_in_s,
                "stage_elapsed_s": max(at - started, 0.0)}
    mb = state.mini_batch
    if mb is None or mb.total == 0:
        return {}
    return {"check_step": mb.step, "ends_in_s": proposal.ends_in_s}


def check_loans(tx: Tx, at: float, step: int, to_pool: Pool, stage_s: float = 0.0) -> None:
    """The stage `to_pool` finished step `step`: each loan to it in that step measured against its
    prediction (`LoanChecked`). To training, at the step's last mini-batch (`at`); to the rollout,
    at the step report, whose `rollout_s` is `stage_s`."""
    for c in tx.state.loan_checks:
        if c.step != step or c.to_pool is not to_pool:
            continue
        measured = at - c.at if to_pool is Pool.TRAINING else max(stage_s - c.stage_elapsed_s, 0.0)
        tx.emit(f.LoanChecked(at=at, resize_id=c.resize_id, to_pool=to_pool, step=step, predicted_s=c.ends_in_s,
                              measured_s=measured, error_s=measured - c.ends_in_s, saves_s=c.saves_s))


def plan_loan(state: ClusterState, devices: tuple[DeviceId, ...], to_pool: Pool, kind: PlanKind) -> ResizePlan | str:
    """Drain, release and join `devices` into `to_pool`: a loan, or (kind RETURN) its way home.
    No commit: a loan lasts until the step boundary, where its return is the next sequence."""
    from_pool = to_pool.other
    devices = tuple(sorted(devices))
    live = state.live_workers_by_device()
    src = unique(live.get((d, WorkerKind.for_pool(from_pool))) for d in devices)
    dst = unique(live.get((d, WorkerKind.for_pool(to_pool))) for d in devices)
    # One worker may serve several of the devices (verl's rollout worker holds every hybrid slot).
    if kind is PlanKind.LOAN and any((d, WorkerKind.for_pool(to_pool)) not in live for d in devices):
        return f"not every device of {', '.join(devices)} has a live {WorkerKind.for_pool(to_pool).value} worker"
    named = set(devices)
    if kind is PlanKind.LOAN and (part := [d for d in devices if not named.issuperset(state.engine_of(d))]):
        return (f"device(s) {', '.join(part)} serve in engines of several devices whose other devices are not "
                "lent with them: a loan takes whole engines")
    resize_id = f"l{state.loans_started + 1}" if kind is PlanKind.LOAN else f"l{state.loans_started}-home{state.version}"
    targets = {OpKind.DRAIN: src, OpKind.RELEASE: src, OpKind.JOIN: dst}
    ops = tuple(
        OpSpec(op_id=f"{resize_id}/{i}-{k.value}", kind=k, devices=devices, targets=ts,
               from_pool=from_pool, to_pool=to_pool)
        for i, (k, ts) in enumerate(targets.items())
    )
    split = state.split
    return ResizePlan(resize_id=resize_id, devices=devices, from_pool=from_pool, to_pool=to_pool, ops=ops,
                      before=split, after=split, kind=kind)


def on_mini_batch_done(core: CoreLike, tx: Tx, e: ev.MiniBatchDone) -> None:
    w = require_worker(tx.state, e.worker_id)
    if w.kind is not WorkerKind.TRAINER_RANK:
        raise Refused("bad_request", f"worker {e.worker_id!r} is a {w.kind.value}; only trainers report mini-batches")
    if e.step < 0 or not (0 <= e.done <= e.total):
        raise Refused("bad_value", f"mini-batch {e.done} of {e.total} in step {e.step} is impossible")
    mb = tx.state.mini_batch
    if mb is None or (mb.step, mb.done, mb.total) != (e.step, e.done, e.total):
        # A repeat of the last mini-batch would only restart its pace: no fact
        tx.emit(f.MiniBatchObserved(at=e.at, worker_id=e.worker_id, step=e.step, done=e.done, total=e.total))
        if e.done == e.total:
            check_loans(tx, e.at, e.step, Pool.TRAINING)
    s = tx.state
    lent_out = [d for d in s.lent_devices() if s.devices[d].pool is Pool.ROLLOUT]
    if e.done < e.total and lent_out and s.phase is Phase.STEADY and s.inflight is None and not tail_open(s):
        # The training step begins while its trainers serve the rollout (lent in the window
        # with nothing to train, which ends without a step report): they go home first.
        return_loans(core, tx, e.at, None, "", why=f"training step {e.step} begins")
        return
    consider_loan(core, tx, e.at)


def on_progress(core: CoreLike, tx: Tx, e: ev.ProgressReported) -> None:
    require_worker(tx.state, e.worker_id)
    if not (0 <= e.done <= e.total) or e.tokens < 0 or e.step < 0:
        raise Refused("bad_value", f"progress done={e.done} total={e.total} tokens={e.tokens} is impossible")
    before = tx.state
    tx.state = progressed(tx.state, e.worker_id, Progress(e.step, e.done, e.total, e.tokens))  # soft: no fact
    done, total = tx.state.samples(e.step)
    if (total and done >= total and e.step > tx.state.last_step and e.step == rollout_in_progress(tx.state)
            and (began := step_started_at(tx.state)) >= 0
            and (tx.state.rollout_done is None or tx.state.rollout_done[0] < e.step)):
        # the rollout step in progress is done: what a policy that decides from it reads at the
        # next boundary (`ObservedView.rollout_done_s`)
        tx.state = msgspec.structs.replace(tx.state, rollout_done=(e.step, e.at - began))
    # A lending policy that sends its loans home on the rollout's progress (verl's rules go home
    # once enough samples are done) is asked after every report.
    s = tx.state
    ask = getattr(core.policy, "observe_progress", None)
    if ask is not None and free_to_plan(s):
        why = ask(loan_view(core, s, e.at))
        if why and s.lent_devices():
            return_loans(core, tx, e.at, None, "", why=why)
            return
    if getattr(core.policy, "lends_from_progress", False) and paced(before, s):
        # A policy that prices a trainer loan with the step's own pace (`lends_from_progress`)
        # is asked again while the trainers wait and requests are queued: the first rollout-heavy
        # step shows itself here, before its step report.
        consider_loan(core, tx, e.at, quiet=True)


PACE_POINTS = 64
"""While trainers wait, a trainer loan is asked again at the step's first sample done and at
every 1/64 of its samples after: the pace is known by then, and a thousand engines' reports a
second ask at most 65 times a step (each ask builds the loan view and a proposal: ~0.16 ms at
512 + 512 devices, `benchmarks/loan_ask.py`)."""


def paced(before: ClusterState, s: ClusterState) -> bool:
    """The training step is done (or there is nothing to train yet), the rollout step its
    trainers wait for still has queued requests, a loan may start, and the step's samples done
    went from none to some or crossed a 1/`PACE_POINTS` mark since `before`."""
    mb = s.mini_batch
    if mb is None or mb.done < mb.total or not free_to_plan(s):
        return False
    step = rollout_in_progress(s)
    if s.dry_step >= step:
        return False
    (was, _), (done, total) = before.samples(step), s.samples(step)
    if done <= was or total <= 0:
        return False
    return was == 0 or was * PACE_POINTS // total != done * PACE_POINTS // total


def return_loans(core: CoreLike, tx: Tx, at: float, proposal: Proposal | None, source: str, why: str = "",
                 hysteresis: bool | None = None) -> None:
    """Step boundary: every lent device goes home. A resize the policy proposes at the same
    boundary is checked by the guards now (the hysteresis guards where the policy is guarded,
    or as `hysteresis` says) and starts once the devices are home."""
    s = tx.state
    then: Split | None = None
    if proposal is not None:
        view = core.view(s, at)
        guarded = core.policy.guarded if hysteresis is None else hysteresis
        rejection = guards.evaluate(view, proposal, core.config.guards, s.history, hysteresis=guarded)
        if rejection is not None:
            reject(tx, at, source, proposal.target, rejection.guard, rejection.reason)
        else:
            then = proposal.target
    lent = s.lent_devices()
    # One sequence per direction; the rare boundary with loans both ways returns rollout first.
    by_pool = {p: tuple(d for d in lent if s.devices[d].pool is p) for p in (Pool.TRAINING, Pool.ROLLOUT)}
    pool = Pool.TRAINING if by_pool[Pool.TRAINING] else Pool.ROLLOUT
    plan = plan_loan(s, by_pool[pool], pool.other, PlanKind.RETURN)
    assert not isinstance(plan, str)
    reason = f"{why or f'step {s.last_step} done'}: {len(plan.devices)} lent device(s) go home to {pool.other.value}"
    tx.emit(f.LoanReturnStarted(at=at, plan=plan, reason=reason, op_deadline=at + core.config.op_timeout_s,
                                then=then, then_source=source if then is not None else "",
                                then_reason=proposal.reason if then is not None and proposal else "",
                                then_predicted_step_s=proposal.predicted_step_s if then is not None and proposal else 0.0,
                                then_predicted_step_s_after=(proposal.predicted_step_s_after
                                                             if then is not None and proposal else 0.0)))
    advance(core, tx, at, fresh=True)


def landed(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> bool:
    """The end of a loan: the lent devices serve the other pool until the step boundary. True
    when they go home at once, because a step was reported while the loan ran (`machine.ENDINGS`
    otherwise lets trainers lent to the rollout join a tail)."""
    tx.emit(f.LoanLanded(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at))
    s = tx.state
    if s.last_step > fl.step and not s.paused and not s.stopping:
        # A step was reported while the loan ran (a trainer lent to the rollout's last
        # requests): that boundary's work, the policy's say and the way home, is done now.
        return_loans(core, tx, at, core.policy(core.view(s, at)), core.policy.name)
        return True
    return False


def returned(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> None:
    """The end of a loan's way home: loans the other way round go home next; then the resize the
    policy asked for at the boundary (`LoanReturnStarted.then`) starts, if it still can."""
    tx.emit(f.LoanReturned(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at))
    s = tx.state
    if s.lent_devices():  # loans the other way round go home next
        return_loans(core, tx, at, None, "")
        return
    if fl.then is None or s.paused or s.stopping or s.split == fl.then:
        return
    plan = plan_resize(s, fl.then)
    if isinstance(plan, str):
        reject(tx, at, fl.then_source, fl.then, "capacity", plan)
        return
    proposal = Proposal(target=fl.then, reason=fl.then_reason, predicted_step_s=fl.then_predicted_step_s,
                        predicted_step_s_after=fl.then_predicted_step_s_after)
    start_resize(core, tx, core.view(s, at), plan, proposal, fl.then_source, at)
