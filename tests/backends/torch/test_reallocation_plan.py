"""Reallocation plans, checked before anything moves: minimal, each byte once, same-node senders
first, costed with ReaL's bandwidths, printable, and loud about impossible layouts."""

from __future__ import annotations

import itertools

import msgspec
import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.jobs import SyntheticRegression  # noqa: E402
from dynaresized.backends.torch.reallocation import (  # noqa: E402
    Bandwidth,
    FlatShards,
    FlatSpace,
    PlanError,
    Replicated,
    TensorParallel,
    Transfer,
    intersect,
    intervals,
    plan_reallocation,
    size,
    subtract,
)

pytestmark = pytest.mark.torch

NODES = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


@pytest.fixture(scope="module")
def space() -> FlatSpace:
    return FlatSpace.of(SyntheticRegression(width=64, depth=3, inputs=16, outputs=8).build_model().named_parameters())


def all_layouts(space: FlatSpace) -> list:
    return [Replicated((0, 1)), Replicated((0, 1, 2, 3)), FlatShards((1, 2, 3)), FlatShards((0, 1, 2, 3)),
            TensorParallel.megatron(space, (2, 3)), TensorParallel.megatron(space, (0, 1, 2, 3))]


def test_interval_arithmetic():
    a = intervals([(10, 20), (0, 5), (4, 8), (30, 30)])
    assert a.tolist() == [[0, 8], [10, 20]]
    b = intervals([(6, 12), (18, 40)])
    assert intersect(a, b).tolist() == [[6, 8], [10, 12], [18, 20]]
    assert subtract(a, b).tolist() == [[0, 6], [12, 18]]
    assert size(subtract(a, a)) == 0


def test_every_pair_is_minimal_and_checks(space):
    for src, dst in itertools.product(all_layouts(space), repeat=2):
        plan = plan_reallocation(space, src, dst, NODES)
        plan.check(space, src, dst)
        assert plan.bytes_moved == plan.min_bytes
        pairs = [(t.src, t.dst) for t in plan.transfers]
        assert len(pairs) == len(set(pairs))  # one message per sender/receiver pair
        assert all(t.src != t.dst for t in plan.transfers)


def test_layout_holdings(space):
    total = space.total_bytes
    shards = FlatShards((1, 2, 3)).holdings(space)
    assert sum(size(iv) for iv in shards.values()) == total
    assert all(iv[0, 0] % space.align == 0 for iv in shards.values())  # an element is never cut
    tp = TensorParallel.megatron(space, (0, 1, 2, 3)).holdings(space)
    replicated = sum(t.nbytes for t in space.tensors if t.name not in TensorParallel.megatron(space, (0,)).split)
    assert sum(size(iv) for iv in tp.values()) == total + 3 * replicated  # split tensors once, the rest 4 times


def test_same_node_sender_is_preferred_and_cost_uses_the_link(space):
    # ranks 2, 3 (node1) get everything; the source replicas live on 0 (node0) and 3 (node1)
    plan = plan_reallocation(space, Replicated((0, 3)), Replicated((0, 2, 3)), NODES)
    assert [(t.src, t.dst) for t in plan.transfers] == [(3, 2)]
    assert plan.cost() == pytest.approx(space.total_bytes / 170e9)
    across = plan_reallocation(space, Replicated((0,)), Replicated((0, 2)), NODES)
    assert across.cost() == pytest.approx(space.total_bytes / 20e9)
    assert across.cost(Bandwidth(inter_node_bytes_per_s=1e9)) == pytest.approx(space.total_bytes / 1e9)
    text = str(across)
    assert "rank 0 -> rank 2 (across nodes)" in text and f"{space.total_bytes} bytes" in text


def test_load_spreads_over_holders(space):
    # two new replicas, two holders on the same node: each holder feeds one
    plan = plan_reallocation(space, Replicated((0, 1)), Replicated((0, 1, 2, 3)), {r: "node0" for r in range(4)})
    assert sorted((t.src, t.dst) for t in plan.transfers) == [(0, 2), (1, 3)]


def test_check_rejects_a_plan_that_sends_a_byte_twice(space):
    src, dst = Replicated((0, 1)), Replicated((0, 1, 2))
    plan = plan_reallocation(space, src, dst, NODES)
    doubled = plan.transfers + (Transfer(src=1, dst=2, intervals=((0, 8),), nbytes=8),)
    with pytest.raises(PlanError, match="twice"):
        msgspec.structs.replace(plan, transfers=doubled).check(space, src, dst)
    with pytest.raises(PlanError, match="does not hold"):
        bad = (Transfer(src=3, dst=2, intervals=((0, 8),), nbytes=8),)
        msgspec.structs.replace(plan, transfers=bad).check(space, src, dst)


def test_impossible_layouts_are_named(space):
    with pytest.raises(PlanError, match="cannot be split 3 ways"):
        TensorParallel.megatron(space, (0, 1, 2)).holdings(space)
    with pytest.raises(PlanError, match=r"no source rank holds bytes \[\d+, \d+\) \(tensor 0.bias\)"):
        plan_reallocation(space, _Partial(), Replicated((2,)), NODES)


class _Partial:
    """A broken source layout that holds only the first tensor."""

    ranks = (0,)

    def holdings(self, space):
        return {0: intervals([(0, space.tensors[0].nbytes)])}

    def describe(self) -> str:
        return "first tensor only"
