"""`simulate` and `bench`: run a policy over a trace and compare it with the baselines.

A run's `SimReport` is what `dynaresized simulate --json` prints: plain numbers from a
deterministic computation, so the same inputs give the same JSON bit for bit. Baselines that
do not depend on the policy (best static split, colocated, the best split per step, lower bound) are computed
once per (trace, profile) and shared by every policy `bench` runs.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import load_policy
from dynaresized.domain import Pool, Split
from dynaresized.sim.bounds import fluid_windows, lower_bound
from dynaresized.sim.pipeline import (
    DynamicPipeline,
    DynamicRun,
    Layout,
    Progress,
    best_static,
    best_static_config,
    colocated_total,
    oracle_total,
    static_total,
)
from dynaresized.sim.plan import PILOT_STEPS, Config, plan_start
from dynaresized.sim.profile import Profile
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import DYNAMIC_SCENARIOS, Shape, Trace, scenario_trace


class BestStatic(msgspec.Struct, frozen=True):
    train: int
    rollout: int
    total_time_s: float
    tp: int = 1
    """Devices per rollout engine (tensor-parallel degree) of the configuration."""


class ResizeEvent(msgspec.Struct, frozen=True):
    resize_id: str
    step: int  # the last completed step when the resize started
    started_at_s: float
    before: str
    after: str
    reason: str
    outcome: str  # committed | rolled_back | degraded | in_flight
    ended_at_s: float | None = None


class SimReport(msgspec.Struct, frozen=True):
    """One simulated run. Times are seconds of virtual time."""

    policy: str
    workload: str
    profile: str
    cost_mode: str  # "pipelined" (DESIGN.md §5 costs) or "naive" (stop, fresh communicators, restart)
    seed: int | None
    gpus: int
    steps: int
    samples_per_step: float
    initial_split: str
    """The split this run started from (with `layout` "plan": the planned start's split; the
    profile's own `[cluster] initial_split` is `profile_initial_split`)."""
    final_split: str
    total_time_s: float
    mean_step_s: float
    resizes: int  # committed resizes
    resizes_started: int
    best_static: BestStatic
    """The best static configuration with hindsight: split x devices per rollout engine."""
    initial_split_total_time_s: float
    """Standing still where the run started: `initial_split` on the run's engines (`tp`) for the
    whole run; `speedup_vs_initial_split` is `it / total_time_s`."""
    colocated_total_time_s: float
    best_split_per_step_tp1_total_time_s: float
    """The best split of the profile's own engines (TP-1 in both 8B profiles) chosen afresh for
    every step, resizes free and instant, no loans: what resizing those engines between steps
    could buy at most. Not a bound on this run: loans and wider engines beat it."""
    lower_bound_s: float
    speedup_vs_best_static: float
    speedup_vs_initial_split: float
    speedup_vs_colocated: float
    gap_to_lower_bound: float
    headroom_vs_best_static: float
    """`best_static_tp1 / best_split_per_step_tp1`: the most resizing can gain over the best static split of the
    profile's own engines on this workload, with free, instant resizes (no step-boundary
    policy's `speedup_vs_best_static_tp1` exceeds it)."""
    bound_vs_best_static: float
    """`best_static / lower_bound`: the most any schedule that moves devices only at step
    boundaries could gain over the best static split (loans inside a step: `fluid_bound_s`)."""
    cooldown_steps: int
    min_steps_between_resizes: int | None
    rejections: dict[str, int]
    """Proposals the core's guards held back, by guard."""
    rejection_reasons: dict[str, str]
    """The last reason each guard in `rejections` gave (its threshold and what it measured)."""
    policy_holds: int
    """Steps where the policy was asked and proposed nothing (reason: `last_hold_reason`)."""
    last_hold_reason: str
    resize_events: list[ResizeEvent]
    idle_ratio: dict[str, float | None] = {}
    """Idle share per pool over the run, as the daemon accounts it from the reported step
    timings (docs/idle.md); None where no step had a figure."""
    prediction_errors: list[float] = []
    """(measured - predicted) / predicted step time after each resize its policy predicted."""
    prediction_mae_s: dict[str, float | None] = {}
    """The daemon's prediction check, as `status`'s `accuracy`: the mean absolute error in
    seconds of the resizes' predicted step time and of the loans' predicted end of the stage they
    serve (`PredictionChecked`, `LoanChecked`); None where nothing was checked."""
    loans_checked: int = 0
    verdicts: dict[str, int] = {}
    """Committed resizes judged over their payback window, by verdict (paid_back, worse...)."""
    router: str = "pull"
    best_static_round_robin: BestStatic | None = None
    """The best fixed split with requests placed as verl places them, in contiguous chunks at
    submission (what a verl user runs today; the name is issue 11's)."""
    speedup_vs_best_static_round_robin: float = 0.0
    fluid_bound_s: float = 0.0
    """A bound for every schedule, loans inside a step included (see docs/simulator.md)."""
    gap_to_fluid_bound: float = 0.0
    loans: int = 0  # loans that landed (devices lent for the rest of a step)
    devices_lent: int = 0  # device-steps lent
    loans_refused: int = 0  # loans the core's loan guards refused
    fluid_gap_rollout_bound_s: float = 0.0
    """Of `total - fluid_bound`: seconds in windows the rollout ended last (its latency-bound
    tail: one long response decoding nearly alone while nothing can take over its work)."""
    fluid_gap_training_bound_s: float = 0.0
    """...and in windows training ended last (loan costs, mini-batch granularity, and lending
    decided from progress so far rather than from the lengths still to come)."""
    verl_dynamic_same_start_total_time_s: float = 0.0
    """The same trace, profile, devices, engines and start as this run (`start`), run with
    `verl-default`: verl's own dynamic-scheduling rule lending the trainers to the rollout
    (docs/simulator.md, "verl's own rules"); `speedup_vs_verl_dynamic_same_start` is `its total /
    total_time_s`."""
    speedup_vs_verl_dynamic_same_start: float = 0.0
    verl_dynamic_own_start: str = ""
    """Where verl's rule starts when the plan search is run with verl's rule (`plan_start` with
    `verl-default`, the same pilot steps): "T:R/TP-K"."""
    verl_dynamic_own_start_total_time_s: float = 0.0
    """`verl-default` from `verl_dynamic_own_start` (the fair comparison: each rule from its own
    planned start); `speedup_vs_verl_dynamic_own_start` is `its total / total_time_s`."""
    speedup_vs_verl_dynamic_own_start: float = 0.0
    verl_v1_switch_total_time_s: float = 0.0
    """...and with `verl-v1-switch`, verl v1's step switching, from this run's start;
    `speedup_vs_verl_v1_switch`."""
    speedup_vs_verl_v1_switch: float = 0.0
    best_static_tp1: BestStatic | None = None
    """The best fixed split on the profile's own engine size (`rollout.gpus_per_engine`, TP-1
    in both 8B profiles): what `best_static` was before engine sizes were searched."""
    speedup_vs_best_static_tp1: float = 0.0
    tp: int = 1
    """Devices per rollout engine of this run (the profile's `gpus_per_engine`, or `simulate --tp`)."""
    layout: str = "profile"
    """Where the run's layout came from: "profile" (its engines and initial split), "manual"
    (`--tp` / `--initial-split`) or "plan" (`--layout plan`: the plan search's start)."""
    planned_start: str = ""
    """With `layout` "plan": the configuration the search started the run from, "T:R/TP-K"."""
    start: str = ""
    """Where this run started, "T:R/TP-K", whatever the layout (`initial_split` on `tp` engines)."""
    profile_initial_split: str = ""
    """The profile's own `[cluster] initial_split` (scaled with `--gpus`), whether or not the run
    started there."""
    regroups: int = 0
    """Regroups of the rollout pool into engines of another size during the run (`simulate
    --replan-every`), committed."""


@dataclass(frozen=True)
class Baselines:
    """What a run is compared with; independent of the policy."""

    best_split: Split
    best_static_s: float
    colocated_s: float
    oracle_s: float
    lower_bound_s: float
    fluid_bound_s: float = 0.0
    fluid_windows: np.ndarray | None = None
    best_split_round_robin: Split | None = None
    best_static_round_robin_s: float = 0.0
    best_tp: int = 1
    """Devices per rollout engine of the best static configuration (`best_split`)."""
    best_split_tp1: Split | None = None
    best_static_tp1_s: float = 0.0
    tp1_engine: int = 1
    """Devices per engine of `best_split_tp1` (the profile's own `gpus_per_engine`)."""


VERL_RULES: tuple[str, ...] = ("verl-default", "verl-v1-switch")
"""verl's own rules, run beside every simulation (`verl_baselines`)."""


@dataclass(frozen=True)
class VerlRuns:
    """verl's rules on one (trace, profile, cost mode): its runs, by policy name, or only their
    totals for those run in another process (`simulate(jobs=...)`), from the run's start; and
    `verl-default` from its own planned start (`own_start`, `verl_own_start`), whose total is
    `own_start_total_s` (None: that start is the run's, and the total is the same run's)."""

    runs: Mapping[str, DynamicRun]
    guards: GuardConfig
    totals: Mapping[str, float] = field(default_factory=dict)
    own_start: str = ""
    own_start_total_s: float | None = None

    def total_s(self, name: str) -> float:
        return self.runs[name].total_time_s if name in self.runs else self.totals[name]

    def own_total_s(self) -> float:
        return self.total_s("verl-default") if self.own_start_total_s is None else self.own_start_total_s


AUTO_JOBS_FROM_GPUS = 128
"""`simulate(jobs=None)` runs verl's rules in processes of their own from this many devices on
(below it a whole simulation takes seconds, and a fork costs more than it saves)."""

_FORKED: list[Callable[[], float]] = []


def _run_forked(i: int) -> float:
    return _FORKED[i]()


def start_of(profile: Profile) -> Config:
    """Where a run on `profile` starts: its initial split on its engines."""
    s = profile.initial_split
    return Config(s.train, s.rollout, profile.rollout.gpus_per_engine)


def verl_own_start(origin: Profile, trace: Trace, *, router: str = "pull", pilot_steps: int = PILOT_STEPS) -> Config:
    """verl's rule's own planned start: the plan search (`plan_start`) run with `verl-default`
    and its guards, from `origin` (the profile before any layout), on the first `pilot_steps`
    steps, as `simulate` plans ours."""
    start, _ = plan_start(origin, trace, lambda: load_policy("verl-default"), verl_guards(origin), router=router,
                          pilot_steps=pilot_steps)
    return start


def _own_start_model(origin: Profile, model: StageModel, own: Config) -> StageModel | None:
    """The model verl's rule runs on from its own start, or None where that is the run's start
    (the same-start run is then the same run)."""
    if own == start_of(model.profile):
        return None
    return StageModel(origin.with_layout(own.tp, own.split), model.trace, router=model.router)


def _verl_run(model: StageModel, name: str, naive: bool) -> DynamicRun:
    """verl's rule `name` with its own defaults on `model`, from the profile's initial split."""
    return DynamicPipeline(model, load_policy(name), guards=verl_guards(model.profile), naive=naive).run()


def _verl_total(model: StageModel, name: str, naive: bool) -> float:
    return _verl_run(model, name, naive).total_time_s


@contextlib.contextmanager
def _forked_verl(runs: list[tuple[StageModel, str]], naive: bool,
                 processes: int) -> Iterator[Callable[[], list[float]]]:
    """Start verl's rules, each (model, name) of `runs`, in `processes` forked processes (they
    inherit the models: nothing is pickled but the totals coming back); yields what waits for
    their totals, and stops the processes on the way out, whatever happened meanwhile. The runs
    are the ones `verl_baselines` makes: the same code on the same models."""
    _FORKED[:] = [functools.partial(_verl_total, model, name, naive) for model, name in runs]
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        pending = pool.map_async(_run_forked, range(len(runs)))
        yield pending.get
    finally:
        pool.terminate()
        pool.join()
        _FORKED.clear()


def verl_guards(profile: Profile) -> GuardConfig:
    """The profile's guards, with `loan_safety` 1: verl lends when its estimated benefit
    exceeds its switch cost, no margin (the core's loan_payback guard is then its own gate)."""
    return guards_for(profile, {"loan_safety": 1.0})


def verl_baselines(model: StageModel, *, naive: bool = False, reuse: Mapping[str, DynamicRun] | None = None,
                   origin: Profile | None = None, own: Config | None = None,
                   pilot_steps: int = PILOT_STEPS) -> VerlRuns:
    """verl's rules with their own defaults on `model`, from its profile's start, and
    `verl-default` from its own planned start (`own`, or `verl_own_start` from `origin`, the
    profile before any layout: by default `model`'s)."""
    origin = origin if origin is not None else model.profile
    runs = dict(reuse or {})
    for name in VERL_RULES:
        if name not in runs:
            runs[name] = _verl_run(model, name, naive)
    own = own if own is not None else verl_own_start(origin, model.trace, router=model.router, pilot_steps=pilot_steps)
    own_model = _own_start_model(origin, model, own)
    return VerlRuns(runs=runs, guards=verl_guards(model.profile), own_start=str(own),
                    own_start_total_s=None if own_model is None else _verl_total(own_model, "verl-default", naive))


@dataclass(frozen=True)
class SimRun:
    report: SimReport
    run: DynamicRun
    model: StageModel


def baselines(model: StageModel) -> Baselines:
    """The baselines of `model`: the best static configuration (split x engine size) and the
    best split of the profile's own engines, the colocated mode, the per-step oracle (on the
    profile's own engines), and the bounds (over every engine size the cluster allows)."""
    gpus = model.profile.cluster.gpus
    fluid = fluid_windows(model, gpus)
    best, own = best_static_config(model, gpus)
    oracle = oracle_total(model, gpus)
    return Baselines(
        best_split=best.split,
        best_static_s=best.total_s,
        colocated_s=colocated_total(model, gpus),
        oracle_s=oracle,
        lower_bound_s=lower_bound(model, gpus).total_s,
        fluid_bound_s=float(fluid.sum()),
        fluid_windows=fluid,
        best_tp=best.tp,
        best_split_tp1=own.split,
        best_static_tp1_s=own.total_s,
        tp1_engine=model.profile.rollout.gpus_per_engine,
        **_round_robin(model, gpus),
    )


VERL_ROUTER = "verl"
"""The placement of the `best_static_round_robin` baseline (the name is issue 11's): verl's
dispatch at submission, contiguous equal chunks (`stages.ROUTERS`)."""


def _round_robin(model: StageModel, gpus: int) -> dict[str, Any]:
    if model.router == VERL_ROUTER:
        split, total = best_static(model, gpus)
    else:
        split, total = best_static(StageModel(model.profile, model.trace, router=VERL_ROUTER), gpus)
    return {"best_split_round_robin": split, "best_static_round_robin_s": total}


def _r(x: float, digits: int = 3) -> float:
    return float(round(x, digits))


def _resize_events(facts: Sequence[f.Fact]) -> list[ResizeEvent]:
    events: dict[str, ResizeEvent] = {}
    step = -1
    for fact in facts:
        if isinstance(fact, f.StepObserved):
            step = fact.timing.step
        elif isinstance(fact, f.ResizeStarted):
            p = fact.plan
            events[p.resize_id] = ResizeEvent(p.resize_id, step, _r(fact.at), str(p.before), str(p.after),
                                              fact.reason, "in_flight")
        elif isinstance(fact, (f.ResizeCommitted, f.ResizeRolledBack, f.Degraded)):
            outcome = {f.ResizeCommitted: "committed", f.ResizeRolledBack: "rolled_back",
                       f.Degraded: "degraded"}[type(fact)]
            old = events[fact.resize_id]
            events[fact.resize_id] = msgspec.structs.replace(old, outcome=outcome, ended_at_s=_r(fact.at))
    return list(events.values())


def guards_for(profile: Profile, overrides: Mapping[str, Any] | None = None) -> GuardConfig:
    """The profile's guards with `overrides` applied; the rollout pool keeps one engine."""
    data = msgspec.to_builtins(profile.guards)
    data.update(overrides or {})
    data["min_rollout"] = max(int(data.get("min_rollout", 1)), profile.rollout.gpus_per_engine)
    try:
        return msgspec.convert(data, GuardConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad guard setting: {exc}") from None


def simulate(
    trace: Trace,
    profile: Profile,
    policy: str,
    *,
    policy_options: Mapping[str, Any] | None = None,
    guard_overrides: Mapping[str, Any] | None = None,
    naive: bool = False,
    seed: int | None = None,
    model: StageModel | None = None,
    base: Baselines | None = None,
    verl: VerlRuns | None = None,
    verl_rules: bool = True,
    progress: Progress | None = None,
    jobs: int | None = 1,
    layout: Layout | None = None,
    origin: Profile | None = None,
    pilot_steps: int = PILOT_STEPS,
) -> SimRun:
    """Run `policy` (an installed policy name) over `trace` on `profile` in dynamic mode, and
    beside it verl's own rules from the same start, and `verl-default` from its own planned
    start (the plan search run with verl's rule from `origin`, the profile before any layout,
    by default `profile`, on the first `pilot_steps` steps). `verl`, when given, must be of the
    same model and cost mode; `verl_rules=False` skips them and leaves the report's verl fields
    0. With `jobs` > 1 verl's runs go to up to `jobs - 1` forked processes while this one
    computes the baselines and the policy's run (the same runs: the report is the same, sooner
    on several cores); `jobs=None`: as many as the machine's cores, from
    `AUTO_JOBS_FROM_GPUS` devices on."""
    model = model if model is not None else StageModel(profile, trace)
    origin = origin if origin is not None else profile
    guards = guards_for(profile, guard_overrides)
    plain = policy in VERL_RULES and not policy_options and guards == verl_guards(profile) and layout is None
    if jobs is None:
        jobs = (os.cpu_count() or 1) if profile.cluster.gpus >= AUTO_JOBS_FROM_GPUS else 1
    others = [name for name in VERL_RULES if not (plain and name == policy)]
    own = own_model = None
    if verl is None and verl_rules:
        own = verl_own_start(origin, trace, router=model.router, pilot_steps=pilot_steps)
        own_model = _own_start_model(origin, model, own)
    with contextlib.ExitStack() as stack:
        forked = None
        if own is not None and jobs > 1 and (others or own_model is not None):
            runs = [(model, name) for name in others] + ([(own_model, "verl-default")] if own_model else [])
            forked = stack.enter_context(_forked_verl(runs, naive, min(jobs - 1, len(runs))))
        base = base if base is not None else baselines(model)
        if verl is not None and plain:
            run = verl.runs[policy]
        else:
            run = DynamicPipeline(model, load_policy(policy, policy_options), guards=guards, naive=naive,
                                  progress=progress, layout=layout).run()
        if forked is not None:
            totals = forked()
            verl = VerlRuns(runs={policy: run} if plain else {}, guards=verl_guards(profile),
                            totals=dict(zip(others, totals, strict=False)), own_start=str(own),
                            own_start_total_s=totals[-1] if own_model is not None else None)
    if verl is None and verl_rules:
        verl = verl_baselines(model, naive=naive, reuse={policy: run} if plain else None, origin=origin, own=own,
                              pilot_steps=pilot_steps)
    events = _resize_events(run.facts)
    starts = [e.step for e in events]
    spacing = min((b - a for a, b in zip(starts, starts[1:], strict=False)), default=None)
    refused = [x for x in run.facts if isinstance(x, f.ProposalRejected)]
    rejections = Counter(x.guard for x in refused)
    gpus = profile.cluster.gpus
    initial_s = static_total(model, profile.initial_split)
    own = base.best_split_tp1 or base.best_split
    total = run.total_time_s
    report = SimReport(
        policy=policy,
        workload=trace.name,
        profile=profile.name,
        cost_mode="naive" if naive else "pipelined",
        seed=seed,
        gpus=gpus,
        steps=model.steps,
        samples_per_step=_r(float(model.samples.mean()), 1),
        initial_split=str(profile.initial_split),
        final_split=str(run.final_split),
        total_time_s=_r(total),
        mean_step_s=_r(total / model.steps),
        resizes=sum(e.outcome == "committed" for e in events),
        resizes_started=len(events),
        best_static=BestStatic(base.best_split.train, base.best_split.rollout, _r(base.best_static_s), base.best_tp),
        initial_split_total_time_s=_r(initial_s),
        colocated_total_time_s=_r(base.colocated_s),
        best_split_per_step_tp1_total_time_s=_r(base.oracle_s),
        lower_bound_s=_r(base.lower_bound_s),
        speedup_vs_best_static=_r(base.best_static_s / total, 4),
        speedup_vs_initial_split=_r(initial_s / total, 4),
        speedup_vs_colocated=_r(base.colocated_s / total, 4),
        gap_to_lower_bound=_r(total / base.lower_bound_s - 1.0, 4),
        headroom_vs_best_static=_r(tp1_static_s(base) / base.oracle_s, 4),
        bound_vs_best_static=_r(base.best_static_s / base.lower_bound_s, 4),
        cooldown_steps=guards.cooldown_steps,
        min_steps_between_resizes=spacing,
        rejections=dict(sorted(rejections.items())),
        rejection_reasons=dict(sorted({x.guard: x.reason for x in refused}.items())),
        policy_holds=len(run.held),
        last_hold_reason=run.held[-1][1] if run.held else "",
        resize_events=events,
        idle_ratio={p.value: None if (r := run.state.idle.pool(p).ratio) is None else _r(r, 4) for p in Pool},
        prediction_errors=[_r(x.error_s / x.predicted_step_s_after, 4) for x in run.facts
                           if isinstance(x, f.PredictionChecked)],
        prediction_mae_s={"resize": None if (m := run.state.resize_accuracy.mae_s) is None else _r(m),
                          "loan": None if (m := run.state.loan_accuracy.mae_s) is None else _r(m)},
        loans_checked=run.state.loan_accuracy.checked,
        verdicts=dict(sorted(Counter(x.verdict.value for x in run.facts if isinstance(x, f.ResizeJudged)).items())),
        router=model.router,
        best_static_round_robin=BestStatic(base.best_split_round_robin.train, base.best_split_round_robin.rollout,
                                           _r(base.best_static_round_robin_s)) if base.best_split_round_robin else None,
        speedup_vs_best_static_round_robin=_r(base.best_static_round_robin_s / total, 4),
        fluid_bound_s=_r(base.fluid_bound_s),
        gap_to_fluid_bound=_r(total / base.fluid_bound_s - 1.0, 4),
        loans=sum(isinstance(x, f.LoanLanded) for x in run.facts),
        devices_lent=sum(len(x.plan.devices) for x in run.facts if isinstance(x, f.LoanStarted)),
        loans_refused=sum(n for g, n in rejections.items() if g.startswith("loan")),
        best_static_tp1=BestStatic(own.train, own.rollout, _r(tp1_static_s(base)), base.tp1_engine),
        speedup_vs_best_static_tp1=_r(tp1_static_s(base) / total, 4),
        tp=profile.rollout.gpus_per_engine,
        start=str(start_of(profile)),
        profile_initial_split=str(origin.initial_split),
        regroups=sum(isinstance(x, f.RegroupCommitted) and x.at > 0 for x in run.facts),
        **_fluid_gap(run, base),
        **_versus_verl(verl, total),
    )
    return SimRun(report=report, run=run, model=model)


def tp1_static_s(base: Baselines) -> float:
    """The best static split of the profile's own engine size (what every TP-1 comparison is against)."""
    return base.best_static_tp1_s if base.best_split_tp1 is not None else base.best_static_s


def _versus_verl(verl: VerlRuns | None, total: float) -> dict[str, Any]:
    if verl is None:
        return {}
    dynamic, own, v1 = verl.total_s("verl-default"), verl.own_total_s(), verl.total_s("verl-v1-switch")
    return {"verl_dynamic_same_start_total_time_s": _r(dynamic),
            "speedup_vs_verl_dynamic_same_start": _r(dynamic / total, 4),
            "verl_dynamic_own_start": verl.own_start, "verl_dynamic_own_start_total_time_s": _r(own),
            "speedup_vs_verl_dynamic_own_start": _r(own / total, 4),
            "verl_v1_switch_total_time_s": _r(v1), "speedup_vs_verl_v1_switch": _r(v1 / total, 4)}


def _fluid_gap(run: DynamicRun, base: Baselines) -> dict[str, float]:
    """Split `total - fluid_bound` by which stage ended each window last."""
    if base.fluid_windows is None or len(base.fluid_windows) != len(run.windows):
        return {}
    rollout = training = 0.0
    for w, bound in zip(run.windows, base.fluid_windows, strict=True):
        excess = (w.end_s - w.start_s) - float(bound)
        if w.rollout_s >= w.train_s:
            rollout += excess
        else:
            training += excess
    return {"fluid_gap_rollout_bound_s": _r(rollout), "fluid_gap_training_bound_s": _r(training)}


def scenario_shape(profile: Profile) -> Shape:
    w = profile.workload
    return Shape(w.samples_per_step, w.samples_per_prompt, w.max_response_tokens, w.prompt_median_tokens)


BENCH_POLICIES: tuple[str, ...] = ("static", "greedy", "hysteresis", "planner", "verl-default", "verl-v1-switch")


def bench(
    profile: Profile,
    *,
    scenarios: Sequence[str] = DYNAMIC_SCENARIOS,
    policies: Sequence[str] = BENCH_POLICIES,
    seed: int = 0,
    steps: int | None = None,
    naive: bool = False,
    progress: Progress | None = None,
) -> list[SimReport]:
    """Every scenario x policy on `profile`; rows in scenario-major order."""
    rows: list[SimReport] = []
    total = len(scenarios) * len(policies)
    for i, name in enumerate(scenarios):
        trace = scenario_trace(name, scenario_shape(profile), seed=seed, steps=steps)
        model = StageModel(profile, trace)
        base = baselines(model)
        verl = verl_baselines(model, naive=naive)
        for j, policy in enumerate(policies):
            rows.append(simulate(trace, profile, policy, naive=naive, seed=seed, model=model, base=base,
                                 verl=verl).report)
            if progress is not None:
                progress(i * len(policies) + j + 1, total)
    return rows
