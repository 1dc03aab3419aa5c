"""verl's rules in the simulator (issue 24): the rollout's progress as the engines report it,
verl's aborts and rebalance of running requests, and every report carrying the side-by-side."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.domain import Pool
from dynaresized.sim.cli import summary
from dynaresized.sim.pipeline import DynamicPipeline
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import bench, scenario_shape, simulate
from dynaresized.sim.stages import Intervention, StageModel, pull_segments
from dynaresized.sim.workload import scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


@pytest.fixture(scope="module")
def noisy():
    return scenario_trace("noisy", scenario_shape(PROFILE), seed=0, steps=16)


def tokens_by_request(segments, n):
    made = np.zeros(n, dtype=np.int64)
    for j, _, t0, t1, g0, g1 in segments:
        assert t1 >= t0 and g1 >= g0
        made[j] += g1 - g0
    return made


def test_aborted_requests_resume_where_they_stopped_and_finish_once():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 400, size=300).tolist()
    plan = [Intervention(at=30.0, rebalance=True), Intervention(at=120.0, stop=frozenset({2, 3}))]
    done, segments = pull_segments(lengths, 4, 32, [0, 0, 30, 30], plan)
    assert (tokens_by_request(segments, len(lengths)) == lengths).all()  # partial rollout: no token twice
    assert np.isfinite(done).all()
    assert all(t0 < 120.0 for _, e, t0, _, _, _ in segments if e in (2, 3))  # home: nothing new after
    finished_on = {j: e for j, e, *_, g1 in segments if g1 == lengths[j]}
    assert len(finished_on) == len(lengths)


def test_a_rebalance_spreads_the_running_requests_over_the_new_engines():
    model = StageModel(PROFILE, scenario_trace("noisy", scenario_shape(PROFILE), seed=0, steps=2))
    late = np.array([0.0, 0.0] + [20.0] * 6)  # two home engines, six lent in at 20 s (not waited for: home=2)
    plain = model.engine_schedule(1, 8, late, home=2)
    spread = model.engine_schedule(1, 8, late, rebalance_at_s=20.0, home=2)
    assert np.bincount(spread.placement, minlength=8).std() < np.bincount(plain.placement, minlength=8).std()
    assert spread.finish_s.max() < plain.finish_s.max()
    home = model.engine_schedule(1, 2)
    stopped = model.engine_schedule(1, 8, late, stop_at_s=60.0, stopping=frozenset(range(2, 8)), home=2)
    # lent engines gone home after 40 s, their running requests back on the home engines
    assert stopped.finish_s[2:].max() < 100.0
    assert plain.finish_s.max() < stopped.finish_s.max() < home.finish_s.max() + 60.0


@pytest.mark.parametrize("router", ["pull", "verl", "round-robin"])
def test_the_request_schedule_agrees_with_the_engine_finish_times(router):
    model = StageModel(PROFILE, scenario_trace("noisy", scenario_shape(PROFILE), seed=0, steps=2), router=router)
    late = np.array([0.0, 0.0, 0.0, 12.0])
    schedule = model.engine_schedule(1, 4, late)
    assert schedule.finish_s == pytest.approx(model.engine_finish(1, 4, late))
    last = [schedule.done_s[schedule.placement == e].max() for e in range(4)]
    assert last == pytest.approx(schedule.finish_s)
    assert schedule.done_by(4, np.inf).sum() == model.samples[1]


def test_verl_default_lends_trainers_after_training_and_sends_them_home_on_its_sample_count(noisy, monkeypatch):
    # Progress reports are soft state (no fact): each engine's report is taken as it is fed to
    # the core, placed before the facts it led to (simulate runs verl's rules in pipelines of
    # their own beside this one: each keeps its own marks). Each pipeline is held here, so that
    # no later one takes the id of one that is gone (and its marks with it).
    marks: dict[int, tuple[DynamicPipeline, list[tuple[int, ev.ProgressReported]]]] = {}
    feed = DynamicPipeline._feed

    def recorded(self: DynamicPipeline, event: ev.Event) -> None:
        if isinstance(event, ev.ProgressReported):
            marks.setdefault(id(self), (self, []))[1].append((len(self.facts), event))
        feed(self, event)

    monkeypatch.setattr(DynamicPipeline, "_feed", recorded)
    result = simulate(noisy, PROFILE, "verl-default", seed=0)
    facts = result.run.facts
    [reports] = [r for pipeline, r in marks.values() if tuple(pipeline.facts) == tuple(facts)]
    loans = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert loans and all(x.plan.to_pool is Pool.ROLLOUT for x in loans)
    assert result.report.resizes_started == 0
    # the hybrids sleep through the first rollout, as verl's do
    assert result.run.windows[0].lent == 0
    seen: dict[str, tuple[int, int]] = {}
    homes, i = 0, 0
    for position, x in enumerate(facts):
        while i < len(reports) and reports[i][0] <= position:
            seen[reports[i][1].worker_id] = (reports[i][1].step, reports[i][1].done)
            i += 1
        if isinstance(x, f.LoanReturnStarted) and "home at" in x.reason:
            home_at = int(x.reason.split("home at ")[1].split(")")[0])
            step = int(x.reason.split(" samples of step ")[1].split(" ")[0])
            assert sum(done for s, done in seen.values() if s == step) >= home_at
            homes += 1
    assert homes > 0
    assert result.report.speedup_vs_verl_dynamic_same_start == 1.0


def test_every_report_carries_the_side_by_side_with_verls_rules(noisy):
    report = simulate(noisy, PROFILE, "hysteresis", seed=0).report
    alone = simulate(noisy, PROFILE, "verl-default", seed=0, verl_rules=False).report
    v1 = simulate(noisy, PROFILE, "verl-v1-switch", seed=0, verl_rules=False).report
    assert report.verl_dynamic_same_start_total_time_s == alone.total_time_s
    assert report.verl_v1_switch_total_time_s == v1.total_time_s
    # the ratio of the unrounded totals, rounded (the totals here are rounded to 3 decimals)
    assert report.speedup_vs_verl_dynamic_same_start == pytest.approx(alone.total_time_s / report.total_time_s,
                                                                      abs=6e-5)
    assert report.speedup_vs_verl_v1_switch == round(v1.total_time_s / report.total_time_s, 4)
    again = simulate(noisy, PROFILE, "hysteresis", seed=0).report
    assert msgspec.json.encode(again) == msgspec.json.encode(report)  # deterministic, bit for bit
    text = summary(report)
    assert "speedup_vs_verl_dynamic_same_start" in text and "speedup_vs_verl_dynamic_own_start" in text


def test_the_summary_says_the_step_boundary_bound_bounds_step_boundary_schedules_only(noisy):
    text = summary(simulate(noisy, PROFILE, "static", seed=0, verl_rules=False).report)
    headroom = next(line for line in text.splitlines() if "bound_vs_best_static" in line)
    assert headroom.endswith("for any step-boundary schedule")
    assert "(any schedule, loans included)" in text  # the fluid bound is the one for any schedule


def test_bench_shows_the_columns_against_verl():
    from dynaresized.sim.cli import main

    rows = bench(PROFILE, scenarios=("noisy",), policies=("static", "verl-default"), steps=6)
    assert rows[1].speedup_vs_verl_dynamic_same_start == 1.0
    assert rows[0].verl_dynamic_same_start_total_time_s == rows[1].total_time_s
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        main(["bench", "--scenarios", "noisy", "--policies", "static", "--steps", "4"])
    header = out.getvalue().splitlines()[0]
    assert "vs verl" in header and "vs v1" in header


def test_verls_rule_also_runs_from_its_own_planned_start(noisy):
    """Issue 43 item 5: beside verl's rule from our start, verl's rule from the start the plan
    search picks when it is run with verl's rule (`plan_start` with `verl-default`); the
    report's own-start total is that run, made again here on its own."""
    from dynaresized.core.policy import load_policy
    from dynaresized.sim.plan import plan_start
    from dynaresized.sim.run import verl_guards

    report = simulate(noisy, PROFILE, "hysteresis", seed=0).report  # from the profile's 6:2, TP-1
    own, _ = plan_start(PROFILE, noisy, lambda: load_policy("verl-default"), verl_guards(PROFILE))
    assert report.start == "6:2/TP-1" and report.verl_dynamic_own_start == str(own)
    assert str(own) != report.start  # else this test would compare a run with itself
    alone = simulate(noisy, PROFILE.with_layout(own.tp, own.split), "verl-default", seed=0, verl_rules=False).report
    assert report.verl_dynamic_own_start_total_time_s == alone.total_time_s
    assert report.speedup_vs_verl_dynamic_own_start == round(alone.total_time_s / report.total_time_s, 4)
    assert report.verl_dynamic_own_start_total_time_s != report.verl_dynamic_same_start_total_time_s

    # Started where verl's rule would start, the two columns are one run.
    there = simulate(noisy, PROFILE.with_layout(own.tp, own.split), "hysteresis", seed=0, origin=PROFILE).report
    assert there.start == str(own) and there.profile_initial_split == "6:2"
    assert there.verl_dynamic_own_start_total_time_s == there.verl_dynamic_same_start_total_time_s == alone.total_time_s


@pytest.mark.slow
def test_we_finish_sooner_than_verls_rule_on_every_scenario_of_the_8_gpu_profile():
    """Issue 24's targets on qwen3-8b-h20x8 (docs/simulator.md, "verl's own rules")."""
    from dynaresized.sim.workload import SCENARIOS

    for name in SCENARIOS:
        trace = scenario_trace(name, scenario_shape(PROFILE), seed=0)
        report = simulate(trace, PROFILE, "hysteresis", seed=0).report
        assert report.speedup_vs_verl_dynamic_same_start >= (1.05 if name in ("noisy", "longtail-drift") else 1.0), name


def test_the_benchmarks_print_one_json_object_with_their_keys(capsys):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    for script, args, keys in (
        ("verl_published.py", ["--steps", "4"], {"verl_published_gain_error", "simulated_gain_vs_16_16",
                                                 "static_ratio_8_24_over_16_16", "median_scan"}),
        ("verl_side_by_side.py", ["--profiles", "qwen3-8b-h20x8", "--scenarios", "noisy", "--steps", "4"], {"rows"}),
    ):
        spec = importlib.util.spec_from_file_location(script[:-3], root / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        assert module.main(args) == 0
        out = msgspec.json.decode(capsys.readouterr().out)
        assert keys <= set(out)
