"""The pipeline modes, and the dynamic mode driving the daemon's own core and policies."""

from __future__ import annotations

import numpy as np
import pytest

from dynaresized.core import facts as f
from dynaresized.core import fold
from dynaresized.core.policy import load_policy
from dynaresized.domain import FORWARD_ORDER, Pool, Split
from dynaresized.sim.bounds import fluid_bound, lower_bound
from dynaresized.sim.pipeline import DynamicPipeline, best_static, colocated_total, static_total, static_windows
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import guards_for, scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import StepBatch, Trace, scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


@pytest.fixture(scope="module")
def model() -> StageModel:
    return StageModel(PROFILE, scenario_trace("longtail-drift", scenario_shape(PROFILE), steps=40))


def run(model: StageModel, policy: str, *, naive: bool = False, lending: bool = False, **guards):
    """Lending is off unless asked for: these tests are about moves at step boundaries."""
    options = {"lending": lending} if policy in ("hysteresis", "planner") else {}
    return DynamicPipeline(model, load_policy(policy, options), guards=guards_for(model.profile, guards),
                           naive=naive).run()


def test_static_policy_through_the_core_equals_the_static_pipeline(model):
    result = run(model, "static")
    assert result.total_time_s == pytest.approx(static_total(model, PROFILE.initial_split), rel=1e-12)
    assert result.final_split == PROFILE.initial_split
    assert not any(isinstance(x, f.ResizeStarted) for x in result.facts)


def test_one_step_off_policy_window_is_max_of_stages_plus_sync(model):
    split = Split(train=4, rollout=4)
    expected = model.rollout_seconds(0, 4)
    for w in range(1, model.steps):
        expected += max(model.rollout_seconds(w, 4), model.train_seconds(w - 1, 4)) + model.weight_sync_s
    expected += model.train_seconds(model.steps - 1, 4) + model.weight_sync_s
    assert static_total(model, split) == pytest.approx(expected, rel=1e-12)


def test_colocated_runs_generation_then_switch_then_training(model):
    expected = sum(model.rollout_seconds(k, 8) + model.colocated_switch_s + model.train_seconds(k, 8)
                   for k in range(model.steps))
    assert colocated_total(model, 8) == pytest.approx(expected, rel=1e-12)


def test_best_static_tries_every_split(model):
    split, total = best_static(model, 8)
    assert total == min(static_total(model, Split(t, 8 - t)) for t in range(1, 8))
    assert static_total(model, split) == total


def test_resizes_run_every_op_through_the_core_and_replay(model):
    result = run(model, "greedy")
    started = [x for x in result.facts if isinstance(x, f.ResizeStarted)]
    committed = [x for x in result.facts if isinstance(x, f.ResizeCommitted)]
    assert len(started) >= 5 and len(committed) >= len(started) - 1
    first = started[0].plan.resize_id
    kinds = [x.op_id.split("-", 1)[1] for x in result.facts if isinstance(x, f.OpCompleted)
             and x.op_id.startswith(first + "/")]
    assert kinds == [k.value for k in FORWARD_ORDER]
    # The log the simulator produced replays to the core's live state (DESIGN.md §4.5).
    assert fold(result.facts).durable() == result.state.durable()


def test_moving_devices_serve_no_pool_until_commit_but_engines_pull_once_woken(model):
    result = run(model, "greedy")
    mixed = [w for w in result.windows if w.moving]
    assert mixed
    for w in result.windows:
        assert w.rollout_devices + w.train_devices + w.moving == 8
    first = next(x for x in result.facts if isinstance(x, f.ResizeStarted))
    window = next(w for w in result.windows if w.start_s == first.at)
    assert window.moving == len(first.plan.devices)
    # The first move grows the rollout: with the pull router its engines pull the window's
    # queue once drained, released, joined, restored and warmed up, so that rollout beats the
    # home engines alone and cannot beat every engine from the start.
    assert first.plan.to_pool is Pool.ROLLOUT
    home = model.rollout_seconds(window.window, window.rollout_devices)
    everyone = model.rollout_seconds(window.window, window.rollout_devices + window.moving)
    assert everyone < window.rollout_s < home
    # Devices moving to training wait for the commit: the window trains on the pool it has.
    to_training = [x for x in result.facts if isinstance(x, f.ResizeStarted) and x.plan.to_pool is Pool.TRAINING]
    assert to_training
    w = next(w for w in result.windows if w.start_s == to_training[0].at)
    assert w.train_s >= model.train_seconds(w.window - 1, w.train_devices)


def test_naive_costs_stop_the_pipeline_and_cost_more(model):
    pipelined = run(model, "greedy")
    naive = run(model, "greedy", naive=True)
    assert naive.total_time_s > pipelined.total_time_s
    assert all(w.moving == 0 for w in naive.windows)  # nothing runs while devices move
    # Every window starts where the previous ended, except after a naive resize: a pause.
    gaps = [b.start_s - a.end_s for a, b in zip(naive.windows, naive.windows[1:], strict=False)]
    assert max(gaps) >= sum(PROFILE.op_seconds(k, p, naive=True) for k in FORWARD_ORDER
                            for p in [started_pool(naive)]) - 1e-6


def started_pool(result):
    return next(x for x in result.facts if isinstance(x, f.ResizeStarted)).plan.to_pool


@pytest.mark.parametrize("policy", ["static", "greedy", "hysteresis", "planner"])
@pytest.mark.parametrize("naive", [False, True])
def test_no_run_beats_the_lower_bound(model, policy, naive):
    bound = lower_bound(model, 8).total_s
    assert run(model, policy, naive=naive).total_time_s >= bound
    assert colocated_total(model, 8) >= bound
    assert all(static_total(model, Split(t, 8 - t)) >= bound for t in range(1, 8))


@pytest.mark.parametrize("policy", ["hysteresis", "planner"])
@pytest.mark.parametrize("naive", [False, True])
def test_no_run_with_loans_beats_the_fluid_bound(model, policy, naive):
    bound = fluid_bound(model, 8)
    assert bound <= lower_bound(model, 8).total_s
    result = run(model, policy, naive=naive, lending=True)
    assert result.total_time_s >= bound
    assert all(static_total(model, Split(t, 8 - t)) >= bound for t in range(1, 8))


def test_lower_bound_holds_on_every_scenario_and_other_cluster_sizes():
    for name in ("longtail-stationary", "shrinking", "bimodal", "noisy"):
        for gpus in (4, 8, 12):
            profile = PROFILE.with_gpus(gpus)
            m = StageModel(profile, scenario_trace(name, scenario_shape(profile), steps=12))
            bound = lower_bound(m, gpus).total_s
            assert min(static_total(m, Split(t, gpus - t)) for t in range(1, gpus)) >= bound
            assert colocated_total(m, gpus) >= bound
            assert run(m, "greedy").total_time_s >= bound
            assert run(m, "hysteresis", lending=True, cooldown_steps=0).total_time_s >= fluid_bound(m, gpus)


def test_trainers_with_nothing_to_train_serve_the_first_rollout_and_say_so():
    # verl-dapo starts at 6:2: in window 0 the six trainers have nothing to train. Lent to the
    # rollout, they pull its queued requests; they come home when training step 0 begins, and
    # step 0's timing counts the device-seconds that served its rollout.
    m = StageModel(PROFILE, scenario_trace("verl-dapo", scenario_shape(PROFILE), seed=0))
    initial = PROFILE.initial_split
    alone = static_windows(m, initial)[0]
    without = run(m, "hysteresis", lending=False)
    result = run(m, "hysteresis", lending=True)
    assert without.windows[0].rollout_s == pytest.approx(alone)
    w0, w1 = result.windows[0], result.windows[1]
    assert w0.lent == initial.train and w0.rollout_s < 0.7 * alone
    loan = next(x for x in result.facts if isinstance(x, f.LoanStarted))
    assert loan.at == 0.0 and loan.plan.to_pool is Pool.ROLLOUT and len(loan.plan.devices) == initial.train
    home = next(x for x in result.facts if isinstance(x, f.LoanReturnStarted))
    assert home.at == w1.start_s and home.reason.startswith("training step 0 begins")
    step0 = next(x.timing for x in result.facts if isinstance(x, f.StepObserved))
    assert step0.rollout_s == pytest.approx(w0.rollout_s) and step0.rollout_devices == initial.rollout
    assert step0.rollout_device_s > step0.rollout_s * initial.rollout
    assert initial.rollout < step0.rollout_devices_served < initial.total
    assert result.total_time_s < without.total_time_s
    assert fold(result.facts).durable() == result.state.durable()


def test_lent_trainers_count_only_while_their_engines_decode():
    # 16 devices from 12:4 (TP-1): in window 0 the twelve trainers, lent to the rollout, land
    # after the four home engines admitted most of its requests; each lent engine decodes the few
    # it pulls and runs dry. Step 0's device-seconds count each lent engine while it decoded, not
    # for the rest of the rollout (which made the rollout look 16 devices wide, and the policy
    # shrink the training pool to 5).
    profile = PROFILE.with_gpus(16)
    m = StageModel(profile, scenario_trace("longtail-stationary", scenario_shape(profile), steps=6))
    result = run(m, "hysteresis", lending=True)
    w0 = result.windows[0]
    assert w0.lent == profile.initial_split.train
    step0 = next(x.timing for x in result.facts if isinstance(x, f.StepObserved))
    home = profile.initial_split.rollout
    assert home * step0.rollout_s < step0.rollout_device_s < 0.75 * profile.cluster.gpus * step0.rollout_s


def test_engines_lent_to_training_count_in_its_device_seconds():
    # An engine lent to training step k serves it from the mini-batch it joins at: the step's
    # report counts its device-seconds (train_device_s), so the training's measured work is the
    # work done, not the home pool's time alone (which made training look cheap and the policy
    # move trainers into the rollout).
    m = StageModel(PROFILE, scenario_trace("longtail-stationary", scenario_shape(PROFILE), steps=30))
    result = run(m, "hysteresis", lending=True)
    lent_to_training = {x.at for x in result.facts if isinstance(x, f.LoanStarted) and x.plan.to_pool is Pool.TRAINING}
    assert lent_to_training
    steps = [x.timing for x in result.facts if isinstance(x, f.StepObserved)]
    by_window = {w.window: w for w in result.windows}
    served_more = 0
    for t in steps:
        w = by_window[t.step + 1]  # training of step k runs in window k + 1
        lent = any(w.start_s <= at < w.end_s for at in lent_to_training)
        if lent:
            served_more += t.train_devices_served > t.train_devices
        else:
            assert t.train_devices_served == pytest.approx(t.train_devices)
        assert t.train_devices_served <= PROFILE.cluster.gpus
    assert served_more >= 1


def turning_trace() -> Trace:
    """2,048 samples a step (more than the engines' slots: requests stay queued): five steps of
    100-200 tokens, then five of 6,000-8,000. The cost model of the short steps says the first
    long rollout is over when its trainers are done; its samples say otherwise."""
    rng = np.random.default_rng(0)
    return Trace("turn", tuple(StepBatch(s, np.full(2048, 256, dtype=np.int64),
                                         rng.integers(*((100, 200) if s < 5 else (6000, 8000)), 2048).astype(np.int64))
                               for s in range(10)))


def test_the_simulated_policy_lends_from_the_steps_pace_as_the_daemon_does():
    """The engines report their sample counts to a policy that lends from the step's pace
    (`lend_from_progress`, the default), the engine that pulls the last request reports the
    queue empty, and trainer loans are priced at the step's own pace: on a workload that turns,
    the trainers are lent to the long rollouts from the first whose training is long enough to
    see samples done, where the last steps' model says the rollout is over."""
    trace = turning_trace()

    def run(paced: bool):
        policy = load_policy("hysteresis", {"lend_from_progress": paced})
        return DynamicPipeline(StageModel(PROFILE, trace), policy, guards=guards_for(PROFILE)).run()

    paced, model_only = run(True), run(False)
    lent = [x for x in paced.facts if isinstance(x, f.LoanStarted) and x.plan.to_pool is Pool.ROLLOUT]
    live = [x for x in lent if "samples done in" in x.reason and "at that pace" in x.reason]
    assert len(live) >= 4, [x.reason for x in lent]
    assert any(isinstance(x, f.EngineQueueEmptyObserved) and x.running > 0 for x in paced.facts)
    assert not any(isinstance(x, f.EngineQueueEmptyObserved) and x.running > 0 for x in model_only.facts)
    assert paced.total_time_s < model_only.total_time_s / 1.15
