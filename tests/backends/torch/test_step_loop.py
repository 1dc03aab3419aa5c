"""The step loop's rules (backends/torch/step_loop.py), without processes: how an RL step's
global batch is cut into mini-batches, which member computes which micro-batch, and why the
deterministic reduction's result does not depend on the group's size."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.step_loop import ordered_sum, share  # noqa: E402

from .cluster import trainer_config  # noqa: E402

pytestmark = pytest.mark.torch


def test_mini_batches_cut_the_global_batch_in_order():
    cfg = trainer_config(micro_batches=12, mini_batches=3)
    assert cfg.mini_batch_size == 4
    assert [cfg.position(s) for s in range(7)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert [list(cfg.micro_batches_of(m)) for m in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    one = trainer_config(micro_batches=8)  # the default: one optimizer step per RL step, the whole batch
    assert one.position(5) == (5, 0) and list(one.micro_batches_of(0)) == list(range(8))


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(micro_batches=12, mini_batches=5), "mini_batches=5 must be at least 1 and divide micro_batches=12"),
    (dict(micro_batches=8, mini_batches=0), "mini_batches=0 must be at least 1"),
    (dict(micro_batches=4, mini_batches=4), "a mini-batch of 1 micro-batches cannot be split over 2 initial ranks"),
])
def test_bad_mini_batch_settings_are_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError, match=message):
        trainer_config(**overrides).validate()


def test_every_micro_batch_of_a_mini_batch_is_computed_by_exactly_one_member():
    batch = range(8, 12)
    for k in (1, 2, 3, 4):
        shares = [share(batch, k, p) for p in range(k)]
        assert sorted(mb for s in shares for mb in s) == list(batch)
    assert share(batch, 3, 0) == (8, 11) and share(batch, 3, 2) == (10,)


def test_ordered_sum_is_bitwise_the_same_for_every_group_size():
    # float32 addition is not associative: only the fixed order makes these equal
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(257, generator=gen) * 10 ** (i % 5) for i in range(6)]
    expected = grads[0].clone()
    for g in grads[1:]:
        expected.add_(g)
    shuffled = grads[0].clone()
    for g in reversed(grads[1:]):
        shuffled.add_(g)
    assert not torch.equal(shuffled, expected)  # the check below would catch a different order
    for k in (1, 2, 3, 4):
        rows = [torch.stack([grads[i] for i in range(p, 6, k)] + [torch.zeros(257)] * (-(-6 // k) - len(range(p, 6, k))))
                for p in range(k)]  # what all_gather returns: each member's gradients, padded to ceil(6/k)
        out = ordered_sum(torch.empty(257), rows, 6)
        assert torch.equal(out, expected), f"group of {k}"


