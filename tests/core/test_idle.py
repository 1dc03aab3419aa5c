"""Idle accounting against a trace computed by hand: per step, per pool, per device, the
unknown cases (a stage not measured, a device moving), replay, status, metrics and the text
operators read."""

from __future__ import annotations

import math

import pytest

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.idle import IdleTotals, idle_ratio, percent, step_idle, step_period_s
from dynaresized.core.state import fold
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.service import status_of
from dynaresized.cli import render_status
from dynaresized.domain import Pool, StepTiming
from dynaresized.explain import explain

from .cluster import boot, device, make_core, trainer


def timing(step: int, rollout_s: float, train_s: float, sync_s: float = 0.0) -> StepTiming:
    return StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, weight_sync_s=sync_s)


def test_one_step_by_hand() -> None:
    # period = max(6, 2) + 1 = 7; rollout busy 6 + 1 = 7 of 7; training busy 2 + 1 = 3 of 7
    figures = step_idle(timing(0, 6.0, 2.0, 1.0), rollout_devices=2, train_devices=3)
    assert figures.period_s == 7.0
    assert figures.rollout is not None and figures.training is not None
    assert (figures.rollout.busy_s, figures.rollout.idle_s) == (14.0, 0.0)
    assert (figures.training.busy_s, figures.training.idle_s) == (9.0, 12.0)
    assert figures.training.ratio == pytest.approx(4 / 7)
    assert idle_ratio(timing(0, 6.0, 2.0, 1.0), Pool.TRAINING) == pytest.approx(4 / 7)
    assert idle_ratio(timing(0, 6.0, 2.0, 1.0), Pool.ROLLOUT) == 0.0  # a real zero: fully busy


@pytest.mark.parametrize("rollout_s, train_s", [(0.0, 3.0), (3.0, 0.0), (0.0, 0.0)])
def test_a_stage_not_measured_is_unknown_not_zero(rollout_s: float, train_s: float) -> None:
    t = timing(0, rollout_s, train_s, 1.0)
    assert step_period_s(t) is None
    figures = step_idle(t, rollout_devices=2, train_devices=2)
    assert figures.rollout is None and figures.training is None
    assert idle_ratio(t, Pool.ROLLOUT) is None and idle_ratio(t, Pool.TRAINING) is None
    assert percent(None) == "unknown"
    assert IdleTotals().ratio is None  # nothing accounted: unknown, not 0 %


def test_trace_by_hand_through_the_core() -> None:
    d = boot(make_core(), train=2, rollout=2)  # n0:gpu0-1 train, n0:gpu2-3 roll out
    steps = [timing(0, 6.0, 2.0, 1.0), timing(1, 0.0, 3.0), timing(2, 2.0, 4.0)]
    for t in steps:
        d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=t))
    # step 0: period 7. rollout: 2 x busy 7, idle 0. training: 2 x busy 3, idle 4.
    # step 1: no rollout time, so no period: unknown for both pools and all devices.
    # step 2: period 4. rollout: 2 x busy 2, idle 2. training: 2 x busy 4, idle 0.
    idle = d.state.idle
    assert idle.pool(Pool.ROLLOUT) == IdleTotals(busy_s=18.0, idle_s=4.0, steps=2, unknown_steps=1)
    assert idle.pool(Pool.TRAINING) == IdleTotals(busy_s=14.0, idle_s=8.0, steps=2, unknown_steps=1)
    assert idle.pool(Pool.ROLLOUT).ratio == pytest.approx(4 / 22)
    assert idle.pool(Pool.TRAINING).ratio == pytest.approx(8 / 22)
    assert idle.devices[device(0)] == IdleTotals(busy_s=7.0, idle_s=4.0, steps=2, unknown_steps=1)
    assert idle.devices[device(3)] == IdleTotals(busy_s=9.0, idle_s=2.0, steps=2, unknown_steps=1)
    assert idle.last is not None and idle.last.step == 2
    assert idle.last.rollout is not None and idle.last.rollout.ratio == 0.5

    # step 3 while n0:gpu1 moves to rollout: it belongs to no pool, so its step is unknown;
    # the pools count only their placed devices (1 training, 2 rollout).
    d.force(1, 3)
    assert d.state.devices[device(1)].is_moving
    d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=timing(3, 3.0, 1.0)))
    idle = d.state.idle
    assert idle.pool(Pool.TRAINING) == IdleTotals(busy_s=15.0, idle_s=10.0, steps=3, unknown_steps=1)
    assert idle.pool(Pool.ROLLOUT) == IdleTotals(busy_s=24.0, idle_s=4.0, steps=3, unknown_steps=1)
    assert idle.devices[device(1)] == IdleTotals(busy_s=7.0, idle_s=4.0, steps=2, unknown_steps=2)
    assert idle.devices[device(0)] == IdleTotals(busy_s=8.0, idle_s=6.0, steps=3, unknown_steps=1)

    assert fold(d.log).durable() == d.state.durable()  # replay == live, idle figures included


def test_status_metrics_and_events_say_unknown_where_there_is_no_figure() -> None:
    d = boot(make_core(), train=2, rollout=2)
    status = status_of(d.state)
    assert status["idle"]["pools"]["rollout"]["ratio"] is None
    assert "rollout unknown (last step unknown)" in render_status(status)

    facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=timing(0, 0.0, 3.0)))
    (observed,) = [x for x in facts if isinstance(x, f.StepObserved)]
    assert "idle rollout unknown, training unknown" in explain(observed)
    metrics = Metrics()
    metrics.observe(d.state, facts)
    value = metrics.registry.get_sample_value("dynaresized_pool_idle_ratio", {"pool": "training"})
    assert value is not None and math.isnan(value)

    facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=timing(1, 1.0, 4.0)))
    (observed,) = [x for x in facts if isinstance(x, f.StepObserved)]
    assert "idle rollout 75.0%, training 0.0%" in explain(observed)
    metrics.observe(d.state, facts)
    assert metrics.registry.get_sample_value("dynaresized_pool_idle_ratio", {"pool": "rollout"}) == 0.75
    assert metrics.registry.get_sample_value("dynaresized_pool_idle_device_seconds", {"pool": "rollout"}) == 6.0
    assert metrics.registry.get_sample_value("dynaresized_pool_idle_unknown_steps", {"pool": "rollout"}) == 1
    assert metrics.registry.get_sample_value("dynaresized_device_idle_ratio", {"device": device(3)}) == 0.75
    text = render_status(status_of(d.state))
    assert "rollout 75.0% (last step 75.0%)" in text and "1 unknown" in text
    assert f"{device(3):<20} {'rollout':<28} {'75.0%':<9}" in text
