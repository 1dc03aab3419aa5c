"""`hysteresis`: DynaResize-style. Move devices toward the slower stage, to the allowed split
with the best predicted step time; the core's guards (threshold, run of signals, dwell,
cooldown, payback) decide whether the proposal goes ahead.

`decide_from_progress=true` (off by default) decides from the step in progress as well: one-step
off, at a boundary the next step's rollout is done, its time known from the engines' progress
reports (`ObservedView.rollout_done_s`) a window before its step report. The policy then pairs
that rollout with the training that ran beside it (the last step's) as the newest step of its
window, for the move and its doubts; the guards and the payback verdict keep reading measured
steps. Measured in the simulator (docs/results.md), it does not pay: a workload that turns is
seen one window sooner, and a noisy one moves on one window's noise.
"""

from __future__ import annotations

import msgspec

from dynaresized.core.costmodel import Measure, measure
from dynaresized.core.policy import ObservedView, Proposal, stage_split_estimate
from dynaresized.domain import Split
from dynaresized.policies.lending import Lending, checked_prior


def candidate_splits(view: ObservedView) -> tuple[Split, ...]:
    if view.candidates:
        return view.candidates
    n = view.split.total
    return tuple(Split(train=t, rollout=n - t) for t in range(1, n))


def mean_work(view: ObservedView, window: int) -> tuple[float, float, float]:
    """Mean device-seconds of rollout and training work per step, and mean sync time, over the
    last `window` steps; each step's work uses the devices that served it (lent ones included)."""
    steps = view.recent[-window:]
    rollout = train = sync = 0.0
    for t in steps:
        r_work, t_work = stage_split_estimate(t, view.split)
        rollout += r_work
        train += t_work
        sync += t.weight_sync_s
    n = max(len(steps), 1)
    return rollout / n, train / n, sync / n


def window_measure(view: ObservedView, window: int) -> Measure | None:
    """The cost model's inputs (`core.costmodel.measure`) over the last `window` steps."""
    return measure(view.recent[-window:], view.split, floor=view.tail_binds)


class HysteresisPolicy(Lending):
    name = "hysteresis"
    guarded = True

    def __init__(self, window: int = 3, max_move: int | None = None, lending: bool = True,
                 lend_trainers: bool = True, lend_engines: bool = True, tail_regroup: bool = False,
                 unmeasured_rollout_s: float = 300.0, lend_from_progress: bool = True,
                 agree: bool = True, decide_from_progress: bool = False) -> None:
        self.agrees = bool(agree)
        self.decides_from_progress = bool(decide_from_progress)
        self.lends = bool(lending)
        self.lends_from_progress = bool(lend_from_progress)
        self.unmeasured_rollout_s = checked_prior(unmeasured_rollout_s)
        self.regroups_tails = bool(tail_regroup)
        self.lends_trainers = bool(lend_trainers)
        self.lends_engines = bool(lend_engines)
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.max_move = max_move
        self.last_reason = ""  # why the last call proposed nothing (read by the simulator)

    def _doubted_by(self, view: ObservedView, target: Split, lend: float | None, grow_rollout: bool) -> str:
        """The steps of the window's latest run of steps slower on the same side (those that
        ask for this move) on which the move, predicted from that step alone, saves nothing:
        a mean over a few noisy steps predicts gains each step contradicts (iid noise of a
        stationary workload), where a real shift shows in every step of the run. "" if none."""
        if not self.agrees:
            return ""
        run = []
        for t in reversed(view.recent[-self.window:]):
            if (t.rollout_s > t.train_s) != grow_rollout:
                break
            run.append(t)
        against = [t.step for t in reversed(run)
                   if (m := measure((t,), view.split, floor=view.tail_binds)) is not None
                   and m.step_on(target, lend_after_s=lend) >= m.step_on(view.split, lend_after_s=lend)]
        return ", ".join(str(s) for s in against)

    @staticmethod
    def with_rollout_done(view: ObservedView) -> ObservedView:
        """`view` whose newest step is the rollout the engines reported done since the last step
        report, beside the last step's training (they ran in the same window); `view` itself
        where none was reported. Its devices: the rollout pool's (lent trainers not counted)."""
        if view.rollout_done_s <= 0 or view.rollout_done_step <= view.step or not view.recent:
            return view
        last = view.recent[-1]
        fresh = msgspec.structs.replace(last, step=view.rollout_done_step, rollout_s=view.rollout_done_s,
                                        rollout_devices=view.split.rollout, rollout_device_s=0.0)
        return msgspec.structs.replace(view, recent=(*view.recent, fresh))

    def __call__(self, view: ObservedView) -> Proposal | None:
        if not view.recent:
            self.last_reason = "no step observed on this split yet"
            return None
        if self.decides_from_progress:
            view = self.with_rollout_done(view)
        model = window_measure(view, self.window)
        assert model is not None
        lend = self.lend_lead_s(view, self.window)
        now = model.step_on(view.split, lend_after_s=lend)
        last = view.recent[-1]
        grow_rollout = last.rollout_s > last.train_s
        best: tuple[float, Split] | None = None
        for split in candidate_splits(view):
            moved = split.rollout - view.split.rollout
            if moved == 0 or (moved > 0) != grow_rollout:
                continue
            if self.max_move is not None and abs(moved) > self.max_move:
                continue
            after = model.step_on(split, lend_after_s=lend)
            if best is None or (after, abs(moved)) < (best[0], abs(best[1].rollout - view.split.rollout)):
                best = (after, split)
        if best is None or best[0] >= now:
            slower = "rollout" if grow_rollout else "training"
            self.last_reason = (f"{slower} is slower at step {last.step}, but no allowed split that grows it "
                                f"predicts less than {now:.1f}s per step")
            return None
        after, target = best
        slower = "rollout" if grow_rollout else "training"
        doubt = self._doubted_by(view, target, lend, grow_rollout)
        if doubt:
            self.last_reason = (f"{slower} is slower at step {last.step} and the window's mean predicts {view.split} -> "
                                f"{target} saves {now - after:.1f}s per step, but step(s) {doubt} alone predict no "
                                f"saving: within the steps' noise")
            return None
        self.last_reason = ""
        reason = (
            f"{slower} is the slower stage (rollout {last.rollout_s:.1f}s vs train {last.train_s:.1f}s at step "
            f"{last.step}); {view.split} -> {target} predicts {now:.1f}s -> {after:.1f}s per step "
            f"({model.describe()}{', trainers lent to it once trained' if lend is not None else ''})"
        )
        return Proposal(target=target, reason=reason, predicted_step_s=now, predicted_step_s_after=after)
