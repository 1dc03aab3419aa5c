"""What the daemon shows of the cluster: the status the CLI prints (`status_of`, as plain data),
and the metrics and log line of each fact once it is durable (`observe`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from dynaresized.core import facts as f
from dynaresized.core import costmodel
from dynaresized.core.costmodel import FLOOR, measure
from dynaresized.core.state import ClusterState
from dynaresized.daemon.metrics import Metrics
from dynaresized.domain import PlanKind, Pool
from dynaresized.explain import explain

if TYPE_CHECKING:
    from dynaresized.daemon.service import Daemon

log = structlog.get_logger("dynaresized")


def status_of(state: ClusterState, daemon: Daemon | None = None) -> dict[str, Any]:
    """The status the CLI shows, as plain data."""
    fl = state.inflight
    return {
        "phase": state.phase.value,
        "split": {"train": state.split.train, "rollout": state.split.rollout},
        "paused": state.paused,
        "stopping": state.stopping,
        "degraded_reason": state.degraded_reason,
        "disk_full": daemon.cluster.disk_full if daemon else "",
        "last_step": state.last_step,
        "facts": state.version,
        "resizes": {"started": state.resizes_started, "committed": state.resizes_committed,
                    "rolled_back": state.resizes_rolled_back, "degraded": state.resizes_degraded,
                    "in_flight": int(fl is not None and fl.plan.kind is PlanKind.RESIZE and not fl.reconciling)},
        "devices": {d: (p.pool.value if p.pool else f"moving {p.moving_from.value}->{p.moving_to.value}")  # type: ignore[union-attr]
                    for d, p in sorted(state.devices.items())},
        "lent": {d: state.devices[d].home.value for d in state.lent_devices()},  # type: ignore[union-attr]
        "engines": [list(g) for g in state.wide_engines()],
        "regroups": {"started": state.regroups_started, "committed": state.regroups_committed},
        "samples": {str(step): dict(zip(("done", "total"), state.samples(step), strict=True))
                    for step in sorted(state.step_progress)},
        "workers": [_worker_status(state, w) for w in sorted(state.workers.values(), key=lambda w: w.worker_id)],
        "in_flight": None if fl is None else {
            "resize_id": fl.plan.resize_id, "from": str(fl.plan.before), "to": str(fl.plan.after),
            "devices": list(fl.plan.devices), "op": fl.op.op_id if fl.index < len(fl.ops) else "",
            "rolling_back": fl.rolling_back, "reason": fl.reason, "acked": list(fl.acked),
            "reconciling": fl.reconciling},
        "policy": daemon.policy.name if daemon else "",
        "boot_id": daemon.boot_id if daemon else "",
        "idle": idle_status(state),
        "outcome": outcome_status(state),
        "cost_model": cost_model_status(state, floor=daemon is None
                                        or costmodel.tail_binds(daemon.cluster.core.config.pipeline)),
    }


def cost_model_status(state: ClusterState, *, floor: bool = True) -> dict[str, Any]:
    """Which stage model the policy predicts with on the steps measured on this split
    (`core.costmodel`), and why: the latency floor where step reports carry response lengths,
    the linear model where none of them does (an older worker) or where the job's pipeline
    carries a step's tail over (`floor=False`: `[pipeline]` fully-async with partial rollout)."""
    m = measure(state.recent, state.split, floor=floor)
    if m is None:
        return {"model": None, "why": "no step measured on this split yet", "floor_s": None, "steps": 0}
    if m.model == FLOOR:
        why = "step reports carry response lengths: rollout on n devices = F + (T - F) x n0 / n"
    elif not floor:
        why = ("[pipeline] carries an unfinished response into the next weight version (partial rollout): no "
               "latency floor binds a step, the linear model, rollout = T x n0 / n")
    else:
        why = "no step report carries response lengths (timing.lengths): the linear model, rollout = T x n0 / n"
    return {"model": m.model, "why": why, "floor_s": m.floor_s if m.model == FLOOR else None, "steps": m.steps,
            "rollout_s": m.rollout_s, "rollout_devices": m.rollout_devices}


def idle_status(state: ClusterState) -> dict[str, Any]:
    """Idle accounting as plain data (docs/idle.md); a ratio is None where it is unknown."""
    ledger, last = state.idle, state.idle.last
    pools = {}
    for pool in Pool:
        share = last.pool(pool) if last is not None else None
        pools[pool.value] = {**ledger.pool(pool).summary(), "last_step_ratio": share.ratio if share else None}
    return {"last_step": last.step if last is not None else None, "pools": pools,
            "devices": {d: t.summary() for d, t in sorted(ledger.devices.items())}}


def outcome_status(state: ClusterState) -> dict[str, Any]:
    """What the last resizes were expected to do and what they did, as plain data."""
    o = state.outcome
    return {
        "payback_factor": state.history.payback_factor,
        "measuring": None if o is None else {
            "resize_id": o.resize_id, "committed": o.committed, "steps": len(o.after),
            "payback_steps": o.payback_steps, "predicted_step_s_after": o.predicted_step_s_after,
            "measured_step_s": o.measured_step_s},
        "last_prediction": msgspec.to_builtins(state.last_prediction),
        "accuracy": {"resize": state.resize_accuracy.summary(), "loan": state.loan_accuracy.summary()},
        "last_verdict": msgspec.to_builtins(state.last_verdict),
    }


def _worker_status(state: ClusterState, w: Any) -> dict[str, Any]:
    desired = state.desired(w)
    return {"id": w.worker_id, "kind": w.kind.value, "status": w.status.value, "devices": list(w.devices),
            "incarnation": w.incarnation,
            "actual": w.actual.holding.value if w.actual is not None else None,
            "desired": desired.value if desired is not None else None,
            "unconverged": state.unconverged[w.worker_id].reason if w.worker_id in state.unconverged else None}


def observe(metrics: Metrics, facts: list[f.Fact], state: ClusterState) -> None:
    """Metrics and one log line per fact, once the facts are durable."""
    metrics.observe(state, facts)
    acks = log.is_enabled_for(logging.DEBUG)
    for fact in facts:
        if isinstance(fact, f.ProgressObserved | f.MiniBatchObserved | f.EngineQueueEmptyObserved):
            continue  # too chatty for the log; it is in the event store
        if isinstance(fact, f.OpAcked) and not fact.detail:
            # One per target of every op, hundreds a resize on a large cluster: at debug. The
            # op's op_completed line says it was answered; a failure names who did not.
            if not acks:
                continue
            level = "debug"
        else:
            level = "warning" if isinstance(fact, f.OpFailed | f.WorkerLost | f.ResizeAborted) else "info"
        if isinstance(fact, f.ResizeJudged) and fact.verdict is f.Verdict.WORSE:
            level = "warning"  # the daemon's own decision cost the job time
        if isinstance(fact, f.Degraded):
            level = "error"
        resize = state.inflight.plan.resize_id if state.inflight else None
        with structlog.contextvars.bound_contextvars(resize_id=resize, phase=state.phase.value):
            getattr(log, level)(explain(fact), fact=f.fact_type(fact))
