"""Hysteresis guards: each guard alone, then the core with the hysteresis policy over long runs:
no two resizes inside the cooldown or the dwell, a single noisy step never resizes, a sustained
imbalance does, toward the slower stage."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import guards as g
from dynaresized.core.guards import GuardConfig, History, Rejection
from dynaresized.core.policy import ObservedView, Proposal, ResizeCosts
from dynaresized.core.resizes import UNDO_SOURCE
from dynaresized.domain import Pool, Split, StepTiming

from .cluster import Driver, boot, make_core, trainer

CFG = GuardConfig()


def timing(step: int, rollout_s: float, train_s: float, split: Split = Split(6, 2)) -> StepTiming:
    return StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, rollout_devices=split.rollout,
                      train_devices=split.train)


def view(recent: tuple[StepTiming, ...] = (), *, split: Split = Split(6, 2), candidates: tuple[Split, ...] = (),
         now: float = 1000.0, step: int | None = None, costs: ResizeCosts = ResizeCosts(),
         steps_remaining: int | None = None) -> ObservedView:
    last = step if step is not None else (recent[-1].step if recent else -1)
    return ObservedView(now=now, step=last, split=split, candidates=candidates, recent=recent, costs=costs,
                        steps_remaining=steps_remaining)


def proposal(target: Split, saving_s: float = 64.0) -> Proposal:
    # 256 and binary fractions keep `saving_per_step_s` exact, so boundaries can be tested
    return Proposal(target=target, reason="test", predicted_step_s=256.0, predicted_step_s_after=256.0 - saving_s)


ROLLOUT_SLOW = [timing(i, 255.0, 100.0) for i in range(5)]
GROW_ROLLOUT = proposal(Split(4, 4))
GROW_TRAINING = proposal(Split(7, 1))
NOBODY = History()


def rejected(r: Rejection | None, guard: str, *words: str) -> None:
    assert r is not None, "expected a rejection"
    assert r.guard == guard
    for w in words:
        assert w in r.reason, r.reason


# -- signal ------------------------------------------------------------------------------


def test_signal_is_the_slower_stage_past_the_threshold() -> None:
    assert g.signal(timing(0, 255.0, 100.0), 0.15) is Pool.ROLLOUT
    assert g.signal(timing(0, 100.0, 255.0), 0.15) is Pool.TRAINING
    assert g.signal(timing(0, 100.0, 90.0), 0.15) is None
    assert g.signal(timing(0, 100.0, 85.0), 0.15) is Pool.ROLLOUT  # exactly at the threshold counts
    assert g.signal(timing(0, 0.0, 0.0), 0.15) is None


# -- each guard alone -------------------------------------------------------------------


def test_threshold() -> None:
    rejected(g.check_threshold(view(), GROW_ROLLOUT, CFG, NOBODY), "threshold", "no step observed")
    balanced = (timing(0, 100.0, 90.0),)
    rejected(g.check_threshold(view(balanced), GROW_ROLLOUT, CFG, NOBODY), "threshold", "step 0", "10.0%", "15%")
    assert g.check_threshold(view(tuple(ROLLOUT_SLOW[:1])), GROW_ROLLOUT, CFG, NOBODY) is None
    rejected(g.check_threshold(view(tuple(ROLLOUT_SLOW[:1])), GROW_TRAINING, CFG, NOBODY), "threshold",
             "asks to grow rollout", "proposal grows training")
    # only the last step decides
    settled = (*ROLLOUT_SLOW[:3], timing(3, 100.0, 95.0))
    rejected(g.check_threshold(view(settled), GROW_ROLLOUT, CFG, NOBODY), "threshold")
    lower = GuardConfig(imbalance_threshold=0.05)
    assert g.check_threshold(view(settled), GROW_ROLLOUT, lower, NOBODY) is None


@pytest.mark.parametrize("run,needed,ok", [(1, 3, False), (2, 3, False), (3, 3, True), (5, 3, True),
                                           (1, 1, True), (4, 5, False)])
def test_signal_run_counts_consecutive_steps(run: int, needed: int, ok: bool) -> None:
    recent = (timing(0, 100.0, 255.0), timing(1, 100.0, 100.0)) + tuple(timing(2 + i, 255.0, 100.0)
                                                                        for i in range(run))
    cfg = GuardConfig(signal_run=needed)
    r = g.check_signal_run(view(recent), GROW_ROLLOUT, cfg, NOBODY)
    if ok:
        assert r is None
    else:
        rejected(r, "signal_run", f"{run} consecutive", f"signal_run={needed}")


def test_signal_run_is_broken_by_a_step_the_other_way_or_a_balanced_one() -> None:
    cfg = GuardConfig(signal_run=3)
    for breaker in (timing(2, 100.0, 255.0), timing(2, 100.0, 100.0)):
        recent = (timing(0, 255.0, 100.0), timing(1, 255.0, 100.0), breaker, timing(3, 255.0, 100.0),
                  timing(4, 255.0, 100.0))
        rejected(g.check_signal_run(view(recent), GROW_ROLLOUT, cfg, NOBODY), "signal_run", "2 consecutive")
    # steps asking for the other pool are not a run for this proposal
    rejected(g.check_signal_run(view(tuple(ROLLOUT_SLOW)), GROW_TRAINING, cfg, NOBODY), "signal_run",
             "0 consecutive", "grow training")


def test_dwell() -> None:
    cfg = GuardConfig(min_dwell_s=60.0)
    assert g.check_dwell(view(now=5.0), GROW_ROLLOUT, cfg, NOBODY) is None  # no resize yet
    h = History(last_resize_end_at=950.0, last_resize_end_step=0)
    rejected(g.check_dwell(view(now=1000.0), GROW_ROLLOUT, cfg, h), "dwell", "50.0s", "min_dwell_s=60")
    assert g.check_dwell(view(now=1010.0), GROW_ROLLOUT, cfg, h) is None  # exactly the dwell
    assert g.check_dwell(view(now=1500.0), GROW_ROLLOUT, cfg, h) is None


def test_cooldown() -> None:
    cfg = GuardConfig(cooldown_steps=10)
    assert g.check_cooldown(view(step=3), GROW_ROLLOUT, cfg, NOBODY) is None
    h = History(last_resize_end_at=0.0, last_resize_end_step=20)
    rejected(g.check_cooldown(view(step=29), GROW_ROLLOUT, cfg, h), "cooldown", "9 step(s)", "cooldown_steps=10")
    assert g.check_cooldown(view(step=30), GROW_ROLLOUT, cfg, h) is None


def test_min_pools() -> None:
    cfg = GuardConfig(min_rollout=2, min_train=3)
    rejected(g.check_min_pools(view(), proposal(Split(7, 1)), cfg, NOBODY), "min_pool", "rollout pool",
             "drop to 1 < min_rollout=2")
    rejected(g.check_min_pools(view(), proposal(Split(2, 6)), cfg, NOBODY), "min_pool", "training pool",
             "min_train=3")
    assert g.check_min_pools(view(), proposal(Split(3, 5)), cfg, NOBODY) is None
    rejected(g.check_min_pools(view(), proposal(Split(8, 0)), CFG, NOBODY), "min_pool")


def test_payback() -> None:
    # moving 2 devices to rollout at 30 s each = 60 s; x 1.5 safety = 90 s to beat over 48 steps
    cfg = GuardConfig(payback_horizon_steps=48, payback_safety=1.5)
    rejected(g.check_payback(view(), proposal(Split(4, 4), saving_s=1.875), cfg, NOBODY), "payback",
             "1.88s/step x 48 steps = 90.0s", "cost 60.0s", "payback_safety 1.5")  # 90 is not above 90
    assert g.check_payback(view(), proposal(Split(4, 4), saving_s=2.0), cfg, NOBODY) is None
    # a known job length bounds the horizon
    rejected(g.check_payback(view(steps_remaining=10), proposal(Split(4, 4), saving_s=8.0), cfg, NOBODY),
             "payback", "x 10 steps")
    assert g.check_payback(view(steps_remaining=10), proposal(Split(4, 4), saving_s=9.5), cfg, NOBODY) is None
    # the cost is the one of the direction that moves
    costs = ResizeCosts(to_training_s=100.0, to_rollout_s=1.0)
    assert g.check_payback(view(costs=costs), proposal(Split(4, 4), saving_s=0.125), cfg, NOBODY) is None
    rejected(g.check_payback(view(costs=costs), proposal(Split(7, 1), saving_s=2.5), cfg, NOBODY), "payback",
             "cost 100.0s")
    # a proposal that saves nothing never pays back
    rejected(g.check_payback(view(), proposal(Split(4, 4), saving_s=0.0), GuardConfig(payback_safety=0.0),
                             NOBODY), "payback")


def test_min_gain_refuses_a_move_whose_predicted_gain_is_below_its_share_of_the_step() -> None:
    # 256 s a step: 3% is 7.68 s
    rejected(g.check_min_gain(view(), proposal(Split(4, 4), saving_s=7.5), CFG, NOBODY), "min_gain",
             "2.9% of the 256.0s step", "min_gain=3%")
    assert g.check_min_gain(view(), proposal(Split(4, 4), saving_s=8.0), CFG, NOBODY) is None
    assert g.check_min_gain(view(), proposal(Split(4, 4), saving_s=1.0), GuardConfig(min_gain=0.0), NOBODY) is None
    operator = Proposal(target=Split(4, 4), reason="op", predicted_step_s=0.0, predicted_step_s_after=0.0)
    assert g.check_min_gain(view(), operator, CFG, NOBODY) is None  # predicts nothing: nothing to hold back
    # among the hysteresis guards, after the cooldown and before the payback
    tiny = proposal(Split(4, 4), saving_s=4.0)
    rejected(g.evaluate(view(tuple(ROLLOUT_SLOW)), tiny, CFG, NOBODY), "min_gain")
    assert g.evaluate(view(tuple(ROLLOUT_SLOW)), tiny, CFG, NOBODY, hysteresis=False) is None


def test_candidates() -> None:
    allowed = (Split(6, 2), Split(4, 4), Split(2, 6))
    rejected(g.check_candidates(view(), proposal(Split(4, 3)), CFG, NOBODY), "candidates", "all 8 devices")
    rejected(g.check_candidates(view(candidates=allowed), proposal(Split(5, 3)), CFG, NOBODY), "candidates",
             "not an allowed split", "6:2, 4:4, 2:6")
    rejected(g.check_candidates(view(), proposal(Split(6, 2)), CFG, NOBODY), "candidates", "current split")
    assert g.check_candidates(view(candidates=allowed), proposal(Split(4, 4)), CFG, NOBODY) is None
    assert g.check_candidates(view(), proposal(Split(5, 3)), CFG, NOBODY) is None  # no list: any full split


def test_evaluate_runs_safety_first_and_hysteresis_only_when_asked() -> None:
    one_step = view((ROLLOUT_SLOW[0],))
    rejected(g.evaluate(one_step, GROW_ROLLOUT, CFG, NOBODY), "signal_run")
    assert g.evaluate(one_step, GROW_ROLLOUT, CFG, NOBODY, hysteresis=False) is None
    rejected(g.evaluate(one_step, proposal(Split(8, 0)), CFG, NOBODY, hysteresis=False), "min_pool")
    rejected(g.evaluate(one_step, proposal(Split(8, 1)), CFG, NOBODY), "candidates")
    assert g.evaluate(view(tuple(ROLLOUT_SLOW)), GROW_ROLLOUT, CFG, NOBODY) is None


def test_defaults_follow_dynaresize() -> None:
    # cooldown longer than 10 steps would be "> 10"; the paper's switch pays back in ~11 steps
    assert CFG.cooldown_steps >= 10 and CFG.signal_run >= 2 and CFG.payback_horizon_steps > 11
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"cooldown": 3}, GuardConfig)


# -- the core with the hysteresis policy -------------------------------------------------------


class Pipeline:
    """A one-step off-policy pipeline in virtual time: each stage's time is its work spread over
    its pool, so the split the core chooses changes the next step's timings."""

    def __init__(self, d: Driver) -> None:
        self.d = d
        self.step = 0
        self.started: list[tuple[int, float]] = []  # (step, time) of every ResizeStarted
        self.undone: set[int] = set()  # indexes in `started` of undos (guards.undo_worse)
        self.rejections: list[f.ProposalRejected] = []

    def run_step(self, rollout_work: float, train_work: float) -> None:
        d, split = self.d, self.d.state.split
        rollout_s, train_s = rollout_work / split.rollout, train_work / split.train
        d.now += max(rollout_s, train_s)
        d.heartbeat_all(d.now)
        d.send(ev.Tick(at=d.now))
        facts, _ = d.send(ev.StepReported(at=d.now, worker_id=trainer(0), timing=StepTiming(
            step=self.step, rollout_s=rollout_s, train_s=train_s, rollout_devices=split.rollout,
            train_devices=split.train)))
        self.note(facts)
        self.step += 1
        while d.state.inflight is not None:  # every op answered a second after it was sent
            d.now += 1.0
            d.heartbeat_all(d.now)
            d.ack_current()

    def note(self, facts: list[f.Fact]) -> None:
        for x in facts:
            if isinstance(x, f.ResizeStarted):
                if x.source == UNDO_SOURCE:
                    self.undone.add(len(self.started))
                self.started.append((self.d.state.last_step, x.at))
            elif isinstance(x, f.ProposalRejected):
                self.rejections.append(x)


def long_run(cfg: GuardConfig, regimes: list[tuple[int, float, float]]) -> Pipeline:
    d = boot(make_core(cfg, "hysteresis", heartbeat_timeout_s=1e9, op_timeout_s=1e9), 6, 2)
    p = Pipeline(d)
    for length, rollout_work, train_work in regimes:
        for _ in range(length):
            p.run_step(rollout_work, train_work)
    assert d.replayed().durable() == d.state.durable()
    return p


def assert_spaced(p: Pipeline, cfg: GuardConfig) -> None:
    """Every resize but an undo of one judged worse starts after the cooldown and the dwell."""
    for i, ((s1, t1), (s2, t2)) in enumerate(zip(p.started, p.started[1:], strict=False)):
        if i + 1 in p.undone:
            assert s2 - s1 >= cfg.verify_steps, f"an undo at step {s2} before its resize at {s1} was measured"
            continue
        assert s2 - s1 >= cfg.cooldown_steps, f"resizes at steps {s1} and {s2}"
        assert t2 - t1 >= cfg.min_dwell_s, f"resizes at t={t1} and t={t2}"


# Alternating sustained imbalances, every 6 steps: the policy wants to move all the time.
ALTERNATING = [(6, 1200.0, 300.0), (6, 300.0, 1200.0)] * 12


@pytest.mark.parametrize(
    "cfg,binding",
    [(GuardConfig(cooldown_steps=10, min_dwell_s=60.0, signal_run=2), "cooldown"),
     (GuardConfig(cooldown_steps=2, min_dwell_s=2000.0, signal_run=2), "dwell")],
    ids=["cooldown-binds", "dwell-binds"],
)
def test_two_resizes_never_happen_inside_the_cooldown_or_the_dwell(cfg: GuardConfig, binding: str) -> None:
    p = long_run(cfg, ALTERNATING)
    assert len(p.started) >= 4, "the run must resize for the test to mean anything"
    assert any(r.guard == binding for r in p.rejections), f"the {binding} guard never held a resize back"
    assert_spaced(p, cfg)


@settings(max_examples=40, deadline=None)
@given(
    cooldown=st.integers(0, 15),
    dwell=st.sampled_from([0.0, 60.0, 300.0, 1500.0]),
    signal_run=st.integers(1, 4),
    regimes=st.lists(st.tuples(st.integers(1, 12), st.sampled_from([200.0, 600.0, 1500.0]),
                               st.sampled_from([200.0, 600.0, 1500.0])), min_size=4, max_size=14),
)
def test_resizes_are_spaced_by_cooldown_and_dwell_under_any_load(
    cooldown: int, dwell: float, signal_run: int, regimes: list[tuple[int, float, float]]
) -> None:
    cfg = GuardConfig(cooldown_steps=cooldown, min_dwell_s=dwell, signal_run=signal_run)
    assert_spaced(long_run(cfg, regimes), cfg)


@settings(max_examples=60, deadline=None)
@given(
    signal_run=st.integers(2, 5),
    steps=st.lists(st.one_of(st.tuples(st.just("calm"), st.floats(0.0, 0.1)),
                             st.tuples(st.just("spike"), st.floats(1.5, 20.0), st.booleans())),
                   min_size=1, max_size=30),
)
def test_a_single_noisy_step_never_triggers_a_resize(signal_run: int, steps: list[tuple]) -> None:
    cfg = GuardConfig(min_dwell_s=0.0, cooldown_steps=0, signal_run=signal_run, payback_safety=0.0)
    d = boot(make_core(cfg, "hysteresis"), 4, 4)
    base = 100.0
    for k, item in enumerate(steps):
        if item[0] == "calm":  # an imbalance under the threshold, either way
            rollout_s, train_s = (base, base * (1.0 - item[1])) if k % 2 else (base * (1.0 - item[1]), base)
        else:  # one spike, in either direction, and the next step is calm again
            rollout_s, train_s = (base * item[1], base) if item[2] else (base, base * item[1])
        facts, _ = d.send(ev.StepReported(at=float(10 * k), worker_id=trainer(0), timing=StepTiming(
            step=2 * k, rollout_s=rollout_s, train_s=train_s, rollout_devices=4, train_devices=4)))
        assert not any(isinstance(x, f.ResizeStarted) for x in facts)
        for x in facts:
            if isinstance(x, f.ProposalRejected):
                assert x.guard in ("signal_run", "threshold"), x
        if item[0] == "spike":
            facts, _ = d.send(ev.StepReported(at=float(10 * k + 5), worker_id=trainer(0), timing=StepTiming(
                step=2 * k + 1, rollout_s=base, train_s=base, rollout_devices=4, train_devices=4)))
            assert not any(isinstance(x, f.ResizeStarted) for x in facts)
    assert d.state.resizes_started == 0 and d.state.split == Split(4, 4)


def test_a_single_spike_is_rejected_by_the_signal_run_guard() -> None:
    d = boot(make_core(GuardConfig(), "hysteresis"), 4, 4)
    facts, _ = d.send(ev.StepReported(at=1.0, worker_id=trainer(0), timing=StepTiming(
        step=0, rollout_s=900.0, train_s=100.0, rollout_devices=4, train_devices=4)))
    assert [type(x) for x in facts] == [f.StepObserved, f.ProposalRejected]
    assert facts[1].guard == "signal_run" and "1 consecutive" in facts[1].reason
    assert d.state.inflight is None


@pytest.mark.parametrize(
    "start,rollout_s,train_s,grows",
    [(Split(6, 2), 255.0, 100.0, Pool.ROLLOUT), (Split(2, 6), 100.0, 255.0, Pool.TRAINING)],
    ids=["rollout-slow-rollout-grows", "training-slow-training-grows"],
)
def test_a_sustained_imbalance_resizes_toward_the_slower_stage(start: Split, rollout_s: float, train_s: float,
                                                               grows: Pool) -> None:
    cfg = GuardConfig()  # the defaults: signal_run=3
    d = boot(make_core(cfg, "hysteresis"), start.train, start.rollout)
    for k in range(cfg.signal_run):
        facts, _ = d.send(ev.StepReported(at=10.0 * (k + 1), worker_id=trainer(0), timing=StepTiming(
            step=k, rollout_s=rollout_s, train_s=train_s, rollout_devices=start.rollout, train_devices=start.train)))
        if k < cfg.signal_run - 1:
            assert [type(x) for x in facts] == [f.StepObserved, f.ProposalRejected]
            assert facts[1].guard == "signal_run"
    assert [type(x) for x in facts] == [f.StepObserved, f.ResizeStarted]
    plan = facts[1].plan
    assert plan.to_pool is grows and plan.from_pool is grows.other
    d.finish()
    after = d.state.split
    if grows is Pool.ROLLOUT:
        assert after.rollout > start.rollout
    else:
        assert after.train > start.train
    assert after == plan.after


@settings(max_examples=40, deadline=None)
@given(
    signal_run=st.integers(1, 5),
    ratio=st.floats(2.0, 6.0),
    base=st.floats(10.0, 500.0),
    rollout_slow=st.booleans(),
)
def test_a_sustained_imbalance_of_any_size_resizes_after_exactly_signal_run_steps(
    signal_run: int, ratio: float, base: float, rollout_slow: bool
) -> None:
    d = boot(make_core(GuardConfig(signal_run=signal_run), "hysteresis"), 4, 4)
    rollout_s, train_s = (base * ratio, base) if rollout_slow else (base, base * ratio)
    for k in range(signal_run):
        facts, _ = d.send(ev.StepReported(at=10.0 * (k + 1), worker_id=trainer(0), timing=StepTiming(
            step=k, rollout_s=rollout_s, train_s=train_s, rollout_devices=4, train_devices=4)))
        started = [x for x in facts if isinstance(x, f.ResizeStarted)]
        assert bool(started) == (k == signal_run - 1)
    grows = Pool.ROLLOUT if rollout_slow else Pool.TRAINING
    assert started[0].plan.to_pool is grows


def test_payback_learned_factor_raises_the_bar() -> None:
    # measured rollout-bound steps: the move costs one device's ops (30 s; the window in flight
    # is no slower, training on 4 still outpaced by the rollout), x payback_safety 1.5 = 45 s;
    # 1.5 s/step x 50 steps = 75 s clears that at factor 1, not at factor 2 (90 s)
    v, p = view(tuple(ROLLOUT_SLOW)), proposal(Split(4, 4), saving_s=1.5)
    assert g.check_payback(v, p, CFG, NOBODY) is None
    rejected(g.check_payback(v, p, CFG, History(payback_factor=2.0)), "payback", "x 2 (raised")


@pytest.mark.parametrize(("policy", "why"), [("static", "never moves a device"),
                                             ("hysteresis", "but no allowed split that grows it predicts less")])
def test_a_step_the_policy_lets_pass_says_why_in_the_log(policy: str, why: str) -> None:
    """No proposal, so no guard is asked and no `proposal_rejected` is written: the log still
    says why nothing moved (issue 12: a 30-step run printed no reason at all)."""
    d = boot(make_core(policy=policy), train=2, rollout=2)
    facts, commands = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0),
                                             timing=timing(0, 5.0, 5.0, Split(2, 2))))
    held = [x for x in facts if isinstance(x, f.PolicyHeld)]
    assert len(held) == 1 and held[0].step == 0 and held[0].split == Split(2, 2) and why in held[0].reason
    assert held[0].source == policy and not any(isinstance(x, f.ResizeStarted) for x in facts)
    assert d.replayed().durable() == d.state.durable()


def test_a_resize_is_priced_by_one_devices_ops_and_the_window_it_is_in_flight() -> None:
    # before any step is measured: every moving device's ops in a row (2 x 30 s)
    assert g.resize_cost_s(view(), Split(4, 4)) == pytest.approx(60.0)
    # measured and rollout-bound (255 s against training's 100 s at 6:2): while two trainers move,
    # training on 4 takes 150 s, still inside the rollout: one device's ops, 30 s, however many move
    slow = view(tuple(timing(i, 255.0, 100.0) for i in range(3)))
    assert g.resize_cost_s(slow, Split(4, 4)) == pytest.approx(30.0)
    assert g.resize_cost_s(slow, Split(5, 3)) == pytest.approx(30.0)
    # training-bound (300 s at 6:2, 1,800 device-s): the same move makes its window 450 s, 150 s more
    busy = view(tuple(timing(i, 100.0, 300.0) for i in range(3)))
    assert g.resize_cost_s(busy, Split(4, 4)) == pytest.approx(30.0 + 150.0)
    # a move that leaves the donor pool nothing for its window never pays back
    assert g.resize_cost_s(slow, Split(0, 8)) == math.inf
    rejected(g.check_payback(slow, proposal(Split(0, 8), saving_s=1e6), CFG, NOBODY), "payback")
