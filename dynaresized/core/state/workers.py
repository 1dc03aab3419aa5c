"""The fold of workers' facts: registrations, reports, losses, the daemon's restarts and stalls,
and reconciliation. Folds WorkerRegistered, WorkerReported, WorkerLost, WorkerLeft,
DaemonRestarted, DaemonStalled, ReconcileStarted, ReconcileFinished, WorkerUnconverged."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.state.cluster import ClusterState, InFlight, Phase, Unconverged, on, seen_at, set_actual, without
from dynaresized.core.state.memo import carry_owners
from dynaresized.domain import WorkerId, WorkerStatus


@on(f.DaemonRestarted)
def _(s: ClusterState, e: f.DaemonRestarted) -> ClusterState:
    inflight = s.inflight
    if inflight is not None and e.op_deadline is not None:
        inflight = replace(inflight, op_deadline=e.op_deadline)
    grace = {w.worker_id: e.at for w in s.workers.values() if w.status is WorkerStatus.LIVE}
    return replace(s, inflight=inflight, stopping=False, seen_base=grace, seen_recent={})


@on(f.DaemonStalled)
def _(s: ClusterState, e: f.DaemonStalled) -> ClusterState:
    return replace(s, inflight=replace(s.inflight, op_deadline=e.op_deadline)) if s.inflight is not None else s


@on(f.WorkerRegistered)
def _(s: ClusterState, e: f.WorkerRegistered) -> ClusterState:
    workers = dict(s.workers)
    workers[e.worker.worker_id] = e.worker
    carry_owners(s.workers, workers, e.worker.worker_id)
    # A new registration is a new chance to converge.
    return seen_at(replace(s, workers=workers, unconverged=without(s.unconverged, e.worker.worker_id)),
                   e.worker.worker_id, e.at)


@on(f.WorkerReported)
def _(s: ClusterState, e: f.WorkerReported) -> ClusterState:
    return set_actual(s, e.worker_id, e.actual)


@on(f.WorkerLost)
def _(s: ClusterState, e: f.WorkerLost) -> ClusterState:
    return _set_worker(s, e.worker_id, WorkerStatus.LOST)


@on(f.WorkerLeft)
def _(s: ClusterState, e: f.WorkerLeft) -> ClusterState:
    return _set_worker(s, e.worker_id, WorkerStatus.GONE)


def _set_worker(state: ClusterState, worker_id: WorkerId, status: WorkerStatus) -> ClusterState:
    w = state.workers[worker_id]
    workers = dict(state.workers)
    workers[worker_id] = replace(w, status=status)
    carry_owners(state.workers, workers, worker_id)
    return _unseen(replace(state, workers=workers), worker_id)


def _unseen(state: ClusterState, worker_id: WorkerId) -> ClusterState:
    base, recent = state.seen_base, state.seen_recent
    if worker_id in base:
        base = {w: t for w, t in base.items() if w != worker_id}
    if worker_id in recent:
        recent = {w: t for w, t in recent.items() if w != worker_id}
    return replace(state, seen_base=base, seen_recent=recent)


# -- reconciliation ---------------------------------------------------------------------


@on(f.ReconcileStarted)
def _(s: ClusterState, e: f.ReconcileStarted) -> ClusterState:
    inflight = InFlight(plan=e.plan, source="reconcile", reason=f"{e.worker_id}: {e.actual.value}, "
                        f"the log says {e.desired.value}", started_at=e.at, ops=e.plan.ops, index=0,
                        op_started_at=e.at, op_deadline=e.op_deadline, reconciling=e.worker_id)
    return replace(s, inflight=inflight, phase=Phase.RECONCILING, reconciles_started=s.reconciles_started + 1)


@on(f.ReconcileFinished)
def _(s: ClusterState, e: f.ReconcileFinished) -> ClusterState:
    unconverged = without(s.unconverged, e.worker_id) if e.ok else s.unconverged
    return replace(s, inflight=None, phase=Phase.STEADY, unconverged=unconverged)


@on(f.WorkerUnconverged)
def _(s: ClusterState, e: f.WorkerUnconverged) -> ClusterState:
    unconverged = dict(s.unconverged)
    unconverged[e.worker_id] = Unconverged(e.reason, e.at)
    return replace(s, unconverged=unconverged)
