"""Lending inside `hysteresis` and `planner`: lend idle engines only from measured progress, and
only what the rest of the step can use."""

from __future__ import annotations

import pytest

from dynaresized.core.guards import GuardConfig, check_loan
from dynaresized.core.policy import LoanCosts, LoanView, load_policy
from dynaresized.domain import Split

COSTS = LoanCosts(to_training_s=3.0, to_rollout_s=3.0, return_s=4.0, lead_s=6.0)


def view(idle: tuple[str, ...] = ("n0:gpu7",), done: int = 4, total: int = 16, pace_s: float = 20.0,
         training: int = 4) -> LoanView:
    return LoanView(now=100.0, split=Split(4, 4), idle_engines=idle, free_trainers=(), training_devices=training,
                    mini_batch_done=done, mini_batch_total=total, mini_batch_s=pace_s, queue_empty=True, costs=COSTS)


@pytest.mark.parametrize("name", ["hysteresis", "planner"])
def test_lending_is_on_by_default_and_an_option_turns_it_off(name):
    assert load_policy(name).propose_loan(view()) is not None
    assert load_policy(name, {"lending": False}).propose_loan(view()) is None


def test_saving_counts_the_mini_batches_the_loan_still_catches():
    policy = load_policy("hysteresis")
    p = policy.propose_loan(view(done=4, total=16, pace_s=20.0))
    # 12 left; the one running now and none lost to the 6 s lead: 11 caught, 1/5 of each saved
    assert p is not None and p.devices == ("n0:gpu7",) and p.to_pool == "training"
    assert p.saves_s == pytest.approx(11 * 20.0 * 1 / 5)
    assert p.cost_s == pytest.approx(3.0 + 4.0 / 4)
    assert p.reason == ("lent n0:gpu7 to training at mini-batch 4/16: rollout queue empty, 1 engine(s) idle, "
                        "saves ~44 s (cost ~4 s)")
    slow_join = policy.propose_loan(view(done=4, total=16, pace_s=5.0))  # the 6 s lead costs one more
    assert slow_join.saves_s == pytest.approx(10 * 5.0 * 1 / 5)


def test_no_loan_without_idle_engines_measured_pace_or_training_left():
    policy = load_policy("hysteresis")
    assert policy.propose_loan(view(idle=())) is None
    assert policy.propose_loan(view(pace_s=0.0)) is None  # one mini-batch reported: no pace yet
    assert policy.propose_loan(view(done=16)) is None
    last = policy.propose_loan(view(done=15))  # only the running mini-batch is left
    assert last is not None and last.saves_s == 0.0


def test_the_guard_lends_only_idle_devices_and_only_when_it_pays():
    cfg = GuardConfig()
    policy = load_policy("hysteresis")
    assert check_loan(view(), policy.propose_loan(view()), cfg) is None
    late = policy.propose_loan(view(done=14))
    refused = check_loan(view(done=14), late, cfg)
    assert refused is not None and refused.guard == "loan_payback"
    assert refused.reason == "saves ~4.0s, not above cost 4.0s x loan_safety 1"
    busy = check_loan(view(idle=("n0:gpu6",)), policy.propose_loan(view()), cfg)
    assert busy is not None and busy.guard == "loan_idle" and "n0:gpu7: engine has work left" in busy.reason
