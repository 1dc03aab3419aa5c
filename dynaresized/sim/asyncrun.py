"""`dynaresized simulate` in verl's fully-async semantics (`--pipeline fully-async`, or a
profile's `[pipeline]`): our policy and verl's rule on the same pipeline, with its baselines
and fluid bound (docs/simulator.md, "Pipelines").

What runs, all in `asyncpipe.AsyncPipeline`:

* the start: the plan search for this pipeline, the fastest fixed configuration (split x engine
  size) over the first `pilot_steps` steps, no hindsight; the same for every rule (it simulates
  no rule), so verl's rule runs from its own planned start, which is ours;
* ours: the policy's loan decisions as the verl integration asks for them (after each cycle,
  from the cycle reports `core.cycles.cycle_timing` makes, with the core's `loan_payback`
  margin), verl's trainer taking the lent GPUs back at its own adapted `deactivate_wait_samples`;
  in this pipeline nothing resizes (verl's trainer cannot), so the policy's resizes are not run;
* verl's rule (`verl-default`, verl's defaults) from the same start, with `loan_safety` 1;
* the best static configuration, with hindsight, and standing still at the start;
* `async_fluid_bound`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from dynaresized.core.policy import load_policy
from dynaresized.domain import PipelineSpec, Split
from dynaresized.sim.asyncpipe import AsyncPipeline, SampleLedger, async_best_static, async_fluid_bound
from dynaresized.sim.plan import PILOT_STEPS
from dynaresized.sim.profile import Profile
from dynaresized.sim.run import BestStatic
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import Trace



class AsyncReport(msgspec.Struct, frozen=True):
    """One JSON object of `simulate --pipeline fully-async` (fields as in docs/simulator.md)."""

    workload: str
    profile: str
    gpus: int
    steps: int
    policy: str
    pipeline: str
    staleness: float
    partial_rollout: bool
    sync_every: int
    start: str  # "T:R/TP-K" the run started from
    planned_start: str  # the plan search's pick ("" where the start was given)
    total_time_s: float
    mean_step_s: float
    loans: int
    hybrid_device_s: float
    best_static: BestStatic  # as `simulate`'s one-step-off report gives it
    speedup_vs_best_static: float
    initial_split_total_time_s: float
    speedup_vs_initial_split: float
    verl_dynamic_total_time_s: float
    """verl's rule (`verl-default`) from its own planned start, which in this pipeline is the run's
    (the plan search simulates no rule); from the start given, where one was."""
    speedup_vs_verl_dynamic: float
    verl_dynamic_loans: int
    fluid_bound_s: float
    gap_to_fluid_bound: float
    ledger: SampleLedger
    verl_ledger: SampleLedger
    loan_reasons: list[str] = []  # the first and last few loans' reasons
    resizes: int = 0  # never in this pipeline (verl's trainer cannot resize); said so in the text


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


def planned_start(model: StageModel, gpus: int, spec: PipelineSpec, pilot_steps: int) -> tuple[Split, int]:
    """The plan search for this pipeline: the fastest fixed configuration on the first
    `pilot_steps` steps (no hindsight)."""
    pilot = StageModel(model.profile, model.trace.head(pilot_steps), router=model.router)
    split, tp, _ = async_best_static(pilot, gpus, spec)
    return split, tp


def simulate_async(trace: Trace, profile: Profile, policy: str, spec: PipelineSpec, *,
                   policy_options: Mapping[str, Any] | None = None, loan_safety: float | None = None,
                   start: tuple[Split, int] | None = None, pilot_steps: int = PILOT_STEPS,
                   router: str = "pull") -> AsyncReport:
    if spec.windowed:
        raise ValueError("the one-step-off pipeline is `sim.run.simulate`'s")
    gpus = profile.cluster.gpus
    model = StageModel(profile, trace, router=router)
    planned = ""
    if start is None:
        start = planned_start(model, gpus, spec, pilot_steps)
        planned = f"{start[0]}/TP-{start[1]}"
    split, tp = start
    m = model.at_tp(tp)
    safety = profile.guards.loan_safety if loan_safety is None else loan_safety
    ours = AsyncPipeline(m, split, spec, loan_policy=load_policy(policy, dict(policy_options or {})),
                         loan_safety=safety).run()
    verl = AsyncPipeline(m, split, spec, loan_policy=load_policy("verl-default"), loan_safety=1.0).run()
    still = AsyncPipeline(m, split, spec).run()
    best_split, best_tp, best_total = async_best_static(model, gpus, spec)
    fluid = async_fluid_bound(model, gpus, spec)
    total = ours.total_time_s
    reasons = ours.loan_reasons[:3] + (ours.loan_reasons[-2:] if len(ours.loan_reasons) > 5 else [])
    return AsyncReport(
        workload=trace.name, profile=profile.name, gpus=gpus, steps=len(trace), policy=policy,
        pipeline=spec.mode, staleness=spec.staleness, partial_rollout=spec.partial_rollout,
        sync_every=spec.sync_every, start=f"{split}/TP-{tp}", planned_start=planned,
        total_time_s=_r(total, 1), mean_step_s=_r(total / len(trace), 2), loans=ours.loans,
        hybrid_device_s=_r(ours.hybrid_device_s, 1),
        best_static=BestStatic(best_split.train, best_split.rollout, _r(best_total, 1), best_tp),
        speedup_vs_best_static=_r(best_total / total, 4),
        initial_split_total_time_s=_r(still.total_time_s, 1),
        speedup_vs_initial_split=_r(still.total_time_s / total, 4),
        verl_dynamic_total_time_s=_r(verl.total_time_s, 1),
        speedup_vs_verl_dynamic=_r(verl.total_time_s / total, 4), verl_dynamic_loans=verl.loans,
        fluid_bound_s=_r(fluid, 1), gap_to_fluid_bound=_r(total / fluid - 1.0, 4),
        ledger=ours.ledger, verl_ledger=verl.ledger, loan_reasons=reasons)


def async_summary(r: AsyncReport) -> str:
    lines = [
        f"{r.workload} on {r.profile} ({r.gpus} devices, {r.steps} steps), policy {r.policy}, pipeline {r.pipeline} "
        f"(staleness {r.staleness:g}, partial rollout {'on' if r.partial_rollout else 'off'}, sync every "
        f"{r.sync_every} mini-batches)",
        f"  start {r.start}" + (" (planned_start: the plan search over the first steps, in this pipeline)"
                                if r.planned_start else ""),
        f"  total_time_s {r.total_time_s:,.0f}  mean_step_s {r.mean_step_s:,.1f}  loans {r.loans} "
        f"(hybrid device-s {r.hybrid_device_s:,.0f}); no resizes: verl's trainer cannot resize",
        f"  best_static {r.best_static.train}:{r.best_static.rollout}/TP-{r.best_static.tp} "
        f"{r.best_static.total_time_s:,.0f}  "
        f"speedup_vs_best_static {r.speedup_vs_best_static:.3f}x",
        f"  initial_split_total_time_s {r.initial_split_total_time_s:,.0f}  speedup_vs_initial_split "
        f"{r.speedup_vs_initial_split:.3f}x",
        f"  verl_dynamic_total_time_s {r.verl_dynamic_total_time_s:,.0f} ({r.verl_dynamic_loans} loans)  "
        f"speedup_vs_verl_dynamic {r.speedup_vs_verl_dynamic:.3f}x",
        f"  fluid_bound_s {r.fluid_bound_s:,.0f}  gap_to_fluid_bound {r.gap_to_fluid_bound:.3f}",
        f"  ledger: {r.ledger.samples} samples generated once {r.ledger.generated_once}, trained once "
        f"{r.ledger.trained_once}, never on newer weights {r.ledger.never_future_weights}; "
        f"{r.ledger.spanning_versions} spanned versions, most stale {r.ledger.max_staleness}",
    ]
    return "\n".join(lines) + "\n"
