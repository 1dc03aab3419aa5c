"""Owning misses in the simulator (issue 14): on a heavy-tailed trace (Pareto alpha=1.2) the
planner's linear-scaling prediction misses badly; the core logs the miss, judges the resize
worse than not moving, and the run's report says so. On the built-in long-tail drift, where
the resize really pays, the verdict says that instead: growing responses are not held
against it."""

from __future__ import annotations

import numpy as np

from dynaresized.core import facts as f
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape, simulate
from dynaresized.sim.workload import StepBatch, Trace, scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


def pareto_trace(seed: int, steps: int = 100, samples: int = 512) -> Trace:
    rng = np.random.default_rng(seed)
    batches = []
    for k in range(steps):
        response = ((rng.pareto(1.2, samples) + 1) * 300).astype(np.int64)
        batches.append(StepBatch(k, np.full(samples, 300, dtype=np.int64), response))
    return Trace("pareto-1.2", tuple(batches))


def test_a_heavy_tail_miss_is_logged_and_judged_worse() -> None:
    # Resizes only: loans inside steps would recover part of the loss and blur the verdict.
    result = simulate(pareto_trace(5), PROFILE, "planner", policy_options={"lending": False})
    report, facts = result.report, result.run.facts
    assert report.speedup_vs_initial_split < 1.0  # the run really ended slower than not moving
    [miss] = [x for x in facts if isinstance(x, f.PredictionChecked)]
    assert miss.measured_step_s_after > 2 * miss.predicted_step_s_after
    [verdict] = [x for x in facts if isinstance(x, f.ResizeJudged)]
    assert verdict.verdict is f.Verdict.WORSE and verdict.saved_s is not None and verdict.saved_s < 0
    assert verdict.payback_factor > 1.0 and result.run.state.history.payback_factor > 1.0
    assert report.verdicts == {"worse": 1}
    assert report.prediction_errors == [round(miss.error_s / miss.predicted_step_s_after, 4)]
    assert report.prediction_mae_s == {"resize": round(abs(miss.error_s), 3), "loan": None}
    assert report.loans_checked == 0


def test_the_simulated_daemon_checks_its_loans_predictions_as_the_real_one_does() -> None:
    trace = scenario_trace("longtail-drift", scenario_shape(PROFILE), seed=0, steps=20)
    result = simulate(trace, PROFILE, "hysteresis", verl_rules=False)
    checked = [x for x in result.run.facts if isinstance(x, f.LoanChecked)]
    started = {x.plan.resize_id: x for x in result.run.facts if isinstance(x, f.LoanStarted)}
    assert checked and result.report.loans_checked == len(checked)
    assert result.report.prediction_mae_s["loan"] == round(sum(abs(x.error_s) for x in checked) / len(checked), 3)
    for x in checked:  # each against its own loan's prediction, after it started
        assert x.predicted_s == started[x.resize_id].ends_in_s and x.measured_s >= 0 and x.at >= started[x.resize_id].at


def test_a_resize_that_pays_on_a_drifting_workload_is_judged_paid_back() -> None:
    trace = scenario_trace("longtail-drift", scenario_shape(PROFILE), seed=0)
    report = simulate(trace, PROFILE, "planner").report
    assert report.speedup_vs_initial_split > 1.5
    # every resize it made (two since trainers lent to the rollout count in its timings) paid back
    assert report.resizes >= 1 and report.verdicts == {"paid_back": report.resizes}
    for pool in ("rollout", "training"):
        ratio = report.idle_ratio[pool]
        assert ratio is not None and 0.0 <= ratio < 1.0
