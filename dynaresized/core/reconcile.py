"""Reconciliation: a live worker whose actual state differs from what the log says is converged
with the ops a resize and its undo use, one worker at a time; one that cannot be is left out of
plans. Emits ReconcileStarted, ReconcileFinished, WorkerUnconverged."""

from __future__ import annotations

from dynaresized.core import facts as f
from dynaresized.core.resizes import send
from dynaresized.core.state import ClusterState
from dynaresized.core.tx import CoreLike, Tx
from dynaresized.domain import Holding, OpKind, OpSpec, Pool, ResizePlan, Worker, WorkerKind, WorkerStatus


_CONVERGE: dict[tuple[Holding, Holding], tuple[OpKind, ...]] = {
    # (what the log says, what the worker says) -> the ops that take it there, in order. They
    # are the ops a resize and its undo use, from the worker's home pool: every backend knows
    # them, and each is idempotent on a worker already where the op leads.
    (Holding.SERVING, Holding.RELEASED): (OpKind.RECLAIM, OpKind.RESUME),
    (Holding.SERVING, Holding.DRAINED): (OpKind.RESUME,),
    (Holding.RELEASED, Holding.SERVING): (OpKind.DRAIN, OpKind.RELEASE),
    (Holding.RELEASED, Holding.DRAINED): (OpKind.RELEASE,),
    # serving, but as another engine than the log's (it restarted alone, its engine regrouped)
    (Holding.SERVING, Holding.SERVING): (OpKind.DRAIN, OpKind.RELEASE, OpKind.RECLAIM, OpKind.RESUME),
}


RECHECK = frozenset({f.WorkerRegistered, f.WorkerReported, f.ResizeCommitted, f.ResizeRolledBack,
                     f.ReconcileFinished, f.ResizingResumed, f.RegroupCommitted})
"""Facts after which a live worker may disagree with the log: the core looks for one then (and
at every tick, which is when a worker that could not converge is tried again)."""


def divergence(state: ClusterState, worker: Worker, now: float, retry_s: float) -> tuple[Holding, Holding] | None:
    """(desired, actual) when `worker` reports a state the log disagrees with and ops can
    converge it now; None when it agrees, does not say, or nothing is to be converged now."""
    if worker.status is not WorkerStatus.LIVE or worker.actual is None:
        return None
    stuck = state.unconverged.get(worker.worker_id)
    if stuck is not None and (now - stuck.at < retry_s or worker.actual.holding is Holding.FAILED):
        return None  # tried lately, or it cannot act at all: wait for it to report something else
    want, have = state.desired(worker), worker.actual.holding
    if want is None or have is Holding.DONE or _left_with_its_loan(state, worker):
        return None
    if _agrees(state, worker, want, have):
        return None
    return want, have


def _agrees(state: ClusterState, worker: Worker, want: Holding, have: Holding) -> bool:
    """The worker holds what the log says, and (serving) runs the engine the log says."""
    return have is want and (want is not Holding.SERVING or not wrong_engine(state, worker))


def wrong_engine(state: ClusterState, worker: Worker) -> bool:
    """An engine worker that says which engine it runs (`ActualState.engine`), and it is not
    the one the log says its device serves in."""
    if worker.kind is not WorkerKind.ROLLOUT_ENGINE or worker.actual is None or len(worker.devices) != 1:
        return False
    says = worker.actual.engine or worker.devices
    return tuple(says) != state.engine_of(worker.devices[0])


def _left_with_its_loan(state: ClusterState, worker: Worker) -> bool:
    """A trainer on a device lent to the training step leaves the group by itself once the
    step's last mini-batch is done; the loan's return at the step report releases the device.
    Converging it back into the group before then would undo the step's end."""
    mb = state.mini_batch
    return (worker.kind is WorkerKind.TRAINER_RANK and worker.actual is not None
            and worker.actual.holding in (Holding.DRAINED, Holding.RELEASED)
            and all(d in state.devices and state.devices[d].home is Pool.ROLLOUT for d in worker.devices)
            and mb is not None and mb.total > 0 and mb.done >= mb.total)


def reconcile_next(core: CoreLike, tx: Tx, at: float) -> None:
    """Level-triggered: start converging the first live worker whose actual state differs from
    what the log says (one at a time, serialized with resizes)."""
    retry_s = core.config.reconcile_retry_s
    # This runs at every tick: only the workers that diverge (rarely any) are sorted. A fact the
    # loop emits (WorkerUnconverged) changes its own worker's divergence only, so these are the
    # workers a walk over all of them in id order would stop at.
    diverging = sorted((w for w in tx.state.workers.values()
                        if w.actual is not None and divergence(tx.state, w, at, retry_s) is not None),
                       key=lambda w: w.worker_id)
    for w in diverging:
        gap = divergence(tx.state, w, at, retry_s)
        if gap is None:
            continue
        want, have = gap
        if have is Holding.FAILED:
            detail = w.actual.detail if w.actual is not None else ""
            tx.emit(f.WorkerUnconverged(at=at, worker_id=w.worker_id,
                                        reason=f"it reports failed{': ' + detail if detail else ''}"))
            continue
        s = tx.state
        rid = f"c{s.reconciles_started + 1}"
        home = w.kind.pool
        ops = tuple(OpSpec(op_id=f"{rid}/{i}-{kind.value}", kind=kind, devices=w.devices, targets=(w.worker_id,),
                           from_pool=home, to_pool=home.other)
                    for i, kind in enumerate(_CONVERGE[(want, have)]))
        plan = ResizePlan(resize_id=rid, devices=w.devices, from_pool=home, to_pool=home.other, ops=ops,
                          before=s.split, after=s.split)
        tx.emit(f.ReconcileStarted(at=at, plan=plan, worker_id=w.worker_id, desired=want, actual=have,
                                   op_deadline=at + core.config.op_timeout_s))
        send(tx, None)
        return


def finish_reconcile(tx: Tx, resize_id: str, worker_id: str, at: float) -> None:
    """Every converging op was acknowledged: the worker agrees with the log now, unless what it
    reported with its answers still says otherwise (then no op can help: it is left out)."""
    w = tx.state.workers[worker_id]
    want = tx.state.desired(w)
    have = w.actual.holding if w.actual is not None else None
    if have is None or want is None or _agrees(tx.state, w, want, have):
        tx.emit(f.ReconcileFinished(at=at, resize_id=resize_id, worker_id=worker_id, ok=True))
        return
    reason = f"its converging ops succeeded, but it still reports {have.value} (the log says {want.value})"
    if have is want:
        reason = (f"its converging ops succeeded, but it still runs the engine [{', '.join(w.actual.engine or w.devices)}] "
                  f"(the log says [{', '.join(tx.state.engine_of(w.devices[0]))}])")
    tx.emit(f.ReconcileFinished(at=at, resize_id=resize_id, worker_id=worker_id, ok=False, reason=reason))
    tx.emit(f.WorkerUnconverged(at=at, worker_id=worker_id, reason=reason))
