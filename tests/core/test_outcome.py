"""Owning misses: after a resize the core measures the new split against what the policy
predicted, logs the error as a fact, judges the resize over its payback window, and a resize
that made things worse raises the bar for the next one."""

from __future__ import annotations

import pytest

from dynaresized.cli import render_status
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig, resize_cost_s
from dynaresized.core.policy import ObservedView, Proposal
from dynaresized.core.state import fold
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.service import status_of
from dynaresized.domain import Pool, Split, StepTiming
from dynaresized.explain import explain

from .cluster import Driver, boot, make_core, trainer

GUARDS = GuardConfig(min_dwell_s=0.0, cooldown_steps=0, signal_run=1, payback_horizon_steps=5, verify_steps=2,
                     undo_worse=False)
"""The judgement over the whole payback window (a resize judged worse early and undone: below)."""


class Scripted:
    """A guarded policy that proposes one fixed move with fixed predictions whenever the
    split is `start` (like the planner on the issue's Pareto alpha=1.2 trace: 78 s -> 33 s)."""

    name = "scripted"
    guarded = True

    def __init__(self, start: Split, target: Split, before_s: float, after_s: float) -> None:
        self.start, self.target, self.before_s, self.after_s = start, target, before_s, after_s

    def __call__(self, view: ObservedView) -> Proposal | None:
        if view.split != self.start:
            return None
        return Proposal(target=self.target, reason="scripted", predicted_step_s=self.before_s,
                        predicted_step_s_after=self.after_s)


def report(d: Driver, step: int, rollout_s: float, train_s: float) -> list[f.Fact]:
    facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0),
                                      timing=StepTiming(step=step, rollout_s=rollout_s, train_s=train_s)))
    return facts


def of(facts: list[f.Fact], kind: type) -> list:
    return [x for x in facts if isinstance(x, kind)]


def test_a_prediction_miss_is_logged_and_the_resize_judged_worse() -> None:
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=33.0)
    d = boot(make_core(GUARDS, policy), train=6, rollout=2)
    started = of(report(d, 0, 78.0, 20.0), f.ResizeStarted)
    assert len(started) == 1
    s = started[0]
    assert (s.predicted_step_s, s.predicted_step_s_after, s.measured_step_s) == (78.0, 33.0, 78.0)
    # one device's ops (30 s: no resize measured yet); training on 4 while two move (30 s) stays
    # inside the 78 s rollout, so the window in flight costs nothing more
    assert s.payback_steps == 5 and s.predicted_cost_s == 30.0
    d.finish()
    assert d.state.split == Split(4, 4)

    # The heavy tail does not spread over more engines: the run gets much slower.
    checked = of(report(d, 1, 46948.0, 10.0), f.PredictionChecked)
    assert checked == []  # verify_steps=2: one step is not enough to judge
    facts = report(d, 2, 46948.0, 10.0)
    [miss] = of(facts, f.PredictionChecked)
    assert (miss.resize_id, miss.steps, miss.predicted_step_s_after) == ("r1", 2, 33.0)
    assert miss.measured_step_s_after == 46948.0 and miss.error_s == 46948.0 - 33.0
    assert (miss.predicted_step_s, miss.measured_step_s) == (78.0, 78.0)
    assert "33.0s predicted, 46948.0s measured over 2 step(s), error +46915.0s" in explain(miss)
    metrics = Metrics()
    metrics.observe(d.state, facts)
    assert metrics.registry.get_sample_value("dynaresized_prediction_error_ratio") == (46948.0 - 33.0) / 33.0

    for step in (3, 4):
        assert of(report(d, step, 46948.0, 10.0), f.ResizeJudged) == []
    facts = report(d, 5, 46948.0, 10.0)
    [verdict] = of(facts, f.ResizeJudged)
    assert verdict.verdict is f.Verdict.WORSE
    assert (verdict.steps, verdict.payback_steps) == (5, 5)
    assert verdict.saved_s == 5 * 78.0 - 5 * 46948.0
    assert verdict.payback_factor == 2.0  # the guard learns: the next resize must pay back twice as much
    assert "MADE THINGS WORSE over 5 of 5 step(s)" in explain(verdict)
    metrics.observe(d.state, facts)
    assert metrics.registry.get_sample_value("dynaresized_resize_verdicts_total", {"verdict": "worse"}) == 1
    assert metrics.registry.get_sample_value("dynaresized_payback_factor") == 2.0

    status = status_of(d.state)
    assert status["outcome"]["last_verdict"]["verdict"] == "worse"
    assert status["outcome"]["payback_factor"] == 2.0
    text = render_status(status)
    assert "last resize r1 MADE THINGS WORSE" in text and "raised x2" in text
    assert d.state.outcome is None and d.state.history.payback_factor == 2.0
    assert fold(d.log).durable() == d.state.durable()


def test_the_raised_payback_rejects_what_it_used_to_accept() -> None:
    # First resize 6:2 -> 4:4 hurts; the second proposal (back to 6:2) saves enough to pass
    # payback at factor 1 but not at factor 2.
    class Back(Scripted):
        def __call__(self, view: ObservedView) -> Proposal | None:
            if view.split == Split(4, 4) and view.step >= 5:  # once the first resize is judged
                # the guard's price of the move; pick a saving between 1.5x and 3x of it
                cost = resize_cost_s(view, Split(6, 2))
                saving = 2.0 * cost / 5
                return Proposal(target=Split(6, 2), reason="back", predicted_step_s=100.0 + saving,
                                predicted_step_s_after=100.0)
            return super().__call__(view)

    d = boot(make_core(GUARDS, Back(Split(6, 2), Split(4, 4), 78.0, 33.0)), train=6, rollout=2)
    report(d, 0, 78.0, 20.0)
    d.finish()
    # steps slower than before but with training now the slow stage, so the policy's signal
    # asks to grow training (toward 6:2)
    for step in range(1, 5):
        report(d, step, 70.0, 90.0)
    facts = report(d, 5, 70.0, 90.0)
    [verdict] = of(facts, f.ResizeJudged)
    assert verdict.verdict is f.Verdict.WORSE and verdict.payback_factor == 2.0
    [rejected] = of(facts, f.ProposalRejected)
    assert rejected.guard == "payback"
    assert "x 2 (raised after resizes that did not pay back)" in rejected.reason


def test_a_resize_that_paid_back_lowers_the_factor_and_an_operator_resize_predicts_nothing() -> None:
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=33.0)
    d = boot(make_core(GUARDS, policy), train=6, rollout=2)
    report(d, 0, 78.0, 20.0)
    d.finish()
    facts = []
    for step in range(1, 6):
        facts += report(d, step, 34.0, 30.0)
    [miss] = of(facts, f.PredictionChecked)
    assert miss.error_s == 1.0
    [verdict] = of(facts, f.ResizeJudged)
    # saved 5 x (78 - 34) = 220 s against a cost the guard put at 60 s
    assert verdict.verdict is f.Verdict.PAID_BACK and verdict.saved_s == 220.0
    assert verdict.payback_factor == 1.0  # never below 1

    # An operator's resize: no prediction to check, but it is still judged.
    d.force(6, 2)
    d.finish()
    facts = []
    for step in range(6, 11):
        facts += report(d, step, 40.0, 30.0)
    assert of(facts, f.PredictionChecked) == []
    [verdict] = of(facts, f.ResizeJudged)
    assert verdict.verdict is f.Verdict.WORSE  # 40 s per step against 34 s before


def test_the_next_resize_judges_an_unfinished_window() -> None:
    d = boot(make_core(GUARDS), train=6, rollout=2)
    d.force(4, 4)
    d.finish()
    report(d, 0, 50.0, 20.0)
    facts, _ = d.force(6, 2)
    [verdict] = of(facts, f.ResizeJudged)
    # nothing was measured on 6:2 before the first resize: there is no baseline
    assert verdict.verdict is f.Verdict.UNKNOWN and verdict.steps == 1
    assert "outcome unknown" in explain(verdict)
    assert isinstance(facts[facts.index(verdict) + 1], f.ResizeStarted)
    assert fold(d.log).durable() == d.state.durable()


def test_a_step_that_ran_on_the_old_split_does_not_measure_the_new_one() -> None:
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=33.0)
    d = boot(make_core(GUARDS, policy), train=6, rollout=2)
    report(d, 0, 78.0, 20.0)
    d.finish()
    # pipelined: step 1's rollout began before the commit, and its report says it ran on 6:2
    d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
        step=1, rollout_s=80.0, train_s=20.0, train_devices=6, rollout_devices=2)))
    assert d.state.outcome is not None and d.state.outcome.after == ()
    d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
        step=2, rollout_s=40.0, train_s=30.0, train_devices=4, rollout_devices=4)))
    assert d.state.outcome.after == (40.0,)
    assert d.state.idle.pool(Pool.ROLLOUT).steps == 3  # idle accounting still counts every step


# -- a resize judged worse early is undone at the next boundary ---------------------------------

UNDOING = GuardConfig(min_dwell_s=1e9, cooldown_steps=50, signal_run=1, payback_horizon_steps=20, verify_steps=2)


def test_a_resize_measured_worse_is_undone_at_once_without_waiting_out_the_cooldown() -> None:
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=33.0)
    d = boot(make_core(UNDOING, policy), train=6, rollout=2)
    assert len(of(report(d, 0, 78.0, 20.0), f.ResizeStarted)) == 1
    d.finish()
    assert d.state.split == Split(4, 4)
    assert of(report(d, 1, 120.0, 10.0), f.ResizeJudged) == []  # one step is not verify_steps
    facts = report(d, 2, 120.0, 10.0)
    [verdict] = of(facts, f.ResizeJudged)
    assert verdict.verdict is f.Verdict.WORSE and verdict.undo_to == Split(6, 2) and verdict.steps == 2
    assert verdict.saved_s == 2 * 78.0 - 2 * 120.0 and verdict.payback_factor == 2.0
    # the same boundary starts the undo, though the cooldown (50 steps) and dwell have not passed
    [undo] = of(facts, f.ResizeStarted)
    assert undo.source == "undo" and undo.plan.after == Split(6, 2)
    assert "undo r1: measured worse over its first 2 step(s)" in undo.reason and "cooldown" in undo.reason
    assert undo.predicted_step_s_after is None  # an undo predicts nothing: it goes back to what was measured
    assert d.state.undo_to is None
    d.finish()
    assert d.state.split == Split(6, 2)
    # the policy's next proposal (back to 4:4) waits out the dwell and cooldown as ever
    rejections = of(report(d, 3, 78.0, 20.0), f.ProposalRejected)
    assert [r.guard for r in rejections] == ["dwell"]
    # and an undo measured worse in its turn is not undone again
    for step in (4, 5, 6):
        assert of(report(d, step, 500.0, 20.0), f.ResizeStarted) == []
    assert fold(d.log).durable() == d.state.durable()


def test_a_resize_within_the_margin_or_better_is_not_undone() -> None:
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=33.0)
    d = boot(make_core(UNDOING, policy), train=6, rollout=2)
    report(d, 0, 78.0, 20.0)
    d.finish()
    report(d, 1, 82.0, 10.0)
    facts = report(d, 2, 82.0, 10.0)  # 5.1% slower: within undo_margin (6%), not judged yet
    assert of(facts, f.ResizeJudged) == [] and of(facts, f.ResizeStarted) == []
    assert d.state.outcome is not None and d.state.undo_to is None
    off = GuardConfig(**{**{k: getattr(UNDOING, k) for k in UNDOING.__struct_fields__}, "undo_worse": False})
    d = boot(make_core(off, policy), train=6, rollout=2)
    report(d, 0, 78.0, 20.0)
    d.finish()
    report(d, 1, 120.0, 10.0)
    assert of(report(d, 2, 120.0, 10.0), f.ResizeJudged) == []  # undo_worse off: judged over its window


def test_a_rollout_that_follows_its_longest_response_is_not_undone_for_its_tokens() -> None:
    # Steps that report their lengths: the per-token comparison says "worse" (fewer tokens, as
    # long a step), but the cost model says the old split would have taken longer for the same
    # steps (their floor is 100 s of 120): no undo. Without lengths, the same steps are undone.
    from dynaresized.domain import ResponseLengths

    def step(d: Driver, k: int, rollout_s: float, tokens: int, lengths: bool, split: Split) -> list[f.Fact]:
        lengths_ = ResponseLengths(quantiles=(10, 50, 90, 100), token_s=1.0) if lengths else None
        facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
            step=k, rollout_s=rollout_s, train_s=10.0, rollout_devices=split.rollout, train_devices=split.train,
            response_tokens=tokens, lengths=lengths_)))
        return facts

    for lengths, undone in ((True, False), (False, True)):
        policy = Scripted(Split(6, 2), Split(4, 4), before_s=200.0, after_s=150.0)
        d = boot(make_core(UNDOING, policy), train=6, rollout=2)
        step(d, 0, 200.0, 10000, lengths, Split(6, 2))
        d.finish()
        step(d, 1, 160.0, 5000, lengths, Split(4, 4))
        facts = step(d, 2, 160.0, 5000, lengths, Split(4, 4))
        # per token: 0.02 s/token before, 0.032 after; the model: 100 + 60 x 4/2 = 220 s on 6:2
        assert bool(of(facts, f.ResizeStarted)) is undone, lengths


def test_status_says_which_cost_model_the_policy_predicts_with_and_why() -> None:
    from dynaresized.domain import ResponseLengths

    d = boot(make_core(GUARDS, Scripted(Split(9, 9), Split(9, 9), 1.0, 1.0)), train=6, rollout=2)
    assert status_of(d.state)["cost_model"]["model"] is None
    report(d, 0, 100.0, 20.0)  # an older worker: no lengths
    linear = status_of(d.state)["cost_model"]
    assert linear["model"] == "linear" and "no step report carries response lengths" in linear["why"]
    assert "cost model  linear: no step report carries response lengths" in render_status(status_of(d.state))
    d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
        step=1, rollout_s=100.0, train_s=20.0, lengths=ResponseLengths(quantiles=(10, 50, 90, 400), token_s=0.1))))
    floor = status_of(d.state)["cost_model"]
    assert floor["model"] == "floor" and floor["floor_s"] == pytest.approx(40.0)
    assert "latency floor 40.0s" in render_status(status_of(d.state))
    # bad lengths are refused, with the reason, and change nothing
    from dynaresized.core.tx import Refused

    with pytest.raises(Refused, match="bad_value: lengths.quantiles .10, 5, 90, 400. must be non-negative and non-decr"):
        d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
            step=2, rollout_s=100.0, train_s=20.0, lengths=ResponseLengths(quantiles=(10, 5, 90, 400)))))
    assert d.state.last_step == 1


def test_a_step_that_straddles_the_commit_does_not_measure_the_new_split() -> None:
    """One-step off: step k's rollout ran a window before its training, so the first step after a
    commit can report its rollout on the old split and its training on the new one. It measured
    neither; only steps wholly on the new split are checked against the prediction."""
    policy = Scripted(Split(6, 2), Split(4, 4), before_s=78.0, after_s=40.0)
    d = boot(make_core(GUARDS, policy), train=6, rollout=2)

    def on(step: int, rollout_s: float, train: int, rollout: int) -> list[f.Fact]:
        facts, _ = d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
            step=step, rollout_s=rollout_s, train_s=20.0, train_devices=train, rollout_devices=rollout)))
        return facts

    assert of(on(0, 78.0, 6, 2), f.ResizeStarted)
    d.finish()
    assert d.state.split == Split(4, 4)
    on(1, 78.0, 6, 2)  # wholly on the old split
    on(2, 78.0, 4, 2)  # rollout on the old split, training on the new: straddles
    assert d.state.outcome is not None and d.state.outcome.after == ()
    assert not of(on(3, 41.0, 4, 4), f.PredictionChecked)
    [checked] = of(on(4, 43.0, 4, 4), f.PredictionChecked)
    assert checked.measured_step_s_after == pytest.approx(42.0)  # the two steps on 4:4, not the straddling 78 s
