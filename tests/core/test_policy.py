"""The policy plug-in interface: loading through the entry-point group (built-ins and a real
third-party distribution on sys.path), option errors, and what the hysteresis policy proposes."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import (
    ENTRY_POINT_GROUP,
    ObservedView,
    Policy,
    ResizeCosts,
    UnknownPolicyError,
    available_policies,
    load_policy,
    predicted_step_s,
)
from dynaresized.domain import Split, StepTiming
from dynaresized.policies.hysteresis import HysteresisPolicy
from dynaresized.policies.static import StaticPolicy

from .cluster import boot, engine, make_core, trainer


def timing(step: int, rollout_s: float, train_s: float, split: Split) -> StepTiming:
    return StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, rollout_devices=split.rollout,
                      train_devices=split.train)


def view(split: Split, steps: list[tuple[float, float]], candidates: tuple[Split, ...] = ()) -> ObservedView:
    recent = tuple(timing(i, r, t, split) for i, (r, t) in enumerate(steps))
    return ObservedView(now=100.0, step=len(steps) - 1, split=split, candidates=candidates, recent=recent,
                        costs=ResizeCosts())


# DynaResize's example: Train:Rollout 6:2, rollout 255 s against training 100 s.
DYNARESIZE = view(Split(6, 2), [(255.0, 100.0)] * 3)


# -- loading --------------------------------------------------------------------------------


def test_builtins_are_registered_under_the_entry_point_group() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["static"] == "dynaresized.policies.static:StaticPolicy"
    assert eps["hysteresis"] == "dynaresized.policies.hysteresis:HysteresisPolicy"
    assert {"static", "hysteresis"} <= set(available_policies())


def test_load_static() -> None:
    policy = load_policy("static")
    assert isinstance(policy, StaticPolicy) and isinstance(policy, Policy)
    assert policy.name == "static" and policy.guarded
    assert policy(DYNARESIZE) is None


def test_load_hysteresis_with_options() -> None:
    policy = load_policy("hysteresis", {"window": 2, "max_move": 1})
    assert isinstance(policy, HysteresisPolicy) and isinstance(policy, Policy)
    assert policy.name == "hysteresis" and policy.guarded
    assert (policy.window, policy.max_move) == (2, 1)
    assert isinstance(load_policy("hysteresis"), HysteresisPolicy)


def test_unknown_policy_names_the_installed_ones() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        load_policy("dynaresize-pro")
    message = str(info.value)
    assert "'dynaresize-pro'" in message and "hysteresis" in message and "static" in message
    assert isinstance(info.value, LookupError)


@pytest.mark.parametrize(
    "name,options,words",
    [("hysteresis", {"windw": 3}, ["bad options for policy 'hysteresis': unknown option(s) 'windw'; valid options: "
                                   "window (default 3), max_move (default None), lending (default True), "
                                   "lend_trainers (default True), lend_engines (default True)"]),
     ("static", {"window": 3}, ["bad options for policy 'static': unknown option(s) 'window'; valid options: none"]),
     ("hysteresis", {"window": 0}, ["window must be >= 1"])],
    ids=["misspelt", "static-takes-none", "out-of-range"],
)
def test_bad_options_raise_value_error(name: str, options: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        load_policy(name, options)
    for w in words:
        assert w in str(info.value)


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (dist-info + module) that registers two policies."""
    (tmp_path / "acme_policies.py").write_text(textwrap.dedent('''
        from dynaresized.core.policy import ObservedView, Proposal
        from dynaresized.domain import Split

        class Greedy:
            """Moves one device toward the slower stage at once, unguarded."""
            name = "acme-greedy"
            guarded = False

            def __call__(self, view: ObservedView) -> Proposal | None:
                if not view.recent:
                    return None
                last = view.recent[-1]
                step = 1 if last.rollout_s > last.train_s else -1
                target = Split(train=view.split.train - step, rollout=view.split.rollout + step)
                return Proposal(target=target, reason="greedy", predicted_step_s=1.0, predicted_step_s_after=0.0)

        class NotAPolicy:
            pass
    '''))
    dist = tmp_path / "acme_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme-greedy = acme_policies:Greedy\nacme-broken = acme_policies:NotAPolicy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("acme_policies", None)


def test_third_party_policy_loads_through_the_entry_point_group(third_party: Path) -> None:
    assert {"acme-greedy", "acme-broken", "static", "hysteresis"} <= set(available_policies())
    policy = load_policy("acme-greedy")
    assert isinstance(policy, Policy) and policy.name == "acme-greedy" and not policy.guarded
    with pytest.raises(TypeError, match="'acme-broken' does not implement the Policy interface"):
        load_policy("acme-broken")
    with pytest.raises(UnknownPolicyError, match="acme-broken, acme-greedy"):
        load_policy("nope")


def test_an_unguarded_policy_skips_hysteresis_but_not_safety(third_party: Path) -> None:
    d = boot(make_core(GuardConfig(signal_run=5, min_train=2), load_policy("acme-greedy")), 3, 2)
    facts, _ = d.send(ev.StepReported(at=1.0, worker_id=trainer(0), timing=timing(0, 50.0, 10.0, Split(3, 2))))
    assert [type(x) for x in facts] == [f.StepObserved, f.ResizeStarted]  # one step was enough
    assert facts[1].source == "acme-greedy"
    d.finish()
    assert d.state.split == Split(2, 3)
    # still rollout-bound: greedy wants 1:4, below the training pool's minimum
    facts, _ = d.send(ev.StepReported(at=2.0, worker_id=trainer(0), timing=timing(1, 50.0, 10.0, Split(2, 3))))
    assert [type(x) for x in facts] == [f.StepObserved, f.ProposalRejected]
    assert facts[1].guard == "min_pool" and facts[1].source == "acme-greedy"
    assert d.state.split == Split(2, 3)


# -- what the hysteresis policy proposes ----------------------------------------------------------


def test_hysteresis_picks_the_best_split_toward_the_slower_stage() -> None:
    # rollout work 255 x 2 = 510 device-s, training 100 x 6 = 600: 4:4 predicts max(127.5, 150) = 150
    p = HysteresisPolicy()(DYNARESIZE)
    assert p is not None and p.target == Split(4, 4)
    assert p.predicted_step_s == pytest.approx(255.0) and p.predicted_step_s_after == pytest.approx(150.0)
    assert "rollout is the slower stage" in p.reason and "6:2 -> 4:4" in p.reason


def test_hysteresis_grows_training_when_training_is_slower() -> None:
    p = HysteresisPolicy()(view(Split(2, 6), [(100.0, 255.0)] * 3))
    assert p is not None and p.target == Split(4, 4)
    assert "training is the slower stage" in p.reason


def test_hysteresis_respects_the_candidates() -> None:
    allowed = (Split(6, 2), Split(5, 3), Split(2, 6))
    p = HysteresisPolicy()(view(Split(6, 2), [(255.0, 100.0)] * 3, candidates=allowed))
    assert p is not None and p.target == Split(5, 3)  # 4:4 would be better but is not allowed
    # no allowed split in the right direction: nothing, rather than a move the wrong way
    assert HysteresisPolicy()(view(Split(6, 2), [(255.0, 100.0)] * 3, candidates=(Split(6, 2), Split(7, 1)))) is None


def test_hysteresis_max_move() -> None:
    p = HysteresisPolicy(max_move=1)(DYNARESIZE)
    assert p is not None and p.target == Split(5, 3)


def test_hysteresis_proposes_nothing_without_a_gain_or_a_step() -> None:
    assert HysteresisPolicy()(view(Split(4, 4), [(100.0, 100.0)] * 3)) is None
    assert HysteresisPolicy()(view(Split(4, 4), [(110.0, 100.0)] * 3)) is None  # 3:5 would be slower
    assert HysteresisPolicy()(view(Split(4, 4), [])) is None


def test_hysteresis_window() -> None:
    steps = [(50.0, 200.0), (50.0, 200.0), (200.0, 50.0)]  # training was slow; the last step flips
    assert HysteresisPolicy(window=3)(view(Split(4, 4), steps)) is None  # on average, still training-bound
    p = HysteresisPolicy(window=1)(view(Split(4, 4), steps))
    assert p is not None and p.target == Split(2, 6)


def test_hysteresis_does_not_move_on_a_mean_its_own_steps_contradict() -> None:
    # 6:2, each step rollout-bound; the window's mean says 5:3 saves time, but the middle step
    # alone (rollout 110 s vs training 100 s: 5:3 would make training the bottleneck) says not
    noisy = view(Split(6, 2), [(300.0, 100.0), (110.0, 100.0), (300.0, 100.0)], candidates=(Split(6, 2), Split(5, 3)))
    policy = HysteresisPolicy()
    assert policy(noisy) is None
    assert "step(s) 1 alone predict no saving: within the steps' noise" in policy.last_reason
    assert HysteresisPolicy(agree=False)(noisy) is not None  # the option turns the check off
    # a shift shows in every step of the latest run that asks for the move: the steps before it
    # asked the other way, and do not hold it back
    shifted = view(Split(6, 2), [(50.0, 200.0), (50.0, 200.0), (600.0, 100.0)], candidates=(Split(6, 2), Split(5, 3)))
    p = HysteresisPolicy(window=3)(shifted)
    assert p is not None and p.target == Split(5, 3)


splits = st.integers(2, 10).flatmap(lambda n: st.integers(1, n - 1).map(lambda t: Split(train=t, rollout=n - t)))


@settings(max_examples=300, deadline=None)
@given(
    split=splits,
    steps=st.lists(st.tuples(st.floats(0.0, 500.0), st.floats(0.0, 500.0)), min_size=1, max_size=5),
    window=st.integers(1, 4),
    max_move=st.one_of(st.none(), st.integers(1, 3)),
    restrict=st.booleans(),
    data=st.data(),
)
def test_hysteresis_proposals_are_always_improving_moves_toward_the_slower_stage(
    split: Split, steps: list[tuple[float, float]], window: int, max_move: int | None, restrict: bool,
    data: st.DataObject,
) -> None:
    n = split.total
    candidates: tuple[Split, ...] = ()
    if restrict:
        every = [Split(train=t, rollout=n - t) for t in range(1, n)]
        candidates = tuple(data.draw(st.lists(st.sampled_from(every), unique=True, max_size=n)))
    v = view(split, steps, candidates)
    p = HysteresisPolicy(window=window, max_move=max_move)(v)
    if p is None:
        return
    last = v.recent[-1]
    assert p.target != split and p.target.total == n
    assert p.target.train >= 1 and p.target.rollout >= 1
    if candidates:
        assert p.target in candidates
    if max_move is not None:
        assert abs(p.target.rollout - split.rollout) <= max_move
    if last.rollout_s > last.train_s:
        assert p.target.rollout > split.rollout
    else:
        assert p.target.train > split.train
    assert p.predicted_step_s_after < p.predicted_step_s
    assert p.saving_per_step_s > 0


def test_predicted_step_s() -> None:
    assert predicted_step_s(510.0, 600.0, Split(4, 4), sync_s=2.0) == pytest.approx(152.0)
    assert predicted_step_s(510.0, 600.0, Split(8, 0)) == float("inf")


def test_the_jobs_pipeline_reaches_the_policys_views() -> None:
    """`[pipeline]`: a job whose unfinished responses carry over (verl's fully-async pipeline with
    partial rollout) gets views that say no tail binds a step, so the policy's cost model drops
    the latency floor; any other pipeline keeps it."""
    import msgspec

    from dynaresized.core.loans import loan_view
    from dynaresized.domain import PipelineSpec
    from tests.core.cluster import boot, make_core

    carried = PipelineSpec(mode="fully-async", staleness=0.5, partial_rollout=True, sync_every=4)
    for pipeline, binds in ((PipelineSpec(), True), (PipelineSpec(mode="fully-async", staleness=0.5), True),
                            (carried, False)):
        core = make_core(policy="hysteresis")
        core = type(core)(msgspec.structs.replace(core.config, pipeline=pipeline), core.policy)
        d = boot(core, 2, 2)
        assert core.view(d.state, 1.0).tail_binds is binds
        assert loan_view(core, d.state, 1.0).tail_binds is binds


def test_the_next_rollout_done_reaches_the_view_and_the_option_decides_from_it() -> None:
    """One-step off, at a boundary the next step's rollout is done a window before its step
    report: the engines' progress says when (`ObservedView.rollout_done_s`), and `hysteresis`
    with `decide_from_progress` counts it as its newest step, beside the last step's training."""
    from dynaresized.core.loans import step_started_at

    d = boot(make_core(policy="hysteresis"), 2, 2)
    d.send(ev.StepReported(at=d.at(100.0), worker_id=trainer(0), timing=StepTiming(
        step=0, rollout_s=100.0, train_s=100.0, rollout_devices=2, train_devices=2)))
    began = step_started_at(d.state)
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=1, done=0, total=4))  # training 1 begins
    assert d.core.view(d.state, d.at()).rollout_done_step == -1  # rollout 2 not done yet
    d.send(ev.ProgressReported(at=d.at(150.0), worker_id=engine(2), step=2, done=8, total=16))
    assert d.state.rollout_done is None  # half of its samples
    last = d.at(150.0)
    d.send(ev.ProgressReported(at=last, worker_id=engine(3), step=2, done=8, total=16))
    seen = d.core.view(d.state, d.at())
    assert seen.rollout_done_step == 2 and seen.rollout_done_s == pytest.approx(last - began)
    assert d.state.durable().rollout_done is None  # soft state, as the reports are
    # the policy: rollout 2 took 600 s beside training 1's 100 s; the step reports said 100/100
    split = Split(2, 2)
    balanced = ObservedView(now=seen.now, step=1, split=split, candidates=(), costs=ResizeCosts(),
                            recent=(timing(0, 100.0, 100.0, split), timing(1, 100.0, 100.0, split)),
                            rollout_done_step=2, rollout_done_s=600.0)
    assert HysteresisPolicy()(balanced) is None  # off by default: the measured steps are even
    p = HysteresisPolicy(decide_from_progress=True)(balanced)
    assert p is not None and p.target == Split(1, 3) and "at step 2" in p.reason
    # a rollout reported done of a step already reported, or none: the view as it is
    import msgspec

    stale = msgspec.structs.replace(balanced, rollout_done_step=1)
    assert HysteresisPolicy.with_rollout_done(stale) is stale
