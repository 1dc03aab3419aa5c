"""benchmarks/prediction_check.py: the demo's prediction errors over runs, the median of those
that checked something, with a short real run of the demo."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_module import load


@pytest.fixture(scope="module")
def bench():
    return load("prediction_check")


def test_the_median_skips_runs_that_checked_nothing(bench):
    runs = [{"prediction_mae_s": {"resize": 30.0, "loan": 10.0}}, {"prediction_mae_s": {"resize": None, "loan": 14.0}},
            {"prediction_mae_s": {"resize": 50.0, "loan": 12.0}}]
    assert bench.median_of(runs, "prediction_mae_s") == {"resize": 40.0, "loan": 12.0}
    assert bench.median_of([{"prediction_mae_s": {"resize": None, "loan": None}}], "prediction_mae_s") == {
        "resize": None, "loan": None}


def test_one_short_run_reports_what_the_demo_checked(bench, capsys):
    assert bench.main(["--runs", "1", "--steps", "12"]) == 0
    out = json.loads(capsys.readouterr().out)
    [run] = out["per_run"]
    assert out["runs"] == 1 and run["predictions_checked"]["loan"] >= 1
    assert out["prediction_mae_s"]["loan"] == run["prediction_mae_s"]["loan"] >= 0
