"""`greedy`: one device toward the slower stage, every step, with no guard."""

from __future__ import annotations

from dynaresized.core.policy import ObservedView, ResizeCosts, load_policy
from dynaresized.domain import Split, StepTiming


def view(split: Split, rollout_s: float, train_s: float, candidates: tuple[Split, ...] = ()) -> ObservedView:
    timing = StepTiming(step=3, rollout_s=rollout_s, train_s=train_s, rollout_devices=split.rollout,
                        train_devices=split.train)
    return ObservedView(now=100.0, step=3, split=split, candidates=candidates, recent=(timing,), costs=ResizeCosts())


def test_greedy_is_registered_and_unguarded():
    policy = load_policy("greedy")
    assert policy.name == "greedy" and policy.guarded is False


def test_moves_one_device_toward_the_slower_stage():
    policy = load_policy("greedy")
    grow_rollout = policy(view(Split(6, 2), rollout_s=101.0, train_s=100.0))
    assert grow_rollout is not None and grow_rollout.target == Split(5, 3)
    assert "rollout was slower at step 3" in grow_rollout.reason
    grow_training = policy(view(Split(4, 4), rollout_s=10.0, train_s=100.0))
    assert grow_training is not None and grow_training.target == Split(5, 3)
    assert grow_training.predicted_step_s_after < grow_training.predicted_step_s


def test_respects_allowed_splits_and_says_why_it_holds():
    policy = load_policy("greedy")
    only = (Split(6, 2), Split(2, 6))
    assert policy(view(Split(6, 2), 200.0, 100.0, only)).target == Split(2, 6)
    assert policy(view(Split(2, 6), 200.0, 100.0, only)) is None
    assert "no allowed split" in policy.last_reason
    assert policy(view(Split(4, 4), 50.0, 50.0)) is None
    assert "same time" in policy.last_reason


def test_devices_per_move_option():
    policy = load_policy("greedy", {"devices_per_move": 2})
    assert policy(view(Split(6, 2), 200.0, 100.0)).target == Split(4, 4)
