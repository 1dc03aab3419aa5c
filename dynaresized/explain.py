"""One readable line per fact: what changed, from, to, why. Used by the daemon's log and by
`dynaresized events` on a terminal, so operators read the same words in both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynaresized.core import facts as f
from dynaresized.core.idle import idle_ratio, percent
from dynaresized.domain import PlanKind, Pool


def explain(fact: f.Fact) -> str:
    match fact:
        case f.ClusterConfigured():
            return f"cluster configured: {len(fact.devices)} devices, candidates " + (
                ", ".join(str(c) for c in fact.candidates) or "any split")
        case f.DaemonRestarted():
            return "daemon started on the existing log" + (
                "; the resize in flight gets a fresh deadline" if fact.op_deadline else "")
        case f.DaemonStalled():
            return (f"daemon stalled for {fact.seconds:.1f}s (no CPU or a slow disk): the operation in flight "
                    f"gets that time back")
        case f.WorkerRegistered():
            w = fact.worker
            said = f", reports {w.actual.holding.value}" if w.actual is not None else ""
            return f"worker {w.worker_id} registered as {w.kind.value} on {', '.join(w.devices)} " \
                   f"(incarnation {w.incarnation}{said})"
        case f.WorkerLost():
            return f"worker {fact.worker_id} lost: {fact.reason}"
        case f.WorkerLeft():
            return f"worker {fact.worker_id} left"
        case f.StepObserved():
            t = fact.timing
            return (f"step {t.step}: rollout {t.rollout_s:.2f}s, train {t.train_s:.2f}s, sync {t.weight_sync_s:.2f}s; "
                    f"idle rollout {percent(idle_ratio(t, Pool.ROLLOUT))}, "
                    f"training {percent(idle_ratio(t, Pool.TRAINING))}")
        case f.ProgressObserved():
            return f"{fact.worker_id} step {fact.step}: {fact.done}/{fact.total} samples, {fact.tokens} tokens"
        case f.ProposalRejected():
            # Logs from before `proposal` was recorded say "resize" for every refusal: a loan
            # guard's name still tells a loan's refusal there.
            old_loan = fact.proposal is PlanKind.RESIZE and fact.guard.startswith("loan")
            what = PlanKind.LOAN if old_loan else fact.proposal
            target = f" to {fact.target}" if fact.target else ""
            return f"no {what.value}{target} (from {fact.source}), guard {fact.guard}: {fact.reason}"
        case f.PolicyHeld():
            return f"step {fact.step}: {fact.source} holds {fact.split}: {fact.reason}"
        case f.ResizeStarted():
            p = fact.plan
            return f"resize {p.resize_id} started: {p.before} -> {p.after}, moving {', '.join(p.devices)} " \
                   f"{p.direction} (by {fact.source}: {fact.reason})"
        case f.OpAcked():
            return f"{fact.op_id} acknowledged by {fact.worker_id}" + (f": {fact.detail}" if fact.detail else "")
        case f.OpCompleted():
            return f"{fact.op_id} completed in {fact.duration_s:.3f}s"
        case f.OpFailed():
            return f"{fact.op_id} failed: {fact.reason}"
        case f.ResizeAborted():
            undo = ", ".join(op.kind.value for op in fact.undo) or "nothing to undo"
            return f"resize {fact.resize_id} aborted ({fact.reason}); rolling back: {undo}"
        case f.ResizeCommitted():
            return f"resize {fact.resize_id} committed in {fact.duration_s:.2f}s at step {fact.step}"
        case f.ResizeRolledBack():
            return f"resize {fact.resize_id} rolled back: {fact.reason}"
        case f.Degraded():
            return f"DEGRADED after resize {fact.resize_id}: {fact.reason}; devices placed in " \
                   f"{fact.placed_in.value}; run `dynaresized resume` once fixed"
        case f.PredictionChecked():
            before = ""
            if fact.predicted_step_s is not None and fact.measured_step_s is not None:
                before = f" (before: predicted {fact.predicted_step_s:.1f}s, measured {fact.measured_step_s:.1f}s)"
            return (f"resize {fact.resize_id} prediction: step {fact.predicted_step_s_after:.1f}s predicted, "
                    f"{fact.measured_step_s_after:.1f}s measured over {fact.steps} step(s), "
                    f"error {fact.error_s:+.1f}s ({fact.error_s / fact.predicted_step_s_after:+.0%}){before}")
        case f.ResizeJudged():
            undo = (f"; undone at the next step boundary: back to {fact.undo_to} (guards.undo_worse)"
                    if fact.undo_to is not None else "")
            return f"resize {fact.resize_id} {_verdict(fact)}; payback guard factor now {fact.payback_factor:g}{undo}"
        case f.ResizingPaused():
            return f"resizing paused by {fact.requested_by}" + (f": {fact.reason}" if fact.reason else "")
        case f.ResizingResumed():
            return f"resizing resumed by {fact.requested_by}"
        case f.ShutdownStarted():
            return "shutdown started: no new resize; the one in flight finishes or rolls back"
        case f.WorkerReported():
            a = fact.actual
            return f"worker {fact.worker_id} reports {a.holding.value}" + (
                f" after {a.last_op}" if a.last_op else "") + (f": {a.detail}" if a.detail else "")
        case f.ReconcileStarted():
            ops = ", ".join(op.kind.value for op in fact.plan.ops)
            return f"reconcile {fact.plan.resize_id}: worker {fact.worker_id} reports {fact.actual.value} but the " \
                   f"log says {fact.desired.value}; sending {ops}"
        case f.ReconcileFinished():
            if fact.ok:
                return f"reconcile {fact.resize_id}: worker {fact.worker_id} agrees with the log"
            return f"reconcile {fact.resize_id} of worker {fact.worker_id} ended unconverged: {fact.reason}"
        case f.WorkerUnconverged():
            return f"worker {fact.worker_id} cannot be converged ({fact.reason}); its devices are left out of " \
                   "resizes and loans until it reports a state that agrees with the log or registers again"
        case f.EngineQueueEmptyObserved():
            state = "idle" if fact.running == 0 else f"{fact.running} running, ~{fact.tokens_left} tokens left"
            return f"{fact.worker_id} on {fact.device}: rollout step {fact.step} queue empty, {state}"
        case f.MiniBatchObserved():
            return f"{fact.worker_id}: mini-batch {fact.done}/{fact.total} of training step {fact.step} done"
        case f.LoanStarted():
            return f"loan {fact.plan.resize_id} started (by {fact.source}): {fact.reason}"
        case f.LoanChecked():
            late = "later" if fact.error_s >= 0 else "sooner"
            return (f"loan {fact.resize_id} prediction: the {fact.to_pool.value} finished step {fact.step} "
                    f"{fact.measured_s:.1f}s after the loan, {fact.predicted_s:.1f}s predicted "
                    f"({abs(fact.error_s):.1f}s {late}; it was to save ~{fact.saves_s:.0f}s)")
        case f.LoanLanded():
            return f"loan {fact.resize_id} landed in {fact.duration_s:.2f}s: the lent devices serve the other pool until the step boundary"
        case f.LoanReturnStarted():
            then = f"; then resize to {fact.then} ({fact.then_reason})" if fact.then else ""
            return f"loan return {fact.plan.resize_id} started: {fact.reason}{then}"
        case f.LoanReturned():
            return f"loan return {fact.resize_id} done in {fact.duration_s:.2f}s: the devices are home"
        case f.ConfigReloaded():
            guards = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in fact.guards_changed.items()) or "unchanged"
            later = f"; {', '.join(fact.restart_only)} take effect at the next start" if fact.restart_only else ""
            return f"configuration reloaded: policy {fact.policy}, guards {guards}{later}"
        case f.ReloadRefused():
            return f"reload refused, the running policy and guards are kept: {fact.reason}"
        case f.RegroupStarted():
            return f"regroup {fact.plan.resize_id} started (by {fact.source}): {fact.reason}"
        case f.RegroupCommitted():
            return f"regroup {fact.resize_id} committed in {fact.duration_s:.2f}s at step {fact.step}"
    return f"{type(fact).__name__}"  # pragma: no cover - every fact type is matched above


def _verdict(fact: f.ResizeJudged) -> str:
    over = f"over {fact.steps} of {fact.payback_steps} step(s)"
    if fact.verdict is f.Verdict.UNKNOWN or fact.saved_s is None:
        return f"outcome unknown {over}: no measured step on one side of it"
    cost = f"{fact.cost_s:.1f}s" if fact.cost_s is not None else "unknown"
    if fact.verdict is f.Verdict.WORSE:
        return f"MADE THINGS WORSE {over}: lost {-fact.saved_s:.1f}s against the old split, plus its cost {cost}"
    if fact.verdict is f.Verdict.NOT_PAID_BACK:
        return f"did not pay back {over}: saved {fact.saved_s:.1f}s, cost {cost}"
    return f"paid back {over}: saved {fact.saved_s:.1f}s, cost {cost}"


def accuracy(kind: str, a: Mapping[str, Any]) -> str | None:
    """`kind`'s ("resize", "loan") predictions checked so far (`Accuracy.summary`, `status`'s
    `accuracy`) in words, or None where none was checked against a measured time."""
    if not a["checked"] or a["mae_s"] is None or a["relative_error"] is None:
        return None
    return (f"{kind}s {a['checked']} checked, mean abs error {a['mae_s']:.1f}s "
            f"({a['relative_error']:.0%} of what was measured)")
