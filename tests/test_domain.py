"""The domain nouns: pools and worker kinds pair up, placements, splits, the op order and its
undo table, and every record is frozen and survives msgpack and JSON."""

from __future__ import annotations

import msgspec
import pytest

from dynaresized.domain import (
    FORWARD_ORDER,
    UNDO,
    OpKind,
    OpSpec,
    Placement,
    Pool,
    ResizePlan,
    Split,
    StepTiming,
    Worker,
    WorkerKind,
    WorkerStatus,
    moving,
    placed,
)


def test_pools_and_worker_kinds_pair_up() -> None:
    assert Pool.ROLLOUT.other is Pool.TRAINING and Pool.TRAINING.other is Pool.ROLLOUT
    for pool in Pool:
        assert WorkerKind.for_pool(pool).pool is pool
    assert WorkerKind.ROLLOUT_ENGINE.pool is Pool.ROLLOUT and WorkerKind.TRAINER_RANK.pool is Pool.TRAINING
    assert Pool("rollout") is Pool.ROLLOUT and WorkerKind("trainer-rank") is WorkerKind.TRAINER_RANK


def test_placements() -> None:
    assert placed(Pool.TRAINING) == Placement(pool=Pool.TRAINING) and not placed(Pool.TRAINING).is_moving
    m = moving(Pool.ROLLOUT, Pool.TRAINING)
    assert m.is_moving and (m.pool, m.moving_from, m.moving_to) == (None, Pool.ROLLOUT, Pool.TRAINING)


def test_split() -> None:
    s = Split(train=6, rollout=2)
    assert s.total == 8 and str(s) == "6:2"
    assert sorted([Split(4, 4), Split(2, 6), Split(6, 2)]) == [Split(2, 6), Split(4, 4), Split(6, 2)]


def test_forward_order_and_undo() -> None:
    assert FORWARD_ORDER == (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT)
    assert UNDO == {OpKind.DRAIN: OpKind.RESUME, OpKind.RELEASE: OpKind.RECLAIM, OpKind.JOIN: OpKind.EVICT}
    # the undo ops are exactly the op kinds that are not forward ops; commit has no undo
    assert set(UNDO.values()) == set(OpKind) - set(FORWARD_ORDER)
    assert OpKind.COMMIT not in UNDO and OpKind.RESTORE not in UNDO


PLAN = ResizePlan(
    resize_id="r1",
    devices=("n0:gpu6", "n0:gpu7"),
    from_pool=Pool.TRAINING,
    to_pool=Pool.ROLLOUT,
    ops=tuple(OpSpec(op_id=f"r1/{i}-{k.value}", kind=k, devices=("n0:gpu6", "n0:gpu7"), targets=("tr6", "tr7"),
                     from_pool=Pool.TRAINING, to_pool=Pool.ROLLOUT) for i, k in enumerate(FORWARD_ORDER)),
    before=Split(6, 2),
    after=Split(4, 4),
)
RECORDS = [
    PLAN,
    Worker("eng0", WorkerKind.ROLLOUT_ENGINE, ("n0:gpu0",), WorkerStatus.LOST, 3.5, 2),
    StepTiming(step=3, rollout_s=255.0, train_s=100.0, weight_sync_s=0.12, rollout_devices=2, train_devices=6),
    moving(Pool.TRAINING, Pool.ROLLOUT),
    Split(4, 4),
]


def test_plan_direction() -> None:
    assert PLAN.direction == "training->rollout"


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_are_frozen_and_round_trip(record: msgspec.Struct) -> None:
    with pytest.raises(AttributeError):
        setattr(record, record.__struct_fields__[0], None)
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(record), type=type(record)) == record


def test_response_lengths_of_a_step_are_its_inverted_cdf_quantiles_and_the_longests_pace() -> None:
    from dynaresized.domain import ResponseLengths

    lengths = ResponseLengths.of([30, 5, 20, 10, 30], longest_s=6.0)
    assert lengths.quantiles == (20, 30, 30, 30) and lengths.token_s == 0.2 and lengths.floor_s == 6.0
    assert ResponseLengths.of(list(range(1, 11)), 1.0).quantiles == (5, 9, 10, 10)
    assert ResponseLengths.of([], 0.0) == ResponseLengths(quantiles=(0, 0, 0, 0))
