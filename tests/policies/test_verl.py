"""verl's rules (`verl-default`, `verl-v1-switch`) as policies: each decision driven with the
loan views the core builds, and through a real core for the progress the view now carries."""

from __future__ import annotations

import pytest

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.machine import loan_view
from dynaresized.core.policy import LoanCosts, LoanView, available_policies, load_policy
from dynaresized.domain import Pool, Split
from dynaresized.policies.verl import VerlDefaultPolicy, VerlV1SwitchPolicy

from tests.core.cluster import EAGER, boot, device, engine, make_core, trainer

S = 1000
COSTS = LoanCosts(return_s=4.0, lead_s=6.0)  # becoming an engine 4 s, going home 6 s
SPLIT = Split(train=6, rollout=2)
TRAINERS = tuple(f"d{i}" for i in range(6))


def view(now: float, *, rollout_step: int, done: int, mb: tuple[int, int] = (16, 16), lent: bool = False,
         total: int = S) -> LoanView:
    """What the core shows after a mini-batch or progress report (mb: done, total)."""
    return LoanView(now=now, split=SPLIT, idle_engines=(), free_trainers=() if lent else TRAINERS,
                    training_devices=0 if lent else 6, mini_batch_done=mb[0], mini_batch_total=mb[1],
                    mini_batch_s=10.0, queue_empty=False, costs=COSTS, rollout_step=rollout_step,
                    samples_done=done, samples_total=total)


def first_rollout(p, *, wait_s: float, queued: int = 0) -> None:
    """Step 0: nothing to train; the trainer waits from 0 for the first batch, done at `wait_s`."""
    p.propose_loan(view(0.0, rollout_step=0, done=queued, mb=(0, 0)))
    p.observe_progress(view(wait_s, rollout_step=0, done=S, mb=(0, 0)))


def test_both_rules_are_installed_entry_points():
    assert {"verl-default", "verl-v1-switch"} <= set(available_policies())
    assert isinstance(load_policy("verl-default"), VerlDefaultPolicy)
    assert isinstance(load_policy("verl-v1-switch"), VerlV1SwitchPolicy)


def test_verl_default_never_resizes_and_keeps_its_hybrids_asleep_for_the_first_rollout():
    p = VerlDefaultPolicy()
    assert p(None) is None  # type: ignore[arg-type]
    assert p.propose_loan(view(0.0, rollout_step=0, done=0, mb=(0, 0))) is None


def test_verl_default_activates_on_a_gap_with_the_pessimistic_first_estimate():
    p = VerlDefaultPolicy()  # deactivate_ratio 0.3
    first_rollout(p, wait_s=500.0)  # waited 500 s for all 1000 samples: 0.5 s per sample
    loan = p.propose_loan(view(600.0, rollout_step=1, done=100))
    assert loan is not None and loan.to_pool == Pool.ROLLOUT.value and loan.devices == TRAINERS
    # gap = 0.3 x 1000 - 100 = 200 samples at 500 s / 1000 samples = 100 s > switch cost 10 s
    assert loan.saves_s == pytest.approx(100.0) and loan.cost_s == pytest.approx(10.0)
    # update_after_step: 1000 samples waited for: ratio += clip(1.0, 0.02, 0.1); home at int(0.4 S)
    assert p.deactivate_ratio == pytest.approx(0.4)
    assert p.switch_overheads == [4.0]  # this cycle's activation (no deactivation before it)
    assert p.observe_progress(view(610.0, rollout_step=1, done=399, lent=True)) is None
    why = p.observe_progress(view(620.0, rollout_step=1, done=400, lent=True))
    assert why and "400 of 1000" in why


def test_verl_default_holds_without_a_gap_and_lowers_the_ratio_without_a_wait():
    p = VerlDefaultPolicy(deactivate_ratio=0.5)
    first_rollout(p, wait_s=300.0, queued=1000)  # the whole batch was there: nothing waited for
    assert p.propose_loan(view(400.0, rollout_step=1, done=600)) is None  # 600 >= 0.5 x 1000: no gap
    assert p.deactivate_ratio == pytest.approx(0.48)
    assert p.per_sample_time_s == 1000.0  # no real wait yet: the pessimistic estimate stays


def test_verl_default_gate_refuses_when_the_benefit_is_below_the_switch_cost():
    p = VerlDefaultPolicy(deactivate_ratio=0.3)
    first_rollout(p, wait_s=10.0)  # 0.01 s per sample
    assert p.propose_loan(view(400.0, rollout_step=1, done=100)) is None  # 200 x 0.01 = 2 s < 10 s
    assert p.per_sample_time_s == pytest.approx(0.01)
    assert p.deactivate_ratio == pytest.approx(0.4)  # still rose: it waited for samples


def test_verl_default_ratio_steps_are_clipped_and_capped():
    p = VerlDefaultPolicy(deactivate_ratio=0.95)
    first_rollout(p, wait_s=100.0, queued=990)  # 10 of 1000 waited for: +0.01 -> clipped to +0.02
    p.propose_loan(view(200.0, rollout_step=1, done=1000))
    assert p.deactivate_ratio == pytest.approx(0.97)
    p.observe_progress(view(201.0, rollout_step=1, done=1000))
    p.propose_loan(view(300.0, rollout_step=2, done=0))  # waited for 0 after its training: -0.02
    assert p.deactivate_ratio == pytest.approx(0.95)


def test_verl_default_switch_cost_is_the_mean_of_the_last_three_cycles():
    p = VerlDefaultPolicy()
    assert p.switch_cost_s() == 10.0
    p.switch_overheads = [4.0, 10.0, 6.0, 10.0]
    assert p.switch_cost_s() == pytest.approx(26.0 / 3)


def test_verl_default_decides_once_per_training_step():
    p = VerlDefaultPolicy()
    first_rollout(p, wait_s=500.0)
    assert p.propose_loan(view(600.0, rollout_step=1, done=100)) is not None
    assert p.propose_loan(view(601.0, rollout_step=1, done=100)) is None


def test_verl_v1_switch_starts_in_rollout_mode_until_the_threshold_is_sampleable():
    p = VerlV1SwitchPolicy()  # ratio 0.4, one mini-batch of 16 the floor
    loan = p.propose_loan(view(0.0, rollout_step=0, done=0, mb=(0, 0)))
    assert loan is not None and loan.to_pool == Pool.ROLLOUT.value
    assert p.observe_progress(view(50.0, rollout_step=0, done=399, mb=(0, 0), lent=True)) is None
    assert p.observe_progress(view(60.0, rollout_step=0, done=400, mb=(0, 0), lent=True))
    assert p.to_trainer_costs == [6.0] and p.to_rollout_costs == []


def test_verl_v1_switch_threshold_is_floored_at_a_mini_batch_and_capped_at_the_batch():
    p = VerlV1SwitchPolicy(switch_threshold_ratio=0.01, parameter_sync_step=16)
    assert p.threshold(1024) == 64
    p.ratio = 1.0
    assert p.threshold(1024) == 1024


def test_verl_v1_switch_adapts_after_two_idle_or_calm_steps():
    p = VerlV1SwitchPolicy()
    p._adapt(True)
    assert p.ratio == pytest.approx(0.4)
    p._adapt(True)
    assert p.ratio == pytest.approx(0.45)
    p._adapt(False)
    p._adapt(False)
    assert p.ratio == pytest.approx(0.42)
    p.ratio = 0.07
    p._adapt(False)
    assert p.ratio == pytest.approx(1 / 16)


def test_verl_v1_switch_weighs_benefit_against_measured_switch_cost():
    p = VerlV1SwitchPolicy(adaptive_switch_threshold=False)
    p.propose_loan(view(0.0, rollout_step=0, done=0, mb=(0, 0)))
    p.observe_progress(view(40.0, rollout_step=0, done=400, mb=(0, 0), lent=True))  # home: 6 s measured
    p.observe_progress(view(100.0, rollout_step=0, done=S, mb=(0, 0)))  # waited 60 s for 600 samples
    loan = p.propose_loan(view(300.0, rollout_step=1, done=100))
    # remaining 300 x 0.1 s x (1 - 2/8): 22.5 s; cost unknown (nothing lent to rollout yet): no check
    assert loan is not None and loan.cost_s == 0.0
    p.observe_progress(view(310.0, rollout_step=1, done=400, lent=True))
    p.observe_progress(view(330.0, rollout_step=1, done=S))  # waited 20 s for 600 more: 80 s / 1200
    # remaining 50 x 0.0667 x 0.75 = 2.5 s <= 4 + 6 s of switches: stays in trainer mode
    assert p.propose_loan(view(500.0, rollout_step=2, done=350)) is None


# -- through the core: the view's progress and the hook that sends loans home --------------


def test_the_loan_view_sums_the_engines_progress_of_the_rollout_step_in_progress():
    d = boot(make_core(EAGER, "verl-default"), 2, 2)
    d.send(ev.MiniBatchDone(at=0.0, worker_id=trainer(0), step=0, done=0, total=0))  # rollout 0 in progress
    for i, done in ((2, 30), (3, 45)):
        d.send(ev.ProgressReported(at=d.at(), worker_id=engine(i), step=0, done=done, total=100))
    d.send(ev.ProgressReported(at=d.at(), worker_id=engine(0), step=1, done=5, total=100))  # another step
    v = loan_view(d.core, d.state, d.now)
    assert (v.rollout_step, v.samples_done, v.samples_total) == (0, 75, 100)


def test_a_lent_trainer_goes_home_when_the_rule_has_its_samples():
    d = boot(make_core(EAGER, "verl-v1-switch"), 2, 2)
    for i in (2, 3):
        d.send(ev.ProgressReported(at=0.0, worker_id=engine(i), step=0, done=0, total=100))
    facts, _ = d.send(ev.MiniBatchDone(at=0.0, worker_id=trainer(0), step=0, done=0, total=0))
    assert any(isinstance(x, f.LoanStarted) and x.plan.to_pool is Pool.ROLLOUT for x in facts)
    d.finish()
    assert set(d.state.lent_devices()) == {device(0), device(1)}
    d.send(ev.ProgressReported(at=d.at(), worker_id=engine(2), step=0, done=20, total=100))
    assert d.state.lent_devices()  # 20 + 0 of 100: below the threshold of 40
    facts, _ = d.send(ev.ProgressReported(at=d.at(), worker_id=engine(0), step=0, done=20, total=100))
    assert any(isinstance(x, f.LoanReturnStarted) and "40 of 100" in x.reason for x in facts)
    d.finish()
    assert not d.state.lent_devices()
    assert d.replayed().durable() == d.state.durable()  # when a worker was last heard from is soft
