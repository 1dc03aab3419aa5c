"""Tensor-parallel rollout engines: the cost of an engine of k devices, the best static
configuration over (split x engine size), the bounds over every engine size, and a pool
smaller than an engine reported as an error, not a crash."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from dynaresized.core import facts as f
from dynaresized.core.policy import load_policy
from dynaresized.domain import Pool, Split
from dynaresized.sim.bounds import fluid_bound, longest_alone, lower_bound
from dynaresized.sim.pipeline import (
    DynamicPipeline,
    best_static,
    best_static_config,
    oracle_total,
    static_floor_windows,
    static_total,
    static_windows,
)
from dynaresized.sim.profile import ProfileError, load_profile, validate
from dynaresized.sim.run import baselines, guards_for, scenario_shape, simulate
from dynaresized.sim.stages import StageModel, pull_placement
from dynaresized.sim.workload import scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


def iteration_s(spec, running: int, ctx: float) -> float:
    return spec.iter_base_s + running * (spec.iter_per_seq_s + spec.iter_per_ctx_token_s * ctx)


def test_an_engine_of_k_devices_splits_the_work_pays_all_reduces_and_holds_more_kv():
    r = PROFILE.rollout
    assert r.at_tp(1) is r
    one, two, four, eight = (r.at_tp(k) for k in (1, 2, 4, 8))
    # a lone request decodes faster on wider engines, but less than k times (launches, all-reduces)
    lone = [iteration_s(s, 1, 132) for s in (one, two, four, eight)]
    assert lone == sorted(lone, reverse=True)
    assert lone[0] / lone[3] < 8
    # the calibration point (docs/simulator.md): TP-8 decodes a lone request ~2.2x faster
    assert lone[0] / lone[3] == pytest.approx(7.37 / 3.35, rel=0.15)
    # the all-reduces grow with k; the per-sequence terms split exactly
    assert r.comm_s(1) == 0 < r.comm_s(2) < r.comm_s(4) < r.comm_s(8)
    assert four.iter_per_seq_s == pytest.approx(r.iter_per_seq_s / 4)
    assert four.prefill_per_token_s == pytest.approx(r.prefill_per_token_s / 4)
    # k devices' memory less one copy of the weights
    assert four.kv_cache_tokens == 4 * (r.kv_cache_tokens + r.weights_kv_tokens) - r.weights_kv_tokens
    # and back: an engine of the profile's size is derived from any other exactly
    assert eight.at_tp(1).iter_base_s == pytest.approx(r.iter_base_s)
    assert eight.at_tp(1).kv_cache_tokens == pytest.approx(r.kv_cache_tokens, abs=8)


def test_a_pool_smaller_than_an_engine_is_a_profile_error_not_an_index_error():
    # A TP-4 profile that starts at 6:2 (issue 22): the profile check reports it...
    wide = PROFILE.with_tp(4)
    with pytest.raises(ProfileError, match="smaller than one engine"):
        validate(wide)
    # ...and a pipeline given it anyway says the same instead of crashing in pull_placement
    model = StageModel(wide, scenario_trace("noisy", scenario_shape(wide), steps=3))
    with pytest.raises(ProfileError, match="smaller than one engine"):
        DynamicPipeline(model, load_policy("hysteresis"), guards=guards_for(wide))
    with pytest.raises(ValueError, match="smaller than one engine"):
        pull_placement([10, 20, 30], 0, 4)


def test_a_tp_profile_that_starts_wide_enough_runs():
    cluster = msgspec.structs.replace(PROFILE.cluster, initial_train=4)
    wide = msgspec.structs.replace(PROFILE, cluster=cluster).with_tp(4)
    validate(wide)
    trace = scenario_trace("noisy", scenario_shape(wide), steps=6)
    report = simulate(trace, wide, "hysteresis", verl_rules=False).report
    assert report.tp == 4
    assert report.total_time_s >= report.fluid_bound_s


@pytest.fixture(scope="module")
def model() -> StageModel:
    return StageModel(PROFILE, scenario_trace("noisy", scenario_shape(PROFILE), steps=30))


def test_best_static_config_is_the_best_of_every_split_and_engine_size(model):
    best, own = best_static_config(model, 8)
    assert (own.split, own.tp) == (best_static(model, 8)[0], 1)
    assert own.total_s == pytest.approx(best_static(model, 8)[1])
    exhaustive = min((static_total(model.at_tp(k), Split(8 - r, r)), k, r)
                     for k in (1, 2, 4) for r in range(k, 8, k))
    assert best.total_s == pytest.approx(exhaustive[0])
    assert best.total_s <= own.total_s


def test_the_bounds_hold_for_every_engine_size(model):
    bound, fluid = lower_bound(model, 8).total_s, fluid_bound(model, 8)
    assert fluid <= bound
    for k in (1, 2, 4):
        wide = model.at_tp(k)
        assert all(static_total(wide, Split(8 - r, r)) >= bound for r in range(k, 8, k))
    # the latency floor is the longest request on the widest engine, below TP-1's, so the
    # fluid bound is below the one of TP-1 engines only
    assert (longest_alone(model.variants(8)) < model.longest_request_s).all()
    tp1_only = msgspec.structs.replace(PROFILE, rollout=msgspec.structs.replace(PROFILE.rollout, tp_sizes=()))
    assert fluid <= fluid_bound(StageModel(tp1_only, model.trace), 8)


def test_report_keeps_the_tp1_baseline_beside_the_configuration(model):
    base = baselines(model)
    report = simulate(model.trace, PROFILE, "hysteresis", model=model, base=base, verl_rules=False).report
    assert report.best_static.tp == base.best_tp
    assert report.best_static_tp1 is not None and report.best_static_tp1.tp == 1
    assert report.best_static.total_time_s <= report.best_static_tp1.total_time_s
    assert report.speedup_vs_best_static == pytest.approx(report.best_static.total_time_s / report.total_time_s,
                                                          rel=1e-3)
    assert report.speedup_vs_best_static_tp1 == pytest.approx(
        report.best_static_tp1.total_time_s / report.total_time_s, rel=1e-3)


@pytest.mark.parametrize("scenario", ["noisy", "longtail-drift"])
def test_the_pruned_static_searches_equal_trying_every_split(scenario):
    """best_static and the per-step oracle simulate only the splits whose floors could win
    (what keeps `simulate --gpus 1024` to seconds); they find what trying every split finds,
    and every window floor they prune with is below the window it bounds."""
    profile = PROFILE.with_gpus(24)
    model = StageModel(profile, scenario_trace(scenario, scenario_shape(profile), steps=20))
    every = [Split(t, 24 - t) for t in range(1, 24)]
    windows = {s: static_windows(model, s) for s in every}
    for s in every:
        assert (static_floor_windows(model, s) <= windows[s] + 1e-9).all(), s
    totals = [(float(w.sum()), s.train) for s, w in windows.items()]
    split, total = best_static(model, 24)
    assert (total, split.train) == min(totals)
    assert oracle_total(model, 24) == pytest.approx(float(np.stack(list(windows.values())).min(axis=0).sum()))


def test_resizes_of_a_cluster_of_wide_engines_move_and_start_whole_engines():
    # 64 devices of TP-8 engines: the policy once moved 5 trainers to the rollout (from 32:32, a
    # start the plan search tries for longtail-stationary), whose devices the simulator put into
    # TP-8 engines while the core saw 5 engines of one device, and a loan then lent a mix of both
    profile = PROFILE.with_gpus(64).with_layout(8, Split(40, 24))
    trace = scenario_trace("longtail-stationary", scenario_shape(profile), seed=0, steps=20)
    guards = msgspec.structs.replace(guards_for(profile), min_rollout=8)
    run = DynamicPipeline(StageModel(profile, trace), load_policy("hysteresis"), guards=guards).run()
    moves = [x.plan for x in run.facts if isinstance(x, f.ResizeStarted)]
    assert moves and all(len(p.devices) % 8 == 0 for p in moves)
    assert run.state.split.rollout % 8 == 0 and run.state.split.rollout > 24
    rollout = run.state.pool_devices(Pool.ROLLOUT)
    assert all(len(run.state.engine_of(d)) == 8 for d in rollout)  # the core knows every engine whole
    formed = [x for x in run.facts if isinstance(x, f.RegroupStarted) and x.at > 0]
    assert formed and all(x.source == "profile" for x in formed)


def test_a_start_that_is_not_whole_engines_keeps_the_simulator_s_engines_the_core_s():
    # 16 devices of TP-2 engines from 9:7: the rollout pool's seventh device served in no engine.
    # A resize then brought one more; the simulator grouped the pool by device order
    # (gpu7+gpu8, ...) while the core had formed gpu9+gpu10, ... at the start, and a loan lent
    # an engine the simulator still ran ("lent busy devices"). The arrivals now form an engine
    # with the device left out, and the simulator takes its engines from the core.
    profile = PROFILE.with_gpus(16).with_layout(2, Split(9, 7))
    trace = scenario_trace("longtail-drift", scenario_shape(profile), seed=0, steps=60)
    pipeline = DynamicPipeline(StageModel(profile, trace), load_policy("hysteresis"), guards=guards_for(profile))
    run = pipeline.run()
    moves = [x.plan for x in run.facts if isinstance(x, f.ResizeStarted)]
    assert any(p.to_pool is Pool.ROLLOUT for p in moves)
    assert sum(isinstance(x, f.LoanLanded) for x in run.facts) > 0
    rollout = sorted(run.state.pool_devices(Pool.ROLLOUT), key=pipeline.index.__getitem__)
    groups = pipeline._engine_groups(rollout)
    assert len(groups) == len(rollout) // 2
    assert all(run.state.engine_of(g[0]) == g for g in groups)  # the core's engines, each whole
