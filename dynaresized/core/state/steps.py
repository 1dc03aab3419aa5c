"""The fold of steps and the cluster's own facts. Folds ClusterConfigured, StepObserved,
ProgressObserved (older logs), ResizingPaused, ResizingResumed, ShutdownStarted, and the records
that change nothing: ConfigReloaded, ReloadRefused, ProposalRejected, PolicyHeld."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.idle import step_period_s
from dynaresized.core.state.cluster import HISTORY_WINDOW, RECENT_WINDOW, ClusterState, Phase, Progress, on, progressed
from dynaresized.domain import Pool, placed


@on(f.ClusterConfigured)
def _(s: ClusterState, e: f.ClusterConfigured) -> ClusterState:
    return replace(
        s,
        configured=True,
        devices={d: placed(p) for d, p in zip(e.devices, e.pools, strict=True)},
        candidates=e.candidates,
    )


@on(f.StepObserved)
def _(s: ClusterState, e: f.StepObserved) -> ClusterState:
    recent = (s.recent + (e.timing,))[-RECENT_WINDOW:]
    step_history = (s.step_history + (e.timing,))[-HISTORY_WINDOW:]
    outcome = s.outcome
    period = step_period_s(e.timing)
    t = e.timing
    # In a pipeline the first steps reported after a commit may still have run on the old
    # split, wholly or in one stage (one-step off: step k's rollout ran a window before its
    # training, so a step can straddle the commit): a step that says so does not measure the new one.
    before = outcome.before if outcome is not None else None
    ran_before = before is not None and (t.train_devices == before.train or t.rollout_devices == before.rollout)
    if outcome is not None and outcome.committed and period is not None and not ran_before:
        outcome = replace(outcome, after=outcome.after + (period,),
                          after_tokens=outcome.after_tokens + (e.timing.response_tokens,))
    # Engines that ran dry before a step boundary did so in the step that ended: not lendable
    # now; nor are trainers whose mini-batches were of that step (the next one begins).
    mb = s.mini_batch if s.mini_batch is not None and s.mini_batch.step > e.timing.step else None
    # A loan's prediction is checked on its stage's end: a loan to training on its step's last
    # mini-batch, which comes before this report or never; one to the rollout on this report
    # (`core.loans.check_loans`). Any older is left unchecked.
    checks = tuple(c for c in s.loan_checks if c.step > t.step or (c.step == t.step and c.to_pool is Pool.ROLLOUT))
    return replace(s, last_step=e.timing.step, recent=recent, step_history=step_history, loan_checks=checks,
                   idle=s.idle.add(e.timing, s.devices), outcome=outcome, dry=(), tails=(), mini_batch=mb,
                   step_reporter=e.worker_id, tail_due=bool(s.tail_undo), last_step_at=e.at)


@on(f.ProgressObserved)
def _(s: ClusterState, e: f.ProgressObserved) -> ClusterState:
    # Logs written before 5 December 2026 record progress reports; since then they are soft state.
    return progressed(s, e.worker_id, Progress(e.step, e.done, e.total, e.tokens))


@on(f.ResizingPaused)
def _(s: ClusterState, e: f.ResizingPaused) -> ClusterState:
    return replace(s, paused=True)


@on(f.ResizingResumed)
def _(s: ClusterState, e: f.ResizingResumed) -> ClusterState:
    phase = Phase.STEADY if s.phase is Phase.DEGRADED else s.phase
    return replace(s, paused=False, phase=phase, degraded_reason="")


@on(f.ShutdownStarted)
def _(s: ClusterState, e: f.ShutdownStarted) -> ClusterState:
    return replace(s, stopping=True)


@on(f.ConfigReloaded)
def _(s: ClusterState, e: f.ConfigReloaded) -> ClusterState:
    return s  # a record for operators: the shell holds the configuration


@on(f.ReloadRefused)
def _(s: ClusterState, e: f.ReloadRefused) -> ClusterState:
    return s  # a record for operators; changes nothing


@on(f.ProposalRejected)
def _(s: ClusterState, e: f.ProposalRejected) -> ClusterState:
    return s  # a record for operators; changes nothing


@on(f.PolicyHeld)
def _(s: ClusterState, e: f.PolicyHeld) -> ClusterState:
    return s  # a record for operators; changes nothing
