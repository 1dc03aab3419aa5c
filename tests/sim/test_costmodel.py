"""The policy's cost model (`core.costmodel`) against the simulator's request-level
`StageModel`: fed only with what a router measures of one step (its rollout seconds on its pool,
its response lengths and the longest response's seconds per token), it predicts the step's
rollout on another pool."""

from __future__ import annotations

import math

import pytest

from dynaresized.core.costmodel import FLOOR, LINEAR, measure, predicted_step_s, tail_binds
from dynaresized.domain import PipelineSpec, ResponseLengths, Split, StepTiming
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import scenario_trace


def _model(scenario: str, gpus: int, steps: int = 6) -> StageModel:
    profile = load_profile("qwen3-8b-h20x8").with_gpus(gpus)
    return StageModel(profile, scenario_trace(scenario, scenario_shape(profile), seed=0, steps=steps))


def _timing(model: StageModel, step: int, split: Split, *, lengths: bool = True) -> StepTiming:
    return StepTiming(step=step, rollout_s=model.rollout_seconds(step, split.rollout),
                      train_s=model.train_seconds(step, split.train), rollout_devices=split.rollout,
                      train_devices=split.train, lengths=model.lengths(step) if lengths else None)


@pytest.mark.parametrize("scenario,gpus,before,after", [
    ("longtail-stationary", 256, 192, 240),  # issue 43: the measured rollout is mostly the floor
    ("longtail-stationary", 64, 32, 48),
    ("noisy", 64, 40, 56),
])
def test_the_floor_model_predicts_the_request_level_rollout_where_the_linear_one_does_not(
        scenario: str, gpus: int, before: int, after: int) -> None:
    model = _model(scenario, gpus)
    here, there = Split(train=gpus - before, rollout=before), Split(train=gpus - after, rollout=after)
    floor_errors, linear_errors = [], []
    for step in range(model.steps):
        truth = model.rollout_seconds(step, after)
        floor = measure([_timing(model, step, here)], here)
        linear = measure([_timing(model, step, here, lengths=False)], here)
        assert floor is not None and floor.model == FLOOR and linear is not None and linear.model == LINEAR
        # the floor is what the simulator's longest request takes alone
        assert floor.floor_s == pytest.approx(float(model.longest_request_s[step]))
        # both reproduce the pool they were measured on
        assert floor.rollout_on(before) == pytest.approx(model.rollout_seconds(step, before))
        floor_errors.append(abs(floor.rollout_on(after) / truth - 1.0))
        linear_errors.append(abs(linear.rollout_on(after) / truth - 1.0))
    assert max(floor_errors) < 0.10 and sum(floor_errors) / len(floor_errors) < 0.05, floor_errors
    assert sum(floor_errors) < sum(linear_errors) / 2, (floor_errors, linear_errors)


def test_a_step_with_trainers_lent_once_trained_predicts_a_shorter_rollout_only_while_its_queue_lasts() -> None:
    t = StepTiming(step=0, rollout_s=300.0, train_s=50.0, rollout_devices=4, train_devices=4,
                   lengths=ResponseLengths(quantiles=(100, 400, 900, 1000), token_s=0.1))  # F = 100 s
    m = measure([t], Split(4, 4))
    assert m is not None and m.floor_s == pytest.approx(100.0)
    assert m.rollout_on(4) == pytest.approx(300.0) and m.rollout_on(8) == pytest.approx(200.0)
    # 800 device-seconds above the floor; 4 trainers join at 50 + 10 s: (800 + 4 * 60) / 8 = 130
    assert m.rollout_with_loans(4, 4, 60.0) == pytest.approx(100.0 + 130.0)
    assert m.rollout_with_loans(4, 4, 250.0) == pytest.approx(300.0)  # the queue was empty by then
    assert m.step_on(Split(4, 4), lend_after_s=10.0) == pytest.approx(230.0)
    assert m.step_on(Split(4, 4)) == pytest.approx(300.0)
    assert predicted_step_s([t], Split(4, 4), Split(2, 6)) == pytest.approx(100.0 + 200.0 * 4 / 6 + 0.0)
    assert math.isinf(predicted_step_s([], Split(4, 4), Split(2, 6)))
    assert math.isinf(m.step_on(Split(8, 0)))


def test_bad_lengths_are_named() -> None:
    assert ResponseLengths(quantiles=(1, 2, 3, 4), token_s=0.5).problem() is None
    assert "4, the response tokens" in (ResponseLengths(quantiles=(1, 2, 3)).problem() or "")
    assert "non-decreasing" in (ResponseLengths(quantiles=(1, 5, 3, 9)).problem() or "")
    assert "non-negative" in (ResponseLengths(quantiles=(-1, 5, 6, 9)).problem() or "")
    assert "finite" in (ResponseLengths(quantiles=(1, 2, 3, 4), token_s=float("nan")).problem() or "")


def test_where_the_pipeline_carries_the_tail_over_no_floor_binds_a_step() -> None:
    """verl's fully-async pipeline with partial rollout: the longest response goes on under the
    next weights, so the rollout is predicted without its floor even where steps report lengths
    (the daemon's `[pipeline]`, `ObservedView.tail_binds`); every other pipeline keeps it."""
    assert tail_binds(PipelineSpec())
    assert tail_binds(PipelineSpec(mode="fully-async", staleness=0.5))
    assert tail_binds(PipelineSpec(mode="synchronous", staleness=0.0))
    assert not tail_binds(PipelineSpec(mode="fully-async", staleness=0.5, partial_rollout=True, sync_every=4))
    model = _model("longtail-stationary", 64)
    here = Split(train=32, rollout=32)
    steps = [_timing(model, step, here) for step in range(model.steps)]
    floor, carried = measure(steps, here), measure(steps, here, floor=False)
    assert floor is not None and floor.model == FLOOR and floor.floor_s > 0
    assert carried is not None and carried.model == LINEAR and carried.floor_s == 0.0
    assert carried.rollout_on(64) == pytest.approx(carried.rollout_on(32) / 2)
    assert floor.rollout_on(64) > carried.rollout_on(64)
