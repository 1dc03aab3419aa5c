"""Lending inside `hysteresis` and `planner`: lend idle engines only from measured progress, and
only what the rest of the step can use."""

from __future__ import annotations

import msgspec
import pytest

from dynaresized.core.guards import GuardConfig, check_loan
from dynaresized.core.policy import LoanCosts, LoanView, load_policy
from dynaresized.domain import Split, StepTiming

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
    assert p.reason == ("lent n0:gpu7 to training at mini-batch 4/16: rollout queue empty, 1 idle device(s), "
                        "saves ~44 s (cost ~4 s)")
    slow_join = policy.propose_loan(view(done=4, total=16, pace_s=5.0))  # the 6 s lead costs one more
    assert slow_join.saves_s == pytest.approx(10 * 5.0 * 1 / 5)


def test_a_loan_decided_inside_a_mini_batch_counts_how_far_it_is():
    # mini-batch 4 of 16 was reported 15 s ago (20 s each): the one running is 15 s along, so
    # training has 12 x 20 - 15 = 225 s left, and the loan (6 s lead) catches the 10 mini-batches
    # after the next-but-one boundary (15 + 6 > 20); the prediction of training's end says so
    policy = load_policy("hysteresis")
    p = policy.propose_loan(msgspec.structs.replace(view(done=4, total=16, pace_s=20.0), mini_batch_at=85.0))
    assert p is not None and p.saves_s == pytest.approx(10 * 20.0 * 1 / 5)
    assert p.ends_in_s == pytest.approx(225.0 - 10 * 20.0 / 5 + COSTS.to_training_s)
    # reported just now: nothing of it is done; as before
    q = policy.propose_loan(msgspec.structs.replace(view(done=4, total=16, pace_s=20.0), mini_batch_at=100.0))
    assert q.saves_s == pytest.approx(11 * 20.0 * 1 / 5)
    assert q.ends_in_s == pytest.approx(240.0 - 11 * 20.0 / 5 + COSTS.to_training_s)
    # the running one is overdue: as far as the pace says, it is done any moment
    r = policy.propose_loan(msgspec.structs.replace(view(done=4, total=16, pace_s=20.0), mini_batch_at=50.0))
    assert r.saves_s == pytest.approx(10 * 20.0 * 1 / 5) and r.ends_in_s == pytest.approx(220.0 - 40.0 + 3.0)


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


def trainers_view(free: tuple[str, ...] = ("n0:gpu0", "n0:gpu1"), total: int = 0, done: int = 0,
                  queue_empty: bool = False, recent: tuple[StepTiming, ...] = ()) -> LoanView:
    return LoanView(now=100.0, split=Split(6, 2), idle_engines=(), free_trainers=free, training_devices=6,
                    mini_batch_done=done, mini_batch_total=total, mini_batch_s=0.0, queue_empty=queue_empty,
                    costs=COSTS, recent=recent)


def test_trainers_with_nothing_to_train_are_lent_to_a_rollout_with_queued_requests():
    policy = load_policy("hysteresis")
    p = policy.propose_loan(trainers_view())
    # nothing measured yet: the rollout ahead is taken to last unmeasured_rollout_s (300 s)
    assert p is not None and p.to_pool == "rollout" and p.devices == ("n0:gpu0", "n0:gpu1")
    assert p.saves_s == pytest.approx((300.0 - 6.0) * 2 / 4)
    assert p.cost_s == pytest.approx(3.0 + 4.0 / 6 * 2)
    assert "nothing to train yet, rollout queue not empty" in p.reason
    assert check_loan(trainers_view(), p, GuardConfig()) is None
    assert policy.propose_loan(trainers_view(queue_empty=True)) is None, "nothing queued: nothing to pull"
    assert load_policy("hysteresis", {"lending": False}).propose_loan(trainers_view()) is None


def test_after_the_last_mini_batch_the_saving_is_the_rollout_left_over_the_training_just_done():
    # the last step: rollout 400 s on 2 devices, trained in 100 s on 6
    step = StepTiming(step=0, rollout_s=400.0, train_s=100.0, rollout_devices=2, train_devices=6)
    p = load_policy("hysteresis").propose_loan(trainers_view(total=8, done=8, recent=(step,)))
    assert p is not None and p.saves_s == pytest.approx((400.0 - 100.0 - 6.0) * 2 / 4)
    assert "training step done (8/8)" in p.reason
    # the same rollout time, but 4 devices served it (trainers lent to it): twice the work ahead
    served = StepTiming(step=0, rollout_s=400.0, train_s=100.0, rollout_devices=2, train_devices=6,
                        rollout_device_s=1600.0)
    q = load_policy("hysteresis").propose_loan(trainers_view(total=8, done=8, recent=(served,)))
    assert q is not None and q.saves_s == pytest.approx((800.0 - 100.0 - 6.0) * 2 / 4)
    # a training-bound step leaves no rollout to help with: no saving, the guard refuses
    quick = StepTiming(step=0, rollout_s=100.0, train_s=200.0, rollout_devices=2, train_devices=6)
    r = load_policy("hysteresis").propose_loan(trainers_view(total=8, done=8, recent=(quick,)))
    assert r is not None and r.saves_s == 0.0 and check_loan(trainers_view(), r, GuardConfig()) is not None


def test_trainers_the_job_takes_back_early_serve_until_the_share_of_samples_its_step_report_says():
    # verl deactivates its hybrid replicas once deactivate_wait_samples are queued: its step
    # report says at 3/8 of the next step's samples (the rollout 400 s on the home pool), 1/8
    # already generated
    step = StepTiming(step=4, rollout_s=400.0, train_s=10.0, rollout_devices=2, train_devices=6,
                      loan_home_share=0.375, next_done_share=0.125)
    view = msgspec.structs.replace(trainers_view(total=1, done=1, recent=(step,)), rollout_step=5,
                                   step_started_at=0.0)
    p = load_policy("hysteresis").propose_loan(view)
    # (3/8 - 1/8) of 400 s, whenever the step began
    assert p is not None and p.saves_s == pytest.approx((0.25 * 400.0 - 6.0) * 2 / 4)
    assert "taken back at 38% of the step's samples, 12% generated: ~100.0 s of rollout" in p.reason
    # a count of whole samples misses those in flight: the rollout is at least the training in
    trained = msgspec.structs.replace(view, recent=(msgspec.structs.replace(step, train_s=80.0),))
    q = load_policy("hysteresis").propose_loan(trained)
    assert q is not None and q.saves_s == pytest.approx((0.375 * 400.0 - 80.0 - 6.0) * 2 / 4)
    # a share reported for another step is not this rollout's: the time the step has run decides
    other = msgspec.structs.replace(view, rollout_step=7)
    r = load_policy("hysteresis").propose_loan(other)
    assert r is not None and r.saves_s == pytest.approx((400.0 - 100.0 - 6.0) * 2 / 4)
    # nothing left for them to generate: nothing saved, the guard refuses
    done = msgspec.structs.replace(view, recent=(msgspec.structs.replace(step, next_done_share=0.5),))
    none = load_policy("hysteresis").propose_loan(done)
    assert none is not None and none.saves_s == 0.0 and check_loan(done, none, GuardConfig()) is not None


def test_before_any_step_is_measured_a_trainer_loan_reads_the_live_progress_or_names_its_prior():
    live = msgspec.structs.replace(trainers_view(), step_started_at=40.0, samples_done=256, samples_total=1024)
    p = load_policy("hysteresis").propose_loan(live)
    # 256 of 1024 samples in 60 s: 180 s ahead at that pace
    assert p is not None and p.saves_s == pytest.approx((180.0 - 6.0) * 2 / 4)
    assert "256/1024 samples done in 60.0 s" in p.reason
    q = load_policy("hysteresis", {"unmeasured_rollout_s": 2.0}).propose_loan(trainers_view())
    assert q is not None and q.saves_s == 0.0 and "prior unmeasured_rollout_s=2" in q.reason
    assert check_loan(trainers_view(), q, GuardConfig()) is not None  # a 2 s prior does not pay a loan
    with pytest.raises(ValueError, match="unmeasured_rollout_s must be a number of seconds > 0"):
        load_policy("hysteresis", {"unmeasured_rollout_s": -1})


def engine_view(now: float, train_s: float = 200.0) -> LoanView:
    """6:2, the last steps: rollout 300 s on 2 devices, training `train_s` on 6; the step began at
    t=0, one engine idle at mini-batch 4 of 16 (20 s each)."""
    steps = tuple(StepTiming(step=k, rollout_s=300.0, train_s=train_s, rollout_devices=2, train_devices=6)
                  for k in range(3))
    return LoanView(now=now, split=Split(6, 2), idle_engines=("n0:gpu7",), free_trainers=(), training_devices=6,
                    mini_batch_done=4, mini_batch_total=16, mini_batch_s=20.0, queue_empty=True, costs=COSTS,
                    recent=steps, step_started_at=0.0)


def test_an_idle_engine_lent_to_training_saves_only_what_training_outlasts_the_rollout_by():
    view = engine_view(now=100.0)
    # training: 12 x 20 = 240 s left; the rollout: 300 - 100 = 200 s left; the loan makes
    # training 11 mini-batches x 20 s x 1/7 = 31 s sooner, all of it within the 40 s it outlasts the rollout
    p = load_policy("hysteresis").propose_loan(view)
    assert p is not None and p.saves_s == pytest.approx(min(11 * 20.0 / 7, 240.0 - 200.0))
    assert "training ~240 s left, rollout ~200 s" in p.reason
    # the rollout outlasts training: nothing to save
    later = msgspec.structs.replace(view, mini_batch_done=12)
    q = load_policy("hysteresis").propose_loan(later)
    assert q is not None and q.saves_s == 0.0
    # every rollout engine idle: the rollout is done, the cap is off
    done = msgspec.structs.replace(later, idle_engines=("n0:gpu6", "n0:gpu7"))
    r = load_policy("hysteresis").propose_loan(done)
    assert r is not None and r.saves_s == pytest.approx(3 * 20.0 * 2 / 8)


def test_an_engine_lent_to_training_is_priced_with_its_late_way_home():
    # rollout 300 s on 2 devices, training 200 s: one engine lent comes home 4 s late, the
    # router holding its share of the next step for it, so that rollout ends up to 4 s later
    # (before the router held it, the engine on time could take every request and the next
    # rollout ran on one device: 300 s more). Both lent: 4 s too. Training that outlasts even the
    # late rollout: nothing.
    one = engine_view(now=400.0)
    p = load_policy("hysteresis").propose_loan(one)
    assert p is not None and p.cost_s == pytest.approx(3.0 + 4.0)
    both = msgspec.structs.replace(one, idle_engines=("n0:gpu6", "n0:gpu7"))
    q = load_policy("hysteresis").propose_loan(both)
    assert q is not None and q.cost_s == pytest.approx(3.0 + 4.0)
    r = load_policy("hysteresis").propose_loan(engine_view(now=400.0, train_s=700.0))
    assert r is not None and r.cost_s == pytest.approx(3.0)
    s = load_policy("hysteresis").propose_loan(engine_view(now=400.0, train_s=302.0))
    assert s is not None and s.cost_s == pytest.approx(3.0 + 2.0), "only what the late rollout outlasts training by"


def test_a_step_slower_than_the_last_ones_is_priced_at_its_own_pace():
    # the last step: rollout 100 s on 2 devices, training 200 s: by the model the rollout in
    # progress (begun at 0) is done at 100 s; but at 100 s only 256 of its 1,024 samples are
    step = StepTiming(step=0, rollout_s=100.0, train_s=200.0, rollout_devices=2, train_devices=6)
    seen = msgspec.structs.replace(trainers_view(total=8, done=8, recent=(step,)), step_started_at=0.0,
                                   samples_done=256, samples_total=1024, rollout_step=1)
    p = load_policy("hysteresis").propose_loan(seen)
    assert p is not None and p.saves_s == pytest.approx((100.0 * 768 / 256 - 6.0) * 2 / 4)
    assert "256/1024 samples done in 100.0 s: ~300.0 s ahead at that pace" in p.reason
    assert "linear model of the last steps says ~0.0 s" in p.reason
    # where the model sees more ahead than the pace does, the pace decides too: the model's time
    # includes the tail's latency floor, which lent devices do not shorten (the samples still
    # queued are what they take a share of)
    long = msgspec.structs.replace(seen, recent=(msgspec.structs.replace(step, rollout_s=600.0),))
    q = load_policy("hysteresis").propose_loan(long)
    assert q is not None and q.saves_s == pytest.approx((300.0 - 6.0) * 2 / 4)
    assert "~300.0 s ahead at that pace (the linear model of the last steps says ~500.0 s)" in q.reason
    # before a sample of the step is done, the model decides
    early = msgspec.structs.replace(long, samples_done=0)
    r = load_policy("hysteresis").propose_loan(early)
    assert r is not None and r.saves_s == pytest.approx((500.0 - 6.0) * 2 / 4)
    assert "rollout ~500 s ahead (linear model)" in r.reason
