"""Tail regroups inside a step (issue 22, item 5): when engines have run dry while another still
decodes the step's last requests, the policy regroups them into one wider engine for the rest
of the step, through the core, and the core regroups them back at the step boundary."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from dynaresized.core import facts as f
from dynaresized.core import fold
from dynaresized.core.guards import GuardConfig, check_tail
from dynaresized.core.policy import EngineTail, LoanCosts, LoanView, TailCosts, TailProposal, load_policy
from dynaresized.domain import Split
from dynaresized.sim.pipeline import DynamicPipeline
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import guards_for, scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import StepBatch, Trace, scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")  # TP-1 engines at 6:2: two rollout engines


def one_long_request(steps: int = 20, short: int = 64, long_tokens: int = 16_000) -> Trace:
    """Each step: `short` responses of 200-400 tokens, then one of `long_tokens`, queued last:
    one engine decodes it alone while the other has run dry."""
    rng = np.random.default_rng(0)
    batches = []
    for s in range(steps):
        lengths = np.concatenate([rng.integers(200, 400, short), [long_tokens]]).astype(np.int64)
        batches.append(StepBatch(s, np.full(short + 1, 256, dtype=np.int64), lengths))
    return Trace("one-long-request", tuple(batches))


def run(trace: Trace, *, tails: bool, profile=PROFILE):
    guards = msgspec.structs.replace(guards_for(profile), min_rollout=max(guards_for(profile).min_rollout,
                                                                           profile.rollout.gpus_per_engine))
    # without the loans asked on the engines' progress, which the simulator does not model
    # beside tail regroups (docs/simulator.md): the same policy either way, tails apart
    policy = load_policy("hysteresis", {"tail_regroup": tails, "lend_from_progress": False})
    pipe = DynamicPipeline(StageModel(profile, trace), policy, guards=guards)
    return pipe, pipe.run()


def test_a_long_tail_decodes_on_a_wider_engine_and_its_engines_come_back_at_the_boundary():
    trace = one_long_request()
    pipe, tailed = run(trace, tails=True)
    _, plain = run(trace, tails=False)
    started = [x for x in tailed.facts if isinstance(x, f.RegroupStarted) and x.at > 0]
    wide = [x for x in started if x.undo]
    back = [x for x in started if x.source == "tail"]
    assert len(wide) >= 15 and len(back) == len(wide)
    for x in wide:  # the busy engine first, then the idle one: one TP-2 engine, back to two TP-1
        assert x.source == "hysteresis" and [len(g) for g in x.plan.engines] == [2]
        assert len(x.undo) == 2 and all(len(g) == 1 for g in x.undo) and x.undo[0][0] in x.reason
        assert "tail of rollout step" in x.reason and "saves" in x.reason
    committed = {x.resize_id for x in tailed.facts if isinstance(x, f.RegroupCommitted)}
    assert {x.plan.resize_id for x in started} <= committed
    # in order: each tail regroup is undone at the next boundary, before the next one
    order = [("in" if x.undo else "back") for x in started]
    assert order == ["in", "back"] * len(wide)
    assert not tailed.state.engines and not tailed.state.tail_undo  # TP-1 engines again
    assert all(saved > 0 for _, saved in pipe.tail_regroups)
    # without tails the policy keeps its split: its cost model knows the one request's latency
    # floor, which more rollout devices cannot shorten (before issue 43 it moved trainers into
    # the rollout); only the wider engine shortens it
    assert plain.final_split == Split(6, 2) and tailed.total_time_s < plain.total_time_s / 1.3
    assert fold(tailed.facts).durable() == tailed.state.durable()  # the log replays to the live state


def test_a_replayed_log_mid_tail_knows_what_to_regroup_back():
    trace = one_long_request(steps=4)
    _, tailed = run(trace, tails=True)
    facts = list(tailed.facts)
    i = next(k for k, x in enumerate(facts) if isinstance(x, f.RegroupCommitted)
             and any(isinstance(y, f.RegroupStarted) and y.undo and y.plan.resize_id == x.resize_id for y in facts))
    mid = fold(facts[:i + 1])
    assert mid.tail_undo and not mid.tail_due and len(mid.engine_of(mid.tail_undo[0][0])) == 2
    j = next(k for k in range(i, len(facts)) if isinstance(facts[k], f.StepObserved))
    assert fold(facts[:j + 1]).tail_due  # a restarted daemon regroups back at once


def test_a_tail_regroup_that_does_not_pay_is_refused_and_changes_nothing():
    trace = one_long_request(steps=8)
    slow = msgspec.structs.replace(PROFILE, resize=msgspec.structs.replace(
        PROFILE.resize, tail=msgspec.structs.replace(PROFILE.resize.tail, switch_s=5_000.0)))
    _, tailed = run(trace, tails=True, profile=slow)
    _, plain = run(trace, tails=False, profile=slow)
    assert not [x for x in tailed.facts if isinstance(x, f.RegroupStarted) and x.at > 0]
    refused = [x for x in tailed.facts if isinstance(x, f.ProposalRejected) and x.guard == "tail_payback"]
    assert refused and "not above cost" in refused[0].reason
    assert tailed.total_time_s == plain.total_time_s


def test_trainers_whose_step_is_done_join_the_tails_engine_and_go_home_after_it_is_undone():
    # TP-4 engines at 4:4, the plan search's start on qwen3-8b-h20x8: one rollout engine, so only
    # the trainers, lent to the rollout once their step is done, can make it wider (TP-8)
    wide = PROFILE.with_layout(4, Split(4, 4))
    trace = scenario_trace("noisy", scenario_shape(wide), seed=0, steps=200)
    pipe, tailed = run(trace, tails=True, profile=wide)
    _, plain = run(trace, tails=False, profile=wide)
    facts = list(tailed.facts)
    loans = [k for k, x in enumerate(facts) if isinstance(x, f.LoanStarted) and "for the tail" in x.reason]
    assert len(loans) >= 5 and len(pipe.tail_regroups) == len(loans)
    trainers = {f"node0:gpu{i}" for i in range(4)}
    for k in loans:
        loan = facts[k]
        assert loan.plan.to_pool.value == "rollout" and set(loan.plan.devices) == trainers
        # it lands, the tail's engine takes the lent devices, and at the boundary it is undone
        # first, then the trainers go home
        after = facts[k:]
        i = next(j for j, x in enumerate(after) if isinstance(x, f.RegroupStarted))
        wide_started = after[i]
        assert any(isinstance(x, f.LoanLanded) for x in after[:i])
        assert wide_started.undo[0] == tuple(f"node0:gpu{i}" for i in range(4, 8))
        assert set(wide_started.undo[1:]) == {(d,) for d in trainers}
        assert [len(g) for g in wide_started.plan.engines] == [8]
        j = next(j for j, x in enumerate(after) if isinstance(x, f.RegroupStarted) and x.source == "tail")
        back = next(j for j, x in enumerate(after) if isinstance(x, f.LoanReturnStarted))
        assert i < j < back
        assert sorted(after[j].plan.engines, key=len) == [(d,) for d in sorted(trainers)] + [wide_started.undo[0]]
    assert all(saved > 0 for _, saved in pipe.tail_regroups)
    assert tailed.total_time_s < plain.total_time_s / 1.005
    s = tailed.state
    assert s.engine_of("node0:gpu4") == tuple(f"node0:gpu{i}" for i in range(4, 8)) and not s.lent_devices()
    assert fold(tailed.facts).durable() == tailed.state.durable()


def _view(**kw) -> LoanView:
    base = dict(now=100.0, split=Split(6, 2), idle_engines=("d7",), free_trainers=(), training_devices=6,
                mini_batch_done=16, mini_batch_total=16, mini_batch_s=10.0, queue_empty=True, costs=LoanCosts(),
                rollout_step=3, tails=(EngineTail(devices=("d6",), running=1, tokens_left=4000, at=100.0),),
                tail_costs=TailCosts(switch_s=2.0, back_s=1.0, widths=(1, 2), base_s=(0.01, 0.007),
                                     per_request_s=(0.002, 0.001)))
    base.update(kw)
    return LoanView(**base)


@pytest.mark.parametrize(("devices", "guard"), [
    (("d7", "d6"), "tail"),  # not started from the busy engine
    (("d6", "d5"), "loan_idle"),  # d5 has work left
    (("d6", "d7", "d5"), "loan_idle"),
])
def test_the_tail_guard_takes_one_busy_engine_and_idle_ones_only(devices, guard):
    p = TailProposal(devices=devices, reason="", saves_s=100.0, cost_s=3.0)
    assert check_tail(_view(), p, GuardConfig()).guard == guard


def test_the_policy_regroups_only_what_pays_and_only_as_far_as_the_rollout_ends_the_step():
    policy = load_policy("hysteresis", {"tail_regroup": True})
    p = policy.propose_tail(_view())
    assert p is not None and p.devices == ("d6", "d7")
    # 4000 tokens at 0.012 s against 2 s + 4000 at 0.008 s
    assert p.saves_s == pytest.approx(4000 * 0.012 - (2.0 + 4000 * 0.008)) and p.cost_s == 3.0
    assert check_tail(_view(), p, GuardConfig()) is None
    # the training step still has 10 mini-batches of 10 s: the rollout does not end the step
    late = policy.propose_tail(_view(mini_batch_done=6))
    assert late is not None and late.saves_s == 0.0
    assert check_tail(_view(mini_batch_done=6), late, GuardConfig()).guard == "tail_payback"
    assert load_policy("hysteresis").propose_tail(_view()) is None  # off unless asked
    assert policy.propose_tail(_view(tail_costs=None)) is None  # the daemon: no tail costs


def test_trainers_are_lent_for_a_tail_only_when_the_queue_is_empty_and_it_pays():
    policy = load_policy("hysteresis", {"tail_regroup": True})
    costs = TailCosts(switch_s=2.0, back_s=1.0, widths=(1, 2, 4), base_s=(0.01, 0.007, 0.005),
                      per_request_s=(0.002, 0.001, 0.0005))
    view = _view(idle_engines=(), free_trainers=("d0", "d1", "d2"), tail_costs=costs)
    loan = policy.propose_loan(view)
    assert loan is not None and loan.to_pool == "rollout" and loan.devices == ("d0", "d1", "d2")
    assert "for the tail of rollout step 3" in loan.reason and loan.saves_s > loan.cost_s
    assert policy.propose_loan(_view(idle_engines=(), free_trainers=("d0",), tail_costs=costs,
                                     tail_open=True)) is None  # a tail's engine already serves
    # once they have landed, the tail regroup takes them
    landed = _view(idle_engines=(), lent_to_rollout=("d0", "d1", "d2"), tail_costs=costs)
    p = policy.propose_tail(landed)
    assert p is not None and p.devices == ("d6", "d0", "d1", "d2") and check_tail(landed, p, GuardConfig()) is None
    # without the option, trainers are lent to the rollout only while its queue holds requests
    assert load_policy("hysteresis").propose_loan(view) is None


def test_an_engine_estimates_its_tail_from_what_it_knows():
    """`remaining_tokens`: a request past every measured length but one runs to that one; one
    that has passed them all runs up to max_tokens; several running requests take the longest
    they could be."""
    from dynaresized.sim.regroups import remaining_tokens

    measured = np.array([300] * 64 + [16_000])
    assert remaining_tokens(np.array([501.0]), measured, 16_384) == pytest.approx(15_499, abs=70)
    assert remaining_tokens(np.array([16_100.0]), measured, 16_384) == pytest.approx(142, abs=70)  # uniform to max
    assert remaining_tokens(np.array([20_000.0]), measured, 16_384) == 1  # past max_tokens: at its end
    one = remaining_tokens(np.array([100.0]), measured, 16_384)
    many = remaining_tokens(np.full(32, 100.0), measured, 16_384)
    assert 200 < one < many < 16_000  # 32 requests: more likely that one of them is the long one
    assert remaining_tokens(np.array([]), measured, 16_384) == 0


def test_a_tails_estimate_reads_no_length_still_to_come(monkeypatch):
    """Issue 43 item 5: the engines' tokens-left figure is the same whether the step's long
    request will end at 12,000 or 16,000 tokens: it comes from the tokens so far, max_tokens and
    the steps before (whose long request was 16,000), not from the trace's future."""
    from dynaresized.core import events as ev

    reported: dict[int, list[tuple[int, int]]] = {}
    feed = DynamicPipeline._feed

    def recorded(self: DynamicPipeline, event: ev.Event) -> None:
        if isinstance(event, ev.EngineQueueEmpty) and event.running:
            reported.setdefault(id(self), []).append((event.step, event.tokens_left))
        feed(self, event)

    monkeypatch.setattr(DynamicPipeline, "_feed", recorded)
    firsts = []
    for long_tokens in (16_000, 12_000):
        steps = list(one_long_request(steps=2).steps)
        lengths = steps[1].response_tokens.copy()
        lengths[-1] = long_tokens  # step 1's long request; step 0 (what the engines measured) the same
        steps[1] = StepBatch(1, steps[1].prompt_tokens, lengths)
        pipe, _ = run(Trace("one-long-request", tuple(steps)), tails=True)
        firsts.append(next(left for step, left in reported[id(pipe)] if step == 1))
    # The same figure, but for the simulator placing "now" inside a step by each engine's mean
    # pace over the step (2 tokens in 15,000 here); read from the trace it was 4,000 tokens
    # apart (15,190 against 11,190: the request's true tokens left).
    assert firsts[0] == pytest.approx(firsts[1], rel=1e-3)
    assert firsts[1] > 15_000
