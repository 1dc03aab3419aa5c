"""ReaL's plan search on the simulator's cost model: which configuration to run, per phase.

A configuration is a split of the devices, the size of each rollout engine (its tensor-parallel
degree, one of the profile's `tp_sizes`) and the trainer's layout. The trainer is data parallel
(ZeRO/FSDP) on every training device: the cost model has no calibrated tensor- or pipeline-
parallel trainer, so the search offers no other training layout (docs/simulator.md, "The plan
search").

A phase is a run of steps whose response lengths are alike (`phases`). For each phase the search
predicts every configuration's time from the phase's first `pilot_steps` steps (what a pilot
run, or the phase's first steps, shows) and keeps the fastest; `PhasePlan` then holds that
prediction next to the configuration simulated over the whole phase.

Three searches, all on the same cost model (`static_total` of a configuration on the pilot):
"exhaustive" simulates every configuration (spaces of at most `EXHAUSTIVE_MAX`); "bound" is an
exact branch and bound, configurations in increasing order of `static_floor` (a time no run of
them beats) simulated until the next floor exceeds the best time found (at most `BOUND_MAX`);
above that, "mcmc" is ReaL's search, a Metropolis chain over configurations that simulates at
most `MCMC_BUDGET` of them. Exhaustive and bound return the same plan (a test checks it); MCMC
is not exact, and `benchmarks/plan_search.py` measures how often it finds the bound's best.

`start_plan` (and `plan_start`) picks where a dynamic run starts: the static search's best few
configurations, each run with the policy over the pilot, the fastest kept. The static plan's
first configuration and that start can differ (5:3/TP-1 the fastest held still, 4:4/TP-4 the
fastest with loans): `dynaresized plan` prints both, and `simulate` starts from the second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import Policy
from dynaresized.domain import Split
from dynaresized.sim.pipeline import DynamicPipeline, best_static, static_floor, static_total, static_windows
from dynaresized.sim.profile import Profile
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import Trace

EXHAUSTIVE_MAX = 64
"""Spaces of at most this many configurations are searched by simulating every one."""

BOUND_MAX = 256
"""Spaces of at most this many configurations are searched by the exact branch and bound."""

MCMC_BUDGET = 64
"""Configurations the MCMC search simulates at most."""

MCMC_PROPOSALS = 4096
MCMC_TEMPERATURE = 0.01
"""The chain's temperature, a share of the current configuration's time."""

PILOT_STEPS = 10
"""Steps of each phase the prediction sees."""

REPLAN_MARGIN = 2.0
"""A re-plan regroups only when the saving it predicts over the steps left is this many times
the regroup's own seconds (the hysteresis of a layout change)."""

PHASE_TOLERANCE = 0.1
"""A window whose mean or 90th-percentile response length is this far (relative) from its
phase's first window's opens a new phase. At 0.2 the prediction of `shrinking` is 7% off (its
lengths fall up to 20% inside a phase the pilot saw the start of); at 0.1 every built-in
scenario's is within 3.4% (docs/simulator.md, "The plan search")."""


class Config(msgspec.Struct, frozen=True, order=True):
    """A fixed configuration: `train` devices of data-parallel trainers, `rollout` devices in
    engines of `tp` devices each."""

    train: int
    rollout: int
    tp: int

    @property
    def split(self) -> Split:
        return Split(self.train, self.rollout)

    def __str__(self) -> str:
        return f"{self.train}:{self.rollout}/TP-{self.tp}"

    @staticmethod
    def parse(text: str) -> Config:
        """`"4:4/TP-2"` -> Config(4, 4, 2)."""
        split, tp = text.split("/TP-")
        train, rollout = split.split(":")
        return Config(int(train), int(rollout), int(tp))


class Search(msgspec.Struct, frozen=True):
    best: Config
    predicted_s: float
    """The best configuration's time on the model searched (the pilot)."""
    method: str
    """"exhaustive", "bound" (the exact branch and bound) or "mcmc"."""
    space: int
    simulated: int
    """Configurations simulated: every one (exhaustive), those the bound did not prune, or
    those the chain visited (MCMC)."""
    search_s: float
    ranked: tuple[tuple[float, Config], ...]
    """The simulated configurations, fastest first."""


class PhasePlan(msgspec.Struct, frozen=True):
    start: int
    """First step of the phase."""
    steps: int
    config: str
    predicted_s: float
    """The phase's time predicted from its first `pilot_steps` steps, scaled to its length."""
    simulated_s: float
    """The configuration simulated over the whole phase."""
    prediction_error: float
    """predicted_s / simulated_s - 1."""
    method: str
    space: int
    simulated_configs: int
    search_s: float


class StartCandidate(msgspec.Struct, frozen=True):
    config: str
    static_pilot_s: float
    """The configuration held still over the pilot (the static search's figure)."""
    dynamic_pilot_s: float
    """The policy run from it over the pilot."""


class StartPlan(msgspec.Struct, frozen=True):
    """Where `simulate` starts a policy (`start_plan`), and what the pilot predicts for it."""

    policy: str
    planned_start: str
    """The configuration `simulate --layout plan` (the default) starts the policy from: of the
    `candidates` (the static search's fastest few on the pilot), the one the policy ran fastest
    from over the pilot."""
    pilot_steps: int
    planned_start_pilot_s: float
    """The policy from `planned_start` over the pilot."""
    predicted_dynamic_total_s: float
    """The policy from `planned_start` over the whole trace, predicted from its pilot run's
    windows (`extrapolate`), as the static plan's phases are predicted from theirs."""
    best_static: str
    """The fastest static configuration of the pilot (the static plan's first configuration,
    where the first phase is at least a pilot long)."""
    best_static_predicted_total_s: float
    """`best_static` held still over the whole trace, predicted from its pilot windows."""
    candidates: list[StartCandidate]
    steps: int
    """Steps of the trace the totals are predicted for."""


class Plan(msgspec.Struct, frozen=True):
    profile: str
    workload: str
    gpus: int
    pilot_steps: int
    phases: list[PhasePlan]
    predicted_total_s: float
    simulated_total_s: float
    """The run simulated with each phase on its configuration, plus `change_s`."""
    prediction_error: float
    """predicted_total_s / simulated_total_s - 1."""
    search_s: float
    changes: int = 0
    """Phase boundaries where the configuration changes."""
    change_s: float = 0.0
    """Seconds charged for those changes (`change_seconds`), in both totals."""
    start: StartPlan | None = None
    """Where `simulate` starts a policy on this trace (`dynaresized plan` fills it in)."""


def change_seconds(profile: Profile, a: Config, b: Config) -> float:
    """What changing configuration `a` to `b` at a step boundary adds to the run: a regroup of
    the rollout pool when the engine size changes (every op of `[resize.regroup]` and the new
    engines' first step: the pool serves nothing meanwhile), and a resize's commit and its
    destination's first step when the split changes (its other ops overlap the window, as in a
    pipelined resize)."""
    seconds = 0.0
    if a.tp != b.tp:
        seconds += profile.resize.regroup.sequence_s()
    if a.split != b.split:
        c = profile.resize.to_rollout if b.rollout > a.rollout else profile.resize.to_training
        seconds += c.commit_s + c.first_step_s
    return seconds


def space(model: StageModel, gpus: int, candidates: Sequence[Split] = ()) -> list[Config]:
    """Every configuration of `gpus` devices: at least one training device, the rollout pool in
    whole engines of each allowed size (`candidates`, when given, restricts the splits)."""
    allowed = {(s.train, s.rollout) for s in candidates}
    out = []
    for tp in model.profile.rollout.engine_sizes():
        for rollout in range(tp, gpus, tp):
            if not allowed or (gpus - rollout, rollout) in allowed:
                out.append(Config(gpus - rollout, rollout, tp))
    return out


def search(model: StageModel, gpus: int, *, candidates: Sequence[Split] = (), method: str | None = None,
           budget: int = MCMC_BUDGET, seed: int = 0) -> Search:
    """The fastest static configuration of `model`'s trace (ties: the smaller training pool,
    then the smaller engines). `method`: "exhaustive", "bound" or "mcmc"; by default
    exhaustive up to `EXHAUSTIVE_MAX` configurations, the exact bound up to `BOUND_MAX`, MCMC
    (at most `budget` configurations simulated) above."""
    t0 = time.perf_counter()
    configs = space(model, gpus, candidates)
    if not configs:
        raise ValueError(f"no configuration of {gpus} devices leaves room for one rollout engine")
    if method is None:
        method = "exhaustive" if len(configs) <= EXHAUSTIVE_MAX else "bound" if len(configs) <= BOUND_MAX else "mcmc"
    if method not in ("exhaustive", "bound", "mcmc"):
        raise ValueError(f"unknown search method {method!r}: exhaustive, bound or mcmc")

    def total(c: Config) -> float:
        return static_total(model.at_tp(c.tp), c.split)

    ranked: list[tuple[float, Config]] = []
    if method == "exhaustive":
        ranked = [(total(c), c) for c in configs]
    elif method == "bound":
        best = np.inf
        for floor, c in sorted((static_floor(model.at_tp(c.tp), c.split), c) for c in configs):
            if floor > best:
                break
            ranked.append((total(c), c))
            best = min(best, ranked[-1][0])
    else:
        ranked = _mcmc(model, configs, total, budget, seed)
    ranked.sort()
    return Search(best=ranked[0][1], predicted_s=ranked[0][0], method=method, space=len(configs),
                  simulated=len(ranked), search_s=time.perf_counter() - t0, ranked=tuple(ranked))


def _mcmc(model: StageModel, configs: list[Config], total: Callable[[Config], float], budget: int,
          seed: int) -> list[tuple[float, Config]]:
    """ReaL's search: a Metropolis chain over configurations, the cost its simulated time at a
    temperature of `MCMC_TEMPERATURE` of the current cost. A move changes the rollout pool by
    a power of two engines either way, or the engine size (the pool rounded to whole engines).
    It starts at the configuration of least `static_floor`, and a proposal whose floor already
    exceeds what the acceptance draw allows is refused without simulating it (the floor bounds
    its time from below, so the chain is the same as if it had been simulated). It stops after
    `budget` simulations or `MCMC_PROPOSALS` proposals."""
    rng = np.random.default_rng(seed)
    gpus = configs[0].train + configs[0].rollout
    index = {(c.tp, c.rollout): c for c in configs}
    floors = {c: static_floor(model.at_tp(c.tp), c.split) for c in configs}
    sizes = sorted({c.tp for c in configs})
    seen: dict[Config, float] = {}

    def cost(c: Config) -> float:
        if c not in seen:
            seen[c] = total(c)
        return seen[c]

    current = min(configs, key=lambda c: (floors[c], c))
    here = cost(current)
    for _ in range(MCMC_PROPOSALS):
        if len(seen) >= budget:
            break
        if len(sizes) > 1 and rng.random() < 0.25:
            tp = int(rng.choice([k for k in sizes if k != current.tp]))
            rollout = max(tp, min(round(current.rollout / tp) * tp, (gpus - 1) // tp * tp))
        else:
            tp = current.tp
            step = tp * 2 ** int(rng.integers(0, max(1, int(np.log2(gpus / tp)))))
            rollout = current.rollout + (step if rng.random() < 0.5 else -step)
        proposal = index.get((tp, rollout))
        if proposal is None or proposal == current:
            continue
        # accept iff cost < here - T ln u; a floor at or above that refuses without simulating
        limit = here - MCMC_TEMPERATURE * here * float(np.log(1.0 - rng.random()))
        if floors[proposal] >= limit:
            continue
        c = cost(proposal)
        if c < limit:
            current, here = proposal, c
    return [(t, c) for c, t in seen.items()]


def phases(trace: Trace, *, window: int = 10, tolerance: float = PHASE_TOLERANCE) -> list[tuple[int, int]]:
    """(start, end) of each phase: the trace cut into windows of `window` steps; a window opens
    a new phase when its mean or 90th-percentile response length differs from those of its
    phase's first window by more than `tolerance` (relative)."""
    n = len(trace)
    if window < 1:
        raise ValueError(f"a phase window needs at least one step, got {window}")
    stats = []
    for a in range(0, n, window):
        lengths = np.concatenate([b.response_tokens for b in trace.steps[a:a + window]]).astype(np.float64)
        stats.append((a, float(lengths.mean()), float(np.percentile(lengths, 90))))
    cuts = [0]
    ref = stats[0][1:]
    for a, mean, p90 in stats[1:]:
        if abs(mean / ref[0] - 1.0) > tolerance or abs(p90 / ref[1] - 1.0) > tolerance:
            cuts.append(a)
            ref = (mean, p90)
    return [(a, b) for a, b in zip(cuts, [*cuts[1:], n], strict=True)]


def extrapolate(windows: np.ndarray, steps: int, *, first: bool = True, last: bool = True) -> float:
    """The time of a phase of `steps` steps predicted from its pilot's windows (`static_windows`
    of the pilot's steps): each of the phase's windows at the pilot's mean steady window, the
    run's first window (the rollout alone: `first`) and its last (the training alone: `last`)
    as the pilot measured them. (A linear trend fitted to the pilot predicts drifting phases
    better and noisy ones far worse.)"""
    k = len(windows) - 1
    inner = windows[1:k]
    mean = float(inner.mean()) if len(inner) else float(windows[0])
    return float((windows[0] if first else mean) + mean * (steps - 1) + (windows[k] if last else 0.0))


def _segment(trace: Trace, start: int, end: int) -> Trace:
    return Trace(trace.name, trace.steps[start:end])


def plan(profile: Profile, trace: Trace, *, router: str = "pull", pilot_steps: int = PILOT_STEPS,
         window: int = 10, tolerance: float = PHASE_TOLERANCE, method: str | None = None) -> Plan:
    """The per-phase plan of `trace` on `profile`: each phase's configuration searched on its
    pilot, and checked against the run simulated with those configurations.

    The simulated run is spliced from each chosen configuration's static windows over the whole
    trace: a phase's windows are those whose rollout is one of its steps (the window where the
    configuration changes overlaps the previous step's training, charged to the new one), the
    last window (the last step's training) to the last phase. Within a phase that is exact; each
    change of configuration adds what `change_seconds` says (a regroup, a resize) to both totals."""
    if pilot_steps < 1:
        raise ValueError(f"a pilot needs at least one step, got pilot_steps={pilot_steps}")
    gpus = profile.cluster.gpus
    candidates = profile.candidate_splits()
    whole = StageModel(profile, trace, router=router)
    windows: dict[Config, np.ndarray] = {}
    cut = phases(trace, window=window, tolerance=tolerance)
    out = []
    for i, (start, end) in enumerate(cut):
        steps = end - start
        pilot = StageModel(profile, _segment(trace, start, start + min(pilot_steps, steps)), router=router)
        found = search(pilot, gpus, candidates=candidates, method=method)
        c = found.best
        first, last = i == 0, i == len(cut) - 1
        predicted = extrapolate(static_windows(pilot.at_tp(c.tp), c.split), steps, first=first, last=last)
        if c not in windows:
            windows[c] = static_windows(whole.at_tp(c.tp), c.split)
        simulated = float(windows[c][start:end].sum() + (windows[c][-1] if last else 0.0))
        out.append(PhasePlan(start=start, steps=steps, config=str(c), predicted_s=round(predicted, 3),
                             simulated_s=round(simulated, 3), prediction_error=round(predicted / simulated - 1.0, 4),
                             method=found.method, space=found.space, simulated_configs=found.simulated,
                             search_s=round(found.search_s, 4)))
    configs = [Config.parse(p.config) for p in out]
    change_s = sum(change_seconds(profile, a, b) for a, b in zip(configs, configs[1:], strict=False))
    predicted_total = sum(p.predicted_s for p in out) + change_s
    simulated_total = sum(p.simulated_s for p in out) + change_s
    return Plan(profile=profile.name, workload=trace.name, gpus=gpus, pilot_steps=pilot_steps, phases=out,
                predicted_total_s=round(predicted_total, 3), simulated_total_s=round(simulated_total, 3),
                prediction_error=round(predicted_total / simulated_total - 1.0, 4),
                search_s=round(sum(p.search_s for p in out), 4),
                changes=sum(a != b for a, b in zip(configs, configs[1:], strict=False)), change_s=round(change_s, 3))


def start_plan(profile: Profile, trace: Trace, make_policy: Callable[[], Policy], guards: GuardConfig, *,
               router: str = "pull", pilot_steps: int = PILOT_STEPS, top: int = 4, policy: str = "") -> StartPlan:
    """Where a dynamic run starts: the `top` fastest static configurations of the first
    `pilot_steps` steps, each run with the policy (`make_policy()` gives a fresh one) from that
    configuration over those steps; the fastest (ties: the smaller configuration), with the
    pilot's prediction for the whole trace beside the best static configuration's. `policy`
    names the policy in the result."""
    pilot_trace = trace.head(pilot_steps)
    pilot = StageModel(profile, pilot_trace, router=router)
    found = search(pilot, profile.cluster.gpus, candidates=profile.candidate_splits())
    best: tuple[float, Config, np.ndarray] | None = None
    candidates = []
    for static_s, c in found.ranked[:top]:
        p = profile.with_layout(c.tp, c.split)
        g = msgspec.structs.replace(guards, min_rollout=max(guards.min_rollout, c.tp))
        run = DynamicPipeline(StageModel(p, pilot_trace, router=router), make_policy(), guards=g).run()
        candidates.append(StartCandidate(str(c), round(static_s, 3), round(run.total_time_s, 3)))
        if best is None or (run.total_time_s, c) < best[:2]:
            best = (run.total_time_s, c, np.array([w.end_s - w.start_s for w in run.windows]))
    assert best is not None
    steps = len(trace)
    first = found.best
    static = static_windows(pilot.at_tp(first.tp), first.split)
    return StartPlan(policy=policy, planned_start=str(best[1]), pilot_steps=len(pilot_trace),
                     planned_start_pilot_s=best[0], predicted_dynamic_total_s=round(extrapolate(best[2], steps), 3),
                     best_static=str(first), best_static_predicted_total_s=round(extrapolate(static, steps), 3),
                     candidates=candidates, steps=steps)


def plan_start(profile: Profile, trace: Trace, make_policy: Callable[[], Policy], guards: GuardConfig, *,
               router: str = "pull", pilot_steps: int = PILOT_STEPS, top: int = 4) -> tuple[Config, float]:
    """`start_plan`'s start and its pilot seconds."""
    found = start_plan(profile, trace, make_policy, guards, router=router, pilot_steps=pilot_steps, top=top)
    return Config.parse(found.planned_start), found.planned_start_pilot_s


class Replanner:
    """ReaL's plan search during a run, with no hindsight: every `every` steps, the search
    (`search`) runs again on the last `pilot_steps` steps generated, and when the fastest
    configuration's engines are of another size than the run's, the rollout pool is regrouped
    into them, if the predicted saving over the steps left exceeds `margin` times what the
    regroup costs (`[resize.regroup]`). The split stays the policy's. A `DynamicPipeline`
    layout advisor (`pipeline.Layout`)."""

    def __init__(self, profile: Profile, trace: Trace, *, router: str = "pull", pilot_steps: int = PILOT_STEPS,
                 every: int = PILOT_STEPS, margin: float = REPLAN_MARGIN, confirm: int = 1) -> None:
        if pilot_steps < 1 or every < 1:
            raise ValueError(f"re-planning needs pilot_steps >= 1 and every >= 1, got {pilot_steps} and {every}")
        self.profile, self.trace, self.router = profile, trace, router
        self.pilot_steps, self.every, self.margin = pilot_steps, every, margin
        self.searches: list[tuple[int, str, float]] = []  # (step, best configuration, search seconds)
        self.confirm = confirm
        self._streak: tuple[int, int] = (0, 0)  # (engine size advised, times in a row)

    def __call__(self, step: int, tp: int) -> tuple[int, str] | None:
        seen = step + 1  # rollouts 0..step are generated
        left = len(self.trace) - seen
        if seen < self.pilot_steps or seen % self.every or left < 1:
            return None
        gpus = self.profile.cluster.gpus
        pilot = StageModel(self.profile, Trace(self.trace.name, self.trace.steps[seen - self.pilot_steps:seen]),
                           router=self.router)
        found = search(pilot, gpus, candidates=self.profile.candidate_splits())
        self.searches.append((step, str(found.best), found.search_s))
        if found.best.tp == tp:
            return None
        here = min((t for t, c in found.ranked if c.tp == tp), default=None)
        if here is None:  # pruned by the bound, or no split of this size: its best, exactly
            here = best_static(pilot.at_tp(tp), gpus)[1]
        saving = (here - found.predicted_s) / self.pilot_steps * left
        cost = self.profile.resize.regroup.sequence_s()
        if saving <= self.margin * cost:
            self._streak = (tp, 0)
            return None
        streak = self._streak[1] + 1 if self._streak[0] == found.best.tp else 1
        self._streak = (found.best.tp, streak)
        if streak < self.confirm:
            return None
        return found.best.tp, (f"re-planned on steps {seen - self.pilot_steps}-{step}: {found.best} "
                               f"saves {saving:.0f} s over the {left} steps left, against {cost:.0f} s to regroup")
