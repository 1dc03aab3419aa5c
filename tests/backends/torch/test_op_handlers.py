"""The daemon-facing handlers of a trainer rank (backends/torch/op_handlers.py), without
processes: an op that does not apply to the rank's state is refused with the reason, and a
JOIN hands the loop the change the daemon asked for (a loan when its plan says so)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized import wire  # noqa: E402
from dynaresized.backends.torch.jobs import SyntheticRegression  # noqa: E402
from dynaresized.backends.torch.store import StoreAddress  # noqa: E402
from dynaresized.backends.torch.trainer import NotReady, TrainerRank  # noqa: E402
from dynaresized.domain import OpKind, PlanKind, Pool  # noqa: E402

from .cluster import DEVICES, trainer_config  # noqa: E402

pytestmark = pytest.mark.torch

D0, D1, D2, D3 = DEVICES


def idle_rank(device: str = D2) -> TrainerRank:
    """An idle rank outside the training group; its loop is not running, so intents stay queued."""
    return TrainerRank(trainer_config(device=device, micro_batches=12, mini_batches=3), SyntheticRegression(),
                       StoreAddress("127.0.0.1", 1))


def op(kind: OpKind, devices: tuple[str, ...] = (D2,), training: tuple[str, ...] = (D0, D1, D2),
       plan: PlanKind = PlanKind.RESIZE) -> wire.OpCommand:
    return wire.OpCommand(op_id=f"l1/0-{kind.value}", resize_id="l1", kind=kind, devices=devices,
                          from_pool=Pool.ROLLOUT, to_pool=Pool.TRAINING, timeout_s=5.0, training=training,
                          rollout=tuple(d for d in DEVICES if d not in training), plan=plan)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(("plan", "loan"), [(PlanKind.LOAN, True), (PlanKind.RESIZE, False)])
def test_join_hands_the_loop_the_change_and_marks_a_loan(plan, loan):
    rank = idle_rank()

    async def join_until_queued() -> None:
        task = asyncio.create_task(rank.join(op(OpKind.JOIN, plan=plan)))
        while rank._intents.empty():
            await asyncio.sleep(0.001)
        task.cancel()

    run(join_until_queued())
    intent = rank._intents.get_nowait()
    assert intent.kind == "join"
    assert intent.change.add == (2,) and intent.change.expect == (0, 1, 2) and intent.change.loan is loan


@pytest.mark.parametrize(("kind", "message"), [
    (OpKind.DRAIN, "drain l1/0-drain: rank 2 is not training (idle)"),
    (OpKind.RESTORE, "restore l1/0-restore: rank 2 has not joined (it is idle)"),
])
def test_an_op_that_does_not_apply_to_an_idle_rank_is_refused(kind, message):
    with pytest.raises(NotReady, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(getattr(idle_rank(), kind.value)(op(kind)))


def test_ops_that_are_already_true_answer_so():
    rank = idle_rank()
    assert run(rank.release(op(OpKind.RELEASE))) == "not holding the device (idle)"


def test_an_op_for_another_device_or_an_unknown_pool_is_refused():
    rank = idle_rank()
    with pytest.raises(ValueError, match="names devices \\['node0:cpu3'\\], not this rank's node0:cpu2"):
        run(rank.join(op(OpKind.JOIN, devices=(D3,))))
    with pytest.raises(ValueError, match="training pool names devices without a trainer in this job: \\['gpu9'\\]"):
        run(rank.join(op(OpKind.JOIN, training=(D0, "gpu9"))))
