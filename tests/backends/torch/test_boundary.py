"""The leader's side of a step boundary (backends/torch/boundary.py) on a real store, without
process groups: which change it claims, which loans it refuses, and how lent ranks go home."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.jobs import SyntheticRegression  # noqa: E402
from dynaresized.backends.torch.membership import Change, ChangeStatus, Registry  # noqa: E402
from dynaresized.backends.torch.store import StoreHost, connect_store  # noqa: E402
from dynaresized.backends.torch.trainer import TrainerRank  # noqa: E402

from .cluster import trainer_config  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def leader() -> Iterator[TrainerRank]:
    """Rank 0, leader of {0, 1} at optimizer step 0 of a job with 3 mini-batches per RL step."""
    with StoreHost() as host:
        rank = TrainerRank(trainer_config(micro_batches=12, mini_batches=3), SyntheticRegression(), host.address)
        rank.registry = Registry(connect_store(host.address), host.address.prefix)
        rank.members, rank.epoch, rank.step = (0, 1), 0, 0
        yield rank


def post(rank: TrainerRank, **change: Any) -> Change:
    c = Change(**change)
    for r in c.movers:
        rank.registry.post(c, r)
    return c


def test_a_loan_is_claimed_at_a_boundary_inside_the_step_and_its_rank_marked_lent(leader):
    leader.step = 4  # RL step 1, before mini-batch 1
    c = post(leader, cid="l1/join", add=(2,), expect=(0, 1, 2), loan=True)
    index = leader._leader_scan()
    assert index > 0 and leader.registry.indexed(index) == c.cid
    st = leader.registry.state(c.cid)
    assert st.status is ChangeStatus.APPLYING and st.members == (0, 1, 2) and st.lent == (2,)


@pytest.mark.parametrize(("step", "mini_batches", "reason"), [
    (3, 3, "no boundary left inside the training step: RL step 0 has ended (optimizer step 3)"),
    (2, 1, "the training step has no boundary inside it (mini_batches=1)"),
])
def test_a_loan_seen_at_an_rl_step_boundary_is_refused_with_the_reason(leader, step, mini_batches, reason):
    if mini_batches == 1:
        leader.config = trainer_config(micro_batches=12, mini_batches=1)
    leader.step = step
    loan = post(leader, cid="l1/join", add=(2,), expect=(0, 1, 2), loan=True)
    resize = post(leader, cid="r2/join", add=(3,), expect=(0, 1, 3))
    index = leader._leader_scan()
    st = leader.registry.state(loan.cid)
    assert st.status is ChangeStatus.REJECTED and reason in st.detail
    assert leader.registry.indexed(index) == resize.cid  # an ordinary join still goes ahead at this boundary


def test_lent_members_go_home_first_at_the_rl_step_boundary_and_queued_changes_wait(leader):
    leader.members, leader.lent, leader.step = (0, 1, 2), (2,), 6
    drain = post(leader, cid="r3/drain", remove=(1,), expect=(0,))
    index = leader._leader_scan()
    cid = leader.registry.indexed(index)
    assert cid == "loans@0.6/home"
    home = leader.registry.state(cid)
    assert home.status is ChangeStatus.APPLYING and home.members == (0, 1) and home.before == (0, 1, 2)
    assert leader.registry.state(drain.cid).status is ChangeStatus.PENDING
    assert leader.cursor == 0  # the home change jumped the queue: the drain is found at the next scan
    leader.lent, leader.members, leader.step = (), (0, 1), 7
    assert leader.registry.indexed(leader._leader_scan()) == drain.cid


def test_a_group_larger_than_a_mini_batch_is_refused(leader):
    leader.config = trainer_config(micro_batches=6, mini_batches=2)  # 3 micro-batches per mini-batch
    assert leader._validate(Change(cid="r4/join", add=(2,))) == ((0, 1, 2), "")
    leader.members = (0, 1, 2)
    assert leader._validate(Change(cid="r5/join", add=(3,))) == (
        (0, 1, 2, 3), "a mini-batch of 3 micro-batches cannot be split over 4 ranks")
