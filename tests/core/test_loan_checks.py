"""A loan's prediction checked against what was measured (`LoanChecked`): the seconds from the
loan's start until the stage it serves finished the step, predicted by the policy and measured
at the step's last mini-batch (a loan to training) or from the step report (to the rollout);
the mean absolute errors of resizes' and loans' predictions in the state and in `status`."""

from __future__ import annotations

import pytest

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.cli import render_status
from dynaresized.daemon.service import status_of
from dynaresized.daemon.status import outcome_status
from dynaresized.domain import Pool, StepTiming

from .cluster import trainer
from .test_loans import idle, lending_cluster, nothing_to_train, pace, report_step


def test_a_loan_to_training_is_checked_at_its_steps_last_mini_batch():
    d = lending_cluster()
    pace(d)  # mini-batches 1 and 2 of 8, 60 s apart
    facts, _ = idle(d)
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.check_step == 0 and started.ends_in_s > 0
    d.finish()
    assert d.state.loan_checks and d.state.loan_checks[0].resize_id == started.plan.resize_id
    for done in range(3, 8):
        facts, _ = d.send(ev.MiniBatchDone(at=d.at(40.0), worker_id=trainer(0), step=0, done=done, total=8))
        assert not any(isinstance(x, f.LoanChecked) for x in facts)  # not before the stage is done
    end = d.at(40.0)
    facts, _ = d.send(ev.MiniBatchDone(at=end, worker_id=trainer(0), step=0, done=8, total=8))
    checked = next(x for x in facts if isinstance(x, f.LoanChecked))
    assert checked.resize_id == started.plan.resize_id and checked.to_pool is Pool.TRAINING and checked.step == 0
    assert checked.predicted_s == started.ends_in_s and checked.measured_s == pytest.approx(end - started.at)
    assert checked.error_s == pytest.approx(checked.measured_s - checked.predicted_s)
    assert checked.saves_s == started.saves_s
    a = d.state.loan_accuracy
    assert a.checked == 1 and a.mae_s == pytest.approx(abs(checked.error_s))
    assert a.relative == pytest.approx(abs(checked.error_s) / checked.measured_s)
    assert d.state.loan_checks == ()
    assert outcome_status(d.state)["accuracy"]["loan"] == {"checked": 1, "mae_s": a.mae_s, "relative_error": a.relative}
    assert (f"accuracy    loans 1 checked, mean abs error {a.mae_s:.1f}s ({a.relative:.0%} of what was measured)"
            in render_status(status_of(d.state)).splitlines())
    assert d.replayed().durable() == d.state.durable()


def test_a_loan_to_the_rollout_is_checked_on_its_steps_report():
    d = lending_cluster()
    facts, _ = nothing_to_train(d)  # the first window: trainers lent to rollout 0
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.to_pool is Pool.ROLLOUT and started.check_step == 0
    assert started.stage_elapsed_s == 0.0 and started.ends_in_s > 0  # the window began with that report
    d.finish()
    d.send(ev.MiniBatchDone(at=d.at(100.0), worker_id=trainer(0), step=0, done=0, total=8))  # they go home
    d.finish()
    assert len(d.state.loan_checks) == 1  # training began: the rollout it served is measured at the report
    facts, _ = d.send(ev.StepReported(at=d.at(300.0), worker_id=trainer(0), timing=StepTiming(
        step=0, rollout_s=120.0, train_s=250.0, rollout_devices=2, train_devices=2)))
    checked = next(x for x in facts if isinstance(x, f.LoanChecked))
    assert checked.to_pool is Pool.ROLLOUT and checked.step == 0
    assert checked.measured_s == pytest.approx(120.0) and checked.predicted_s == started.ends_in_s
    assert d.state.loan_accuracy.checked == 1 and d.state.loan_checks == ()
    assert d.replayed().durable() == d.state.durable()


def test_a_loan_whose_stage_end_never_came_is_dropped_unchecked():
    d = lending_cluster()
    pace(d)
    facts, _ = idle(d)
    assert any(isinstance(x, f.LoanStarted) for x in facts)
    d.finish()
    facts = report_step(d, 0)  # the trainer never said its last mini-batch was done
    assert not any(isinstance(x, f.LoanChecked) for x in facts)
    assert d.state.loan_checks == () and d.state.loan_accuracy.checked == 0
    assert outcome_status(d.state)["accuracy"]["loan"] == {"checked": 0, "mae_s": None, "relative_error": None}


def test_a_resizes_prediction_check_counts_in_the_resize_accuracy():
    from dynaresized.core.state import ClusterState, mutate

    s = ClusterState()
    for i, (predicted, measured) in enumerate([(100.0, 110.0), (50.0, 45.0)]):
        s = mutate(s, f.PredictionChecked(at=float(i), resize_id=f"r{i}", steps=3, predicted_step_s_after=predicted,
                                          measured_step_s_after=measured, error_s=measured - predicted))
    assert s.resize_accuracy.checked == 2 and s.resize_accuracy.mae_s == pytest.approx(7.5)
    assert s.resize_accuracy.relative == pytest.approx(15.0 / 155.0)
