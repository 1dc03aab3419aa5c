"""`greedy`: every step, move devices toward the slower stage. No threshold, no run of
signals, no dwell, no cooldown, no payback (`guarded = False`; the core still enforces the
safety checks). It is the baseline that shows why the hysteresis guards exist: on a noisy
workload it thrashes."""

from __future__ import annotations

from dynaresized.policies.hysteresis import candidate_splits, window_measure

from dynaresized.core.policy import ObservedView, Proposal


class GreedyPolicy:
    name = "greedy"
    guarded = False

    def __init__(self, devices_per_move: int = 1) -> None:
        if devices_per_move < 1:
            raise ValueError("devices_per_move must be >= 1")
        self.devices_per_move = devices_per_move
        self.last_reason = ""

    def __call__(self, view: ObservedView) -> Proposal | None:
        if not view.recent:
            self.last_reason = "no step observed on this split yet"
            return None
        last = view.recent[-1]
        if last.rollout_s == last.train_s:
            self.last_reason = f"step {last.step}: rollout and training took the same time"
            return None
        grow_rollout = last.rollout_s > last.train_s
        sign = 1 if grow_rollout else -1
        # The allowed split nearest to one move toward the slower stage, in that direction.
        options = [s for s in candidate_splits(view) if (s.rollout - view.split.rollout) * sign > 0]
        if not options:
            slower = "rollout" if grow_rollout else "training"
            self.last_reason = f"{slower} is slower but no allowed split gives it more devices"
            return None
        target = min(options, key=lambda s: (abs(abs(s.rollout - view.split.rollout) - self.devices_per_move),
                                              abs(s.rollout - view.split.rollout)))
        model = window_measure(view, 1)
        assert model is not None
        now = model.step_on(view.split)
        after = model.step_on(target)
        slower = "rollout" if grow_rollout else "training"
        self.last_reason = ""
        return Proposal(
            target=target,
            reason=(f"{slower} was slower at step {last.step} (rollout {last.rollout_s:.1f}s vs train "
                    f"{last.train_s:.1f}s): {view.split} -> {target}"),
            predicted_step_s=now,
            predicted_step_s_after=after,
        )

