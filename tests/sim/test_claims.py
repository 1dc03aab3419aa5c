"""What the simulator must show (issues 4 and 11), measured on the built-in scenarios and profiles.

Each test runs the real scenario on the real profile (no reduced sizes) unless it says so.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from dynaresized.core.policy import load_policy
from dynaresized.domain import Split
from dynaresized.sim.pipeline import colocated_steps
from dynaresized.sim.plan import plan_start
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import SimReport, baselines, guards_for, scenario_shape, simulate
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


def run_all(scenario: str, policies: tuple[str, ...], *, lending: bool = False, naive: bool = False,
            guards: dict | None = None) -> dict[str, SimReport]:
    """Lending is off unless asked for: the issue-4 claims are about moves at step boundaries."""
    trace = scenario_trace(scenario, scenario_shape(PROFILE), seed=0)
    model = StageModel(PROFILE, trace)
    base = baselines(model)
    return {p: simulate(trace, PROFILE, p, seed=0, model=model, base=base, naive=naive, guard_overrides=guards,
                        policy_options={"lending": lending} if p in ("hysteresis", "planner") else None,
                        verl_rules=False).report
            for p in policies}


@pytest.fixture(scope="module")
def drift() -> dict[str, SimReport]:
    return run_all("longtail-drift", ("hysteresis", "planner"))


@pytest.fixture(scope="module")
def lending() -> dict[str, SimReport]:
    """The default hysteresis policy (lending on) on every built-in scenario."""
    names = ("longtail-stationary", "longtail-drift", "shrinking", "bimodal", "noisy", "verl-dapo")
    return {name: run_all(name, ("hysteresis",), lending=True)["hysteresis"] for name in names}


def test_longtail_drift_gets_close_to_the_lower_bound(drift):
    best = min(drift.values(), key=lambda r: r.total_time_s)
    assert best.steps == 200 and best.samples_per_step == 1024
    # Against the bound over every engine size (issue 22); against TP-1 engines only it was <= 0.15.
    assert best.gap_to_lower_bound <= 0.20
    assert best.resizes >= 1


def test_longtail_drift_beats_the_initial_split_and_matches_the_best_static_split(drift):
    # The per-step oracle (best split every step, free resizes) is the most any policy can
    # reach, and the lower bound the most any schedule can; on this workload the hindsight-best
    # static split is within ~1% of the oracle and 12% of the bound, so the 1.3x over
    # best static is not reachable by any schedule (docs/simulator.md, "Headroom").
    # These are the issue-4 claims, about splits of TP-1 engines: `headroom_vs_best_static` is
    # the TP-1 split's over the TP-1 oracle (issue 22 made `best_static` a configuration).
    best = min(drift.values(), key=lambda r: r.total_time_s)
    assert best.headroom_vs_best_static == round(best.best_static_tp1.total_time_s / best.best_split_per_step_tp1_total_time_s, 4)
    assert best.speedup_vs_best_static_tp1 <= best.headroom_vs_best_static
    assert best.bound_vs_best_static < 1.3
    assert best.speedup_vs_best_static_tp1 >= 0.98
    assert best.speedup_vs_initial_split >= 1.3


def test_longtail_drift_resizes_at_most_once_per_cooldown_window(drift):
    for report in drift.values():
        steps = [e.step for e in report.resize_events]
        assert all(b - a > report.cooldown_steps for a, b in zip(steps, steps[1:], strict=False))


def test_noisy_hysteresis_does_not_thrash_and_stays_near_the_best_static_split():
    reports = run_all("noisy", ("greedy", "hysteresis"))
    greedy, hysteresis = reports["greedy"], reports["hysteresis"]
    assert greedy.resizes >= 5 * max(hysteresis.resizes, 1)
    assert hysteresis.total_time_s <= 1.02 * hysteresis.best_static_tp1.total_time_s


def test_shrinking_moves_devices_back_to_training():
    for report in run_all("shrinking", ("hysteresis", "planner")).values():
        to_training = [e for e in report.resize_events
                       if int(e.after.split(":")[0]) > int(e.before.split(":")[0]) and e.outcome == "committed"]
        to_rollout = [e for e in report.resize_events
                      if int(e.after.split(":")[0]) < int(e.before.split(":")[0]) and e.outcome == "committed"]
        assert to_rollout and to_training
        assert to_training[-1].step > to_rollout[0].step


def test_same_seed_gives_the_same_json_bit_for_bit():
    def once(seed: int) -> bytes:
        trace = scenario_trace("bimodal", scenario_shape(PROFILE), seed=seed, steps=60)
        return msgspec.json.encode(simulate(trace, PROFILE, "planner", seed=seed).report)

    assert once(5) == once(5)
    assert once(5) != once(6)


# -- issue 11: loans inside a step ------------------------------------------------------------


def test_lending_gains_most_where_steps_vary(lending):
    noisy = lending["noisy"]
    # Issue 11's target, against the best split of TP-1 engines: 1.08 (1.0797 while an engine
    # lent to training was priced as missing the next rollout, 7 December; 1.0904 since the
    # router holds a late engine's share of the step and the loan is priced with its way home).
    assert noisy.loans >= 100 and noisy.speedup_vs_best_static_tp1 >= 1.08
    assert noisy.speedup_vs_best_static_tp1 == max(r.speedup_vs_best_static_tp1 for r in lending.values())


def test_lending_on_longtail_drift_beats_both_best_static_splits(lending):
    drift = lending["longtail-drift"]
    assert drift.speedup_vs_best_static_tp1 >= 1.00
    # Issue 11's target over what a verl user runs today: verl's dispatch places each step's
    # batch in contiguous chunks at submission, a prompt's samples together on one engine.
    assert drift.speedup_vs_best_static_round_robin >= 1.03


def test_the_verl_baseline_straggles_where_the_pull_router_does_not(lending):
    # The same fixed split placed as verl places it is slower than with our pull router, on
    # every scenario: a hard prompt's long responses decode together on one engine.
    for name, report in lending.items():
        assert report.best_static_round_robin.total_time_s > report.best_static_tp1.total_time_s, name


def test_lending_never_costs_more_than_one_percent_and_never_beats_the_fluid_bound(lending):
    for name, report in lending.items():
        without = run_all(name, ("hysteresis",))["hysteresis"]
        assert report.total_time_s <= 1.01 * without.total_time_s, name
        # every built-in scenario, the 20-step verl-dapo included: there the trainers, idle in
        # window 0 (nothing to train yet) and after step 0's training, serve the first rollouts
        # on the initial 6:2 split (docs/simulator.md, "Loans")
        assert report.speedup_vs_best_static_tp1 >= 0.99, name
        assert report.fluid_bound_s <= report.lower_bound_s, name
        assert report.gap_to_fluid_bound > 0, name
        assert report.gap_to_fluid_bound == round(report.total_time_s / report.fluid_bound_s - 1.0, 4)


def test_naive_loans_lose_so_the_cost_model_matters(lending):
    # A naive loan (teardown, fresh communicators, full state reload) lent whenever an engine
    # is idle, with the payback guard off: slower than pipelined loans and than never lending.
    for name in ("noisy", "longtail-drift"):
        naive = run_all(name, ("hysteresis",), lending=True, naive=True, guards={"loan_safety": 0.0})["hysteresis"]
        assert naive.loans >= 10
        assert naive.total_time_s > lending[name].total_time_s
        assert naive.speedup_vs_best_static < 1.0


# verl fully-async blog, synchronous colocated baseline (DESIGN.md §2): seconds per step.
VERL_PUBLISHED = {32: 790.0, 64: 365.0, 128: 356.0}
VERL_TOLERANCE = 0.16
"""The issue asks for 15%. The published 32 -> 64 GPU step scales superlinearly (2.16x for 2x
GPUs); a model where each stage takes constant + work / N, as the simulator's does (the tail of
a synchronous generation runs after its bulk), fits the three points no closer than 15.7%
(docs/simulator.md, "Calibration"). The profile is fitted to
that limit; this is the documented tolerance."""


def test_verl_profile_reproduces_the_published_colocated_step_times():
    profile = load_profile("qwen2.5-7b-h20")
    trace = scenario_trace("verl-dapo", scenario_shape(profile), seed=0)
    model = StageModel(profile, trace)
    assert model.samples[0] == 8192
    for gpus, published in VERL_PUBLISHED.items():
        simulated = float(np.mean(colocated_steps(model, gpus)))
        assert abs(simulated / published - 1.0) <= VERL_TOLERANCE, (gpus, simulated, published)


# -- issue 22: the best static configuration (split x engine size) ------------------------------


def test_against_the_best_static_configuration_we_lose_where_the_tail_dominates(lending):
    # Static TP-4 engines at 4:4 beat the best split of TP-1 engines on every scenario (the
    # latency-bound tail decodes ~2x faster on them); our policy still runs TP-1 engines, and
    # loses to them on these four (docs/simulator.md, "Against the best static configuration").
    for name, report in lending.items():
        assert (report.best_static.train, report.best_static.rollout, report.best_static.tp) == (4, 4, 4), name
        assert report.best_static.total_time_s < report.best_static_tp1.total_time_s, name
        assert report.speedup_vs_best_static < report.speedup_vs_best_static_tp1, name
    losing = sorted(name for name, report in lending.items() if report.speedup_vs_best_static < 1.0)
    assert losing == ["bimodal", "longtail-drift", "longtail-stationary", "verl-dapo"]
    assert lending["noisy"].speedup_vs_best_static >= 1.0


@pytest.mark.parametrize(("scenario", "floor"), [("noisy", 1.08), ("longtail-drift", 1.03), ("verl-dapo", 1.0)])
def test_on_tp2_engines_from_4_4_the_policy_beats_the_best_static_configuration(scenario, floor):
    # `simulate --tp 2 --initial-split 4:4`: the layout is the user's choice;
    # the baselines stay the profile's (TP-4 at 4:4 is the best static configuration), and with
    # narrower engines and loans the default policy clears issue 22's targets on these three
    # (docs/simulator.md, "Against the best static configuration").
    trace = scenario_trace(scenario, scenario_shape(PROFILE), seed=0)
    base = baselines(StageModel(PROFILE, trace))
    wide = PROFILE.with_layout(2, Split(4, 4))
    report = simulate(trace, wide, "hysteresis", seed=0, base=base, verl_rules=False).report
    assert (report.tp, report.initial_split, report.best_static.tp) == (2, "4:4", 4)
    assert report.best_static_tp1.tp == 1
    assert report.speedup_vs_best_static >= floor, report.speedup_vs_best_static


@pytest.mark.parametrize(("scenario", "start", "floor"),
                         [("noisy", "4:4/TP-4", 1.08), ("longtail-drift", "4:4/TP-4", 1.03),
                          ("verl-dapo", "4:4/TP-4", 1.0)])
def test_from_the_planned_layout_the_policy_beats_the_best_static_configuration(scenario, start, floor):
    # `simulate --layout plan`: the plan search picks the start from the first 10 steps, no
    # hindsight; the core knows the TP-4 engines (moves them whole, lends each whole once dry),
    # and noisy and longtail-drift clear issue 22's 1.08 and 1.03 (docs/simulator.md, "The plan
    # search").
    trace = scenario_trace(scenario, scenario_shape(PROFILE), seed=0)
    base = baselines(StageModel(PROFILE, trace))
    config, _ = plan_start(PROFILE, trace, lambda: load_policy("hysteresis"), guards_for(PROFILE))
    assert str(config) == start
    report = simulate(trace, PROFILE.with_layout(config.tp, config.split), "hysteresis", seed=0, base=base,
                      verl_rules=False).report
    assert report.speedup_vs_best_static >= floor, report.speedup_vs_best_static
