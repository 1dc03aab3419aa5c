"""`planner`: ReaL-style. Fit a cost model of each stage from observed step timings, predict
the step time of every allowed split, charge the resize cost amortised over a horizon, and
propose the best split.

The model (docs/simulator.md, "The planner"): a stage on n devices takes

    t(n) = level * scale * (a / n + b)

`scale` is the step's response tokens (so a workload that grows or shrinks moves the
prediction with it), `a / n` is the part that parallelises over the pool and `b` the part that
does not (the rollout's long tail, the trainer's fixed overhead and communication). `a` and
`b` are fitted per stage by weighted least squares on (1/n, t/scale) over the steps seen so
far, newer steps weighing more (half-life `half_life_steps`), with a small ridge penalty on `b`:
while only one pool size has been seen the fit is the linear-scaling model (b = 0), and `b`
is learned once a resize has shown how the stage scales. `level` is the ratio of the last three
observed stage times to the fit's prediction for them, so the fit gives the shape over pool
sizes and the latest steps give the level. It fits on `view.history`, the core's window of steps
across resizes (restored by replay after a daemon restart), so the planner keeps no state of
its own: its proposals are a pure function of the view.

A move's cost is the planner's prediction of the mixed step it causes (the moving devices
serve neither pool until the commit), amortised over `horizon_steps` (or the steps left).
The core's payback guard still checks the proposal against the core's own cost estimate.
"""

from __future__ import annotations

import math

import msgspec
from dynaresized.policies.hysteresis import candidate_splits
from dynaresized.policies.lending import Lending, checked_prior

from dynaresized.core.policy import ObservedView, Proposal
from dynaresized.domain import Split, StepTiming


class StageFit(msgspec.Struct, frozen=True):
    """t(n) = scale * (a / n + b), fitted from `points` observations over `sizes` pool sizes."""

    a: float
    b: float
    points: int
    sizes: int

    def seconds(self, devices: float, scale: float) -> float:
        if devices <= 0:
            return math.inf
        return scale * (self.a / devices + self.b)


def fit_stage(xs: list[float], ys: list[float], ws: list[float], ridge: float) -> StageFit:
    """Weighted least squares of y = a x + b with `ridge * sum(w) * b^2` added; a, b >= 0."""
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs, strict=True))
    sy = sum(w * y for w, y in zip(ws, ys, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
    sizes = len(set(xs))
    det = sxx * sw * (1.0 + ridge) - sx * sx
    a = b = 0.0
    if det > 1e-12 * max(sxx * sw, 1e-300):
        a = (sxy * sw * (1.0 + ridge) - sx * sy) / det
        b = (sxx * sy - sx * sxy) / det
    else:
        b = -1.0  # degenerate: fall through to b = 0
    if b < 0.0:
        b = 0.0
        a = sxy / sxx if sxx > 0 else 0.0
    if a < 0.0:
        a = 0.0
        b = sy / (sw * (1.0 + ridge)) if sw > 0 else 0.0
    return StageFit(a=a, b=b, points=len(xs), sizes=sizes)


class PlannerPolicy(Lending):
    name = "planner"
    guarded = True

    def __init__(
        self,
        memory_steps: int = 256,
        half_life_steps: float = 25.0,
        horizon_steps: int = 50,
        min_gain: float = 0.03,
        ridge: float = 0.001,
        lending: bool = True,
        lend_trainers: bool = True,
        lend_engines: bool = True,
        unmeasured_rollout_s: float = 300.0,
        lend_from_progress: bool = True,
    ) -> None:
        self.lends = bool(lending)
        self.lends_from_progress = bool(lend_from_progress)
        self.unmeasured_rollout_s = checked_prior(unmeasured_rollout_s)
        self.lends_trainers = bool(lend_trainers)
        self.lends_engines = bool(lend_engines)
        if memory_steps < 2 or half_life_steps <= 0 or horizon_steps < 1 or min_gain < 0 or ridge < 0:
            raise ValueError("planner options: memory_steps >= 2, half_life_steps > 0, horizon_steps >= 1, "
                             "min_gain >= 0, ridge >= 0")
        self.memory_steps = memory_steps
        self.half_life_steps = half_life_steps
        self.horizon_steps = horizon_steps
        self.min_gain = min_gain
        self.ridge = ridge
        self.last_reason = ""

    # -- the model ----------------------------------------------------------------------
    def _remember(self, view: ObservedView) -> list[StepTiming]:
        """The steps to fit on: the view's history (its recent window if it has no history),
        only those that say which pool sizes they ran on."""
        steps = view.history or view.recent
        usable = [t for t in steps if t.rollout_devices > 0 and t.train_devices > 0]
        return usable[-self.memory_steps:]

    @staticmethod
    def _scale(t: StepTiming) -> float:
        return float(t.response_tokens) if t.response_tokens > 0 else 1.0

    def fit(self, seen: list[StepTiming]) -> tuple[StageFit, StageFit]:
        latest = seen[-1].step
        ws = [0.5 ** ((latest - t.step) / self.half_life_steps) for t in seen]
        scales = [self._scale(t) for t in seen]
        rollout = fit_stage([1.0 / t.rollout_devices_served for t in seen],
                            [t.rollout_s / s for t, s in zip(seen, scales, strict=True)], ws, self.ridge)
        train = fit_stage([1.0 / t.train_devices_served for t in seen],
                          [t.train_s / s for t, s in zip(seen, scales, strict=True)], ws, self.ridge)
        return rollout, train

    def __call__(self, view: ObservedView) -> Proposal | None:
        seen = self._remember(view)
        if not seen:
            self.last_reason = "no step observed yet"
            return None
        horizon = self.horizon_steps if view.steps_remaining is None else min(self.horizon_steps,
                                                                              view.steps_remaining)
        if horizon < 1:
            self.last_reason = "no steps left to pay a resize back"
            return None
        rollout, train = self.fit(seen)
        last = seen[-3:]
        scale = sum(self._scale(t) for t in last) / len(last)
        sync = sum(t.weight_sync_s for t in last) / len(last)
        # The fit gives each stage's shape over pool sizes; its level is anchored on the last
        # few steps, so a drifting workload is tracked within a few steps.
        level_r = sum(t.rollout_s for t in last) / max(
            sum(rollout.seconds(t.rollout_devices_served, self._scale(t)) for t in last), 1e-12)
        level_t = sum(t.train_s for t in last) / max(
            sum(train.seconds(t.train_devices_served, self._scale(t)) for t in last), 1e-12)

        def predict(split: Split) -> float:
            return max(level_r * rollout.seconds(split.rollout, scale),
                       level_t * train.seconds(split.train, scale)) + sync

        def resize_cost(split: Split) -> float:
            # While devices move they serve neither pool: for one step the source pool is
            # already small and the destination not yet grown. That step's excess over the
            # new split is what the move costs on the critical path.
            if split == view.split:
                return 0.0
            mixed = Split(train=min(split.train, view.split.train), rollout=min(split.rollout, view.split.rollout))
            return max(predict(mixed) - predict(split), 0.0)

        now = predict(view.split)
        scored = []
        for split in candidate_splits(view):
            moved = abs(split.train - view.split.train)
            scored.append((predict(split) + resize_cost(split) / horizon, moved, split))
        score, _, target = min(scored)
        model = (f"rollout ~ tokens x ({rollout.a:.3g}/n + {rollout.b:.3g}) [{rollout.sizes} pool size(s)], "
                 f"training ~ tokens x ({train.a:.3g}/n + {train.b:.3g}) [{train.sizes}]")
        if target == view.split or now - score < self.min_gain * now:
            self.last_reason = (f"planner: {view.split} predicted {now:.1f}s/step is within {self.min_gain:.0%} "
                                f"of the best split once resize cost is amortised over {horizon} steps; {model}")
            return None
        after = predict(target)
        cost = resize_cost(target)
        self.last_reason = ""
        return Proposal(
            target=target,
            reason=(f"planner: {view.split} -> {target} predicts {now:.1f}s -> {after:.1f}s per step "
                    f"(resize ~{cost:.0f}s over {horizon} steps); {model}"),
            predicted_step_s=now,
            predicted_step_s_after=after,
        )
