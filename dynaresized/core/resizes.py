"""Resizes: plan and start a move between the pools, run any operation sequence (send, advance,
fail, abort, roll back), judge a committed resize. Emits ResizeStarted, OpAcked, OpCompleted,
OpFailed, ResizeAborted, ResizeCommitted, ResizeRolledBack, Degraded, PredictionChecked, ResizeJudged."""

from __future__ import annotations

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import costmodel, guards
from dynaresized.core.idle import step_period_s
from dynaresized.core.policy import ObservedView, Proposal
from dynaresized.core.state import ClusterState, InFlight, Outcome, Phase, derived, grown
from dynaresized.core.tx import CoreLike, Refused, SendOp, Tx, reject, require_worker
from dynaresized.domain import UNDO, DeviceId, OpKind, OpSpec, PlanKind, Pool, ResizePlan, Split, WorkerKind


# -- requests and answers --------------------------------------------------------------


def on_resize_requested_steady(core: CoreLike, tx: Tx, e: ev.ResizeRequested) -> None:
    if tx.state.stopping:
        reject(tx, e.at, e.requested_by, e.target, "stopping", "the daemon is shutting down")
        return
    view = core.view(tx.state, e.at)
    current = view.split
    proposal = Proposal(target=e.target, reason=e.reason or "requested by operator", predicted_step_s=0.0,
                        predicted_step_s_after=0.0)
    if current == e.target:
        reject(tx, e.at, e.requested_by, e.target, "candidates", f"the split is already {current}")
        return
    decide(core, tx, view, proposal, e.requested_by, hysteresis=False, at=e.at)


def on_resize_requested_busy(core: CoreLike, tx: Tx, e: ev.ResizeRequested | ev.RegroupRequested) -> None:
    s = tx.state
    target = e.target if isinstance(e, ev.ResizeRequested) else None
    kind = PlanKind.RESIZE if isinstance(e, ev.ResizeRequested) else PlanKind.REGROUP
    if s.phase is Phase.DEGRADED:
        why = f"resizing is suspended ({s.degraded_reason}); run `dynaresized resume` first"
        reject(tx, e.at, e.requested_by, target, "degraded", why, kind)
        return
    fl = s.inflight
    assert fl is not None
    what = f"reconcile {fl.plan.resize_id} of {fl.reconciling}" if fl.reconciling else f"resize {fl.plan.resize_id}"
    reject(tx, e.at, e.requested_by, target, "in_flight",
           f"{what} is in flight (phase {s.phase.value}); one operation sequence at a time", kind)


def on_op_reported(core: CoreLike, tx: Tx, e: ev.OpReported) -> None:
    require_worker(tx.state, e.worker_id)
    fl = tx.state.inflight
    assert fl is not None
    if e.op_id != fl.op.op_id:  # e.g. a late answer to a re-sent op that has completed
        raise Refused("stale_op", f"operation {e.op_id} is not in flight (current: {fl.op.op_id})")
    if e.worker_id not in target_set(fl):
        raise Refused("not_a_target", f"operation {e.op_id} was not sent to {e.worker_id!r}")
    if e.worker_id in acked_set(fl):
        return  # a duplicate answer: the first one counted
    if e.ok:
        tx.emit(f.OpAcked(at=e.at, op_id=e.op_id, worker_id=e.worker_id, detail=e.detail, actual=e.actual))
        advance(core, tx, e.at)
        return
    if e.actual is not None and e.actual != tx.state.workers[e.worker_id].actual:
        tx.emit(f.WorkerReported(at=e.at, worker_id=e.worker_id, actual=e.actual))
    reason = f"{fl.op.kind.value} failed on {e.worker_id}: {e.detail or 'no detail'}"
    tx.emit(f.OpFailed(at=e.at, op_id=e.op_id, worker_id=e.worker_id, reason=reason))
    op_failed(core, tx, reason, e.at)


def on_abort_requested(core: CoreLike, tx: Tx, e: ev.AbortRequested) -> None:
    fl = tx.state.inflight
    if fl is None or fl.rolling_back or (fl.index < len(fl.ops) and fl.op.kind is OpKind.COMMIT):
        return  # nothing to abort, or past the point of no return
    reason = f"aborted by {e.requested_by}: {e.reason or 'no reason given'}"
    if fl.reconciling:  # nothing to undo: the worker is converged again when it next reports
        tx.emit(f.ReconcileFinished(at=e.at, resize_id=fl.plan.resize_id, worker_id=fl.reconciling, ok=False,
                                    reason=reason))
        return
    tx.emit(f.OpFailed(at=e.at, op_id=fl.op.op_id, worker_id=None, reason=reason))
    _abort(core, tx, reason, e.at)


# -- deciding and planning -------------------------------------------------------------


def decide(core: CoreLike, tx: Tx, view: ObservedView, proposal: Proposal, source: str, *,
           hysteresis: bool, at: float) -> None:
    """Start the resize `proposal` asks for if the guards let it and a plan can be made now;
    else record why not."""
    rejection = guards.evaluate(view, proposal, core.config.guards, tx.state.history, hysteresis=hysteresis)
    if rejection is not None:
        reject(tx, at, source, proposal.target, rejection.guard, rejection.reason)
        return
    plan_or_reason = plan_resize(tx.state, proposal.target)
    if isinstance(plan_or_reason, str):
        reject(tx, at, source, proposal.target, "capacity", plan_or_reason)
        return
    start_resize(core, tx, view, plan_or_reason, proposal, source, at)


def start_resize(core: CoreLike, tx: Tx, view: ObservedView, plan: ResizePlan, proposal: Proposal, source: str,
                 at: float) -> None:
    """Record a resize that passed its guards, with what its outcome will be measured against."""
    if tx.state.outcome is not None:
        _judge(core, tx, at)  # the next resize starts before the window ended: judge what was seen
    predicted = proposal.predicted_step_s_after > 0  # an operator's resize predicts nothing
    measured = [(p, t.response_tokens) for t in view.recent if (p := step_period_s(t)) is not None]
    periods = [p for p, _ in measured]
    per_token = None
    if measured and all(tokens > 0 for _, tokens in measured):
        per_token = sum(periods) / sum(tokens for _, tokens in measured)
    tx.emit(f.ResizeStarted(
        at=at, plan=plan, source=source, reason=proposal.reason,
        op_deadline=at + core.config.op_timeout_s,
        predicted_step_s=proposal.predicted_step_s if predicted else None,
        predicted_step_s_after=proposal.predicted_step_s_after if predicted else None,
        measured_step_s=sum(periods) / len(periods) if periods else None,
        predicted_cost_s=guards.resize_cost_s(view, proposal.target),
        payback_steps=max(guards.payback_horizon(view, core.config.guards), 1),
        measured_s_per_token=per_token))
    advance(core, tx, at, fresh=True)


def plan_resize(state: ClusterState, target: Split) -> ResizePlan | str:
    """The ordered operations that take `state` to `target`, or why that is impossible now."""
    before = state.split
    delta = target.train - before.train
    from_pool, to_pool = (Pool.ROLLOUT, Pool.TRAINING) if delta > 0 else (Pool.TRAINING, Pool.ROLLOUT)
    count = abs(delta)
    src_kind, dst_kind = WorkerKind.for_pool(from_pool), WorkerKind.for_pool(to_pool)
    # Highest device ids first: deterministic, and keeps low ids (often the launch ranks) stable.
    # A device lent to `from_pool` is not its own (its home is the other pool, where the split
    # counts it): it goes home at the step boundary and is left out, as held-back ones are.
    held_back = state.held_back()
    lent = set(state.lent_devices())
    live = state.live_workers_by_device()
    usable = {d for d in state.pool_devices(from_pool)
              if (d, dst_kind) in live and d not in held_back and d not in lent}
    eligible, skipped = _whole_engines(state, usable, count)
    if len(eligible) < count:
        notes = [f"{len(held_back)} left out: a worker on them has not converged"] if held_back else []
        if wide := [d for d in skipped if d in state.engines]:
            notes.append(f"{len(wide)} serve in engines of several devices, which move whole: regroup them "
                         "first or move a multiple of their size")
        if lent_here := [d for d in lent if state.devices[d].pool is from_pool]:
            notes.append(f"{len(lent_here)} lent until the step boundary")
        note = f" ({'; '.join(notes)})" if notes else ""
        return (f"only {len(eligible)} device(s) in the {from_pool.value} pool have a live "
                f"{dst_kind.value} worker to take them over{note}; {count} needed for {before} -> {target}")
    devices = tuple(sorted(eligible))
    src = unique(live.get((d, src_kind)) for d in devices)
    dst = unique(live.get((d, dst_kind)) for d in devices)
    moved = set(devices)
    after_pool = {d: (to_pool if d in moved else p.pool) for d, p in state.devices.items()}
    committers = unique(
        live.get((d, WorkerKind.for_pool(pool))) for d, pool in sorted(after_pool.items()) if pool is not None
    )
    resize_id = f"r{state.resizes_started + 1}"
    targets = {OpKind.DRAIN: src, OpKind.RELEASE: src, OpKind.JOIN: dst, OpKind.RESTORE: dst,
               OpKind.COMMIT: committers}
    ops = tuple(
        OpSpec(op_id=f"{resize_id}/{i}-{kind.value}", kind=kind, devices=devices, targets=ts,
               from_pool=from_pool, to_pool=to_pool)
        for i, (kind, ts) in enumerate(targets.items())
    )
    return ResizePlan(resize_id=resize_id, devices=devices, from_pool=from_pool, to_pool=to_pool, ops=ops,
                      before=before, after=target)


def _whole_engines(state: ClusterState, usable: set[DeviceId], count: int) -> tuple[list[DeviceId], list[DeviceId]]:
    """`count` of `usable` devices to move, highest ids first, an engine of several devices
    whole or not at all (fewer when no choice adds up); and the wide engines' devices left out."""
    units: list[tuple[DeviceId, ...]] = []
    seen: set[DeviceId] = set()
    left: list[DeviceId] = []
    for d in sorted(usable, reverse=True):
        if d not in seen:
            unit = state.engine_of(d)
            seen.update(unit)
            if all(x in usable for x in unit):
                units.append(unit)
            else:
                left.extend(unit)  # a wide engine one of whose devices cannot move now
    if all(len(u) == 1 for u in units):  # no wide engine to fit: the highest `count`
        return [u[0] for u in units[:count]], left
    # reach[i]: the device counts units[i:] can add up to (bit n set: n is reachable)
    mask = (1 << (count + 1)) - 1
    reach = [1] * (len(units) + 1)
    for i in range(len(units) - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << len(units[i]))) & mask
    if not (reach[0] >> count) & 1:
        count = max(n for n in range(count + 1) if (reach[0] >> n) & 1)
    taken: list[DeviceId] = []
    for i, unit in enumerate(units):
        rest = count - len(taken) - len(unit)
        if rest >= 0 and (reach[i + 1] >> rest) & 1:
            taken.extend(unit)
        elif len(unit) > 1:
            left.extend(unit)
    return taken, left


def unique(workers: object) -> tuple[str, ...]:
    """The ids of `workers` (skipping None), each once, in the order first seen."""
    seen: dict[str, None] = {}
    for w in workers:  # type: ignore[attr-defined]
        if w is not None:
            seen[w.worker_id] = None
    return tuple(seen)


# -- executing an operation sequence ---------------------------------------------------


def target_set(fl: InFlight) -> frozenset[str]:
    """The current op's targets as a set (an answer scanned the tuple: quadratic in the targets)."""
    return derived("targets", lambda: frozenset(fl.op.targets), fl.op.targets)


def acked_set(fl: InFlight) -> set[str]:
    """`fl.acked` as a set, for membership: the answers of an op to T targets arrive one at a
    time, each making a tuple one longer, so the set is extended (`state.grown`) instead of
    built again per answer. Read it, never change it."""
    return grown("acked", fl.acked, set, _added)


def _added(members: set[str], more: tuple[str, ...]) -> set[str]:
    members.update(more)
    return members


def pending(state: ClusterState) -> list[str]:
    """The live targets of the current op that have not answered it."""
    fl = state.inflight
    assert fl is not None
    acked = acked_set(fl)
    return [w for w in fl.op.targets if w not in acked and state.is_live(w)]


def _owed(state: ClusterState) -> bool:
    """Whether any live target of the current op has not answered: what `advance` asks after
    every answer. It stops at the first one found, looking from the last target (answers come
    mostly in the order ops were sent), so the answers of an op to T targets cost about T
    liveness checks in all, where listing the pending ones after each cost T^2 / 2."""
    fl = state.inflight
    assert fl is not None
    acked = acked_set(fl)
    return any(w not in acked and state.is_live(w) for w in reversed(fl.op.targets))


def _current_op_id(state: ClusterState) -> str | None:
    fl = state.inflight
    if fl is None or fl.index >= len(fl.ops):
        return None
    return fl.op.op_id


def advance(core: CoreLike, tx: Tx, at: float, *, fresh: bool = False) -> None:
    """Complete every operation with nobody left to answer; end the sequence after the last
    (`machine.ENDINGS`). Whenever a new operation begins (or `fresh`: the current one just
    began), send it."""
    entry = _current_op_id(tx.state)
    while tx.state.inflight is not None:
        fl = tx.state.inflight
        if fl.index < len(fl.ops):
            if _owed(tx.state):
                break
            last = fl.index + 1 >= len(fl.ops)
            tx.emit(f.OpCompleted(at=at, op_id=fl.op.op_id, duration_s=at - fl.op_started_at,
                                  next_deadline=None if last else at + core.config.op_timeout_s))
            continue
        core.end_sequence(tx, at)  # its end fact, and what follows it in its family
        return
    current = _current_op_id(tx.state)
    if current is not None and (fresh or current != entry):
        send(tx, None)


def committed(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> None:
    """The end of a resize: every op, its commit included, was acknowledged (`machine.ENDINGS`)."""
    tx.emit(f.ResizeCommitted(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at,
                              step=tx.state.last_step))


def rolled_back(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> None:
    """The end of an aborted sequence of any kind: every undo op was acknowledged."""
    tx.emit(f.ResizeRolledBack(at=at, resize_id=fl.plan.resize_id, reason=fl.abort_reason,
                               step=tx.state.last_step))


def _pools_after(s: ClusterState, plan: ResizePlan, landing: Pool | None) -> tuple[tuple[DeviceId, ...],
                                                                                   tuple[DeviceId, ...]]:
    """The training and rollout devices an op's workers are told of: the moving devices where
    they land. Remembered per op (`derived`): a hello of each of a resize's targets re-sends it,
    and a pass over every device per hello made a registration storm quadratic."""
    moving = set(plan.devices) if landing is Pool.TRAINING else set()
    training = tuple(sorted(d for d, p in s.devices.items() if p.pool is Pool.TRAINING or d in moving))
    in_training = set(training)  # membership in the tuple made this quadratic in the cluster
    return training, tuple(sorted(d for d in s.devices if d not in in_training))


def send(tx: Tx, only: list[str] | None) -> None:
    """Send the current op to `only`, or (None) to every live target that has not answered."""
    s = tx.state
    fl = s.inflight
    if fl is None or fl.index >= len(fl.ops):
        return
    plan = fl.plan
    # Where the moving devices land: their destination, or back home once rolling back; a
    # reconcile moves nothing.
    landing = None if fl.reconciling else plan.from_pool if fl.rolling_back else plan.to_pool
    training, rollout = derived(("send_pools", landing is Pool.TRAINING), lambda: _pools_after(s, plan, landing),
                                s.devices, plan.devices)
    # A regroup's engines once it is done going forward; the engines the log holds otherwise.
    new_engines = ({d: g for g in plan.engines for d in g}
                   if plan.kind is PlanKind.REGROUP and not fl.rolling_back and not fl.reconciling else {})
    for w in only if only is not None else pending(s):
        worker = s.workers.get(w)
        engine: tuple[DeviceId, ...] = ()
        if worker is not None and worker.kind is WorkerKind.ROLLOUT_ENGINE and len(worker.devices) == 1:
            d = worker.devices[0]
            group = new_engines.get(d) or s.engine_of(d)
            engine = group if len(group) > 1 else ()
        tx.commands.append(SendOp(worker_id=w, resize_id=plan.resize_id, op=fl.op, deadline=fl.op_deadline,
                                  training=training, rollout=rollout,
                                  plan=PlanKind.RECONCILE if fl.reconciling else plan.kind, engine=engine))


def op_failed(core: CoreLike, tx: Tx, reason: str, at: float) -> None:
    """After the current op failed: a reconcile ends, a rollback or a commit ends degraded, and
    anything else is aborted."""
    fl = tx.state.inflight
    assert fl is not None
    plan = fl.plan
    if fl.reconciling:
        tx.emit(f.ReconcileFinished(at=at, resize_id=plan.resize_id, worker_id=fl.reconciling, ok=False,
                                    reason=reason))
        tx.emit(f.WorkerUnconverged(at=at, worker_id=fl.reconciling, reason=reason))
        return
    if fl.rolling_back:
        tx.emit(f.Degraded(at=at, resize_id=plan.resize_id, reason=f"rollback failed: {reason}",
                           placed_in=plan.from_pool, step=tx.state.last_step))
    elif fl.op.kind is OpKind.COMMIT:
        tx.emit(f.Degraded(at=at, resize_id=plan.resize_id, reason=f"commit failed: {reason}",
                           placed_in=plan.to_pool, step=tx.state.last_step))
    else:
        _abort(core, tx, reason, at)


def _abort(core: CoreLike, tx: Tx, reason: str, at: float) -> None:
    fl = tx.state.inflight
    assert fl is not None and not fl.rolling_back
    rid = fl.plan.resize_id
    touched = fl.ops[: fl.index + 1]
    undo = tuple(
        OpSpec(op_id=f"{rid}/undo{i}-{UNDO[op.kind].value}", kind=UNDO[op.kind], devices=op.devices,
               targets=tuple(w for w in op.targets if tx.state.is_live(w)),
               from_pool=op.from_pool, to_pool=op.to_pool)
        for i, op in enumerate(op for op in reversed(touched) if op.kind in UNDO)
    )
    tx.emit(f.ResizeAborted(at=at, resize_id=rid, reason=reason, undo=undo,
                            op_deadline=at + core.config.op_timeout_s if undo else None))
    advance(core, tx, at, fresh=True)


def after_worker_gone(core: CoreLike, tx: Tx, worker_id: str, how: str, at: float) -> None:
    """After `worker_id` was lost or left (`how`): the sequence in flight goes on without it, is
    aborted when the worker still had an op of it to do, or ends when it reconciled that worker."""
    fl = tx.state.inflight
    if fl is None:
        return
    if fl.reconciling == worker_id:  # it is reconciled again when it comes back and says hello
        tx.emit(f.ReconcileFinished(at=at, resize_id=fl.plan.resize_id, worker_id=worker_id, ok=False,
                                    reason=f"worker {worker_id} {how}"))
        return
    # Only the moving devices' workers carry a resize; one that has nothing left to do but
    # acknowledge the commit is simply not waited for (`pending` skips workers no longer live).
    involved = any(worker_id in op.targets for op in fl.ops[fl.index:] if op.kind is not OpKind.COMMIT)
    if not involved:
        advance(core, tx, at)
        return
    if fl.rolling_back or fl.op.kind is OpKind.COMMIT:
        # Nothing to undo or commit on a dead process; the rest goes on without it.
        advance(core, tx, at)
        return
    reason = f"worker {worker_id} {how} during {fl.op.kind.value}"
    tx.emit(f.OpFailed(at=at, op_id=fl.op.op_id, worker_id=worker_id, reason=reason))
    _abort(core, tx, reason, at)


# -- owning the outcome: a resize measured against what its decision expected ----------


def check_outcome(core: CoreLike, tx: Tx, at: float) -> None:
    """After a step: check the prediction once `verify_steps` steps ran on the new split, and
    judge the resize once its payback window (or the job) is over."""
    o = tx.state.outcome
    if o is None or not o.committed:
        return
    n = len(o.after)
    verify = max(core.config.guards.verify_steps, 1)
    if not o.checked and n >= verify and o.predicted_step_s_after is not None:
        measured = sum(o.after[:verify]) / verify
        tx.emit(f.PredictionChecked(
            at=at, resize_id=o.resize_id, steps=verify, predicted_step_s_after=o.predicted_step_s_after,
            measured_step_s_after=measured, error_s=measured - o.predicted_step_s_after,
            predicted_step_s=o.predicted_step_s, measured_step_s=o.measured_step_s))
    total = core.config.steps_total
    if n >= o.payback_steps or (total is not None and tx.state.last_step >= total - 1):
        _judge(core, tx, at)  # the window is over, or the job is: nothing more will be measured
    elif n == verify and _worse_early(core, o, tx.state):
        _judge(core, tx, at, undo=True)  # measured worse already: undone at the next boundary


UNDO_SOURCE = "undo"
"""The source of a resize that goes back to the split a resize judged worse left."""


def _expected_and_measured(o: Outcome) -> tuple[float, float] | None:
    """(what the old split would have taken for the steps measured after the commit, what they
    took), or None where the old split measured nothing."""
    n = len(o.after)
    if n == 0 or o.measured_step_s is None:
        return None
    # Scaled by their response tokens when every step reported them (responses grow during RL;
    # a longer step is not the resize's fault), else the old split's mean step period.
    if o.measured_s_per_token is not None and all(t > 0 for t in o.after_tokens):
        return o.measured_s_per_token * sum(o.after_tokens), sum(o.after)
    return n * o.measured_step_s, sum(o.after)


def _worse_early(core: CoreLike, o: Outcome, state: ClusterState) -> bool:
    """A committed resize of the policy's whose first `verify_steps` steps measured slower than
    the old split would have by more than `undo_margin` (`GuardConfig.undo_worse`): per response
    token against the old split's steps and, where those steps reported their response lengths,
    against what the cost model says the old split would have taken for the very same steps
    (their latency floor included: a long-tailed rollout's time follows its longest response,
    not its tokens, so per token alone a noisy workload reads as a worse split)."""
    cfg = core.config.guards
    if not cfg.undo_worse or o.source == UNDO_SOURCE or o.before is None or o.predicted_step_s_after is None:
        return False
    seen = _expected_and_measured(o)
    margin = 1.0 + max(cfg.undo_margin, 0.0)
    if seen is None or seen[1] <= seen[0] * margin:
        return False
    steps = state.recent[-len(o.after):]
    if (costmodel.tail_binds(core.config.pipeline) and len(steps) == len(o.after)
            and all(costmodel.floor_of(t) is not None for t in steps)):
        old = sum(costmodel.predicted_step_s((t,), state.split, o.before) for t in steps)
        return seen[1] > old * margin
    return True


def undo_proposal(state: ClusterState) -> Proposal | None:
    """Going back to the split a resize judged worse early left (`ClusterState.undo_to`), or None."""
    v, target = state.last_verdict, state.undo_to
    if target is None or target == state.split or v is None:
        return None
    saved = f"{v.saved_s:+.1f}s" if v.saved_s is not None else "unknown"
    return Proposal(target=target, predicted_step_s=0.0, predicted_step_s_after=0.0,
                    reason=(f"undo {v.resize_id}: measured worse over its first {v.steps} step(s) on {state.split} "
                            f"(saved {saved} against the old split); back to {target} without waiting out the "
                            f"cooldown (guards.undo_worse)"))


def _judge(core: CoreLike, tx: Tx, at: float, *, undo: bool = False) -> None:
    """The verdict on the resize being measured, and what the payback guard learns from it;
    with `undo`, judged worse early: the verdict names the split to go back to."""
    o = tx.state.outcome
    assert o is not None
    cfg, factor = core.config.guards, tx.state.history.payback_factor
    n = len(o.after)
    seen = _expected_and_measured(o) if o.committed else None
    if seen is None:
        verdict, saved = f.Verdict.UNKNOWN, None
    else:
        expected, took = seen
        saved = expected - took
        if saved < 0:
            verdict = f.Verdict.WORSE
        elif saved < (o.cost_s or 0.0):
            verdict = f.Verdict.NOT_PAID_BACK
        else:
            verdict = f.Verdict.PAID_BACK
    # A resize that hurt raises the bar; one cut short by the next resize is not held against
    # its policy unless it already measured slower per step.
    if verdict is f.Verdict.WORSE or (verdict is f.Verdict.NOT_PAID_BACK and n >= o.payback_steps):
        factor = min(factor * cfg.payback_backoff, max(cfg.payback_backoff_max, 1.0))
    elif verdict is f.Verdict.PAID_BACK:
        factor = max(factor / cfg.payback_backoff, 1.0) if cfg.payback_backoff > 0 else 1.0
    tx.emit(f.ResizeJudged(at=at, resize_id=o.resize_id, verdict=verdict, steps=n, payback_steps=o.payback_steps,
                           undo_to=o.before if undo and verdict is f.Verdict.WORSE else None,
                           saved_s=saved, cost_s=o.cost_s, payback_factor=factor))
