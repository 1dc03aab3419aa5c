"""Trainers SIGKILLed in the middle of a join. A member: the join fails with an error naming it
(what the worker client reports to the daemon), the survivors rebuild their group and keep
training, and the resize can be retried on the survivors. The joiner itself: its op dies with
it (the daemon sees the worker lost), and the members carry on without it."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.membership import ChangeStatus, Registry  # noqa: E402
from dynaresized.backends.torch.store import connect_store  # noqa: E402
from dynaresized.domain import OpKind  # noqa: E402

from .cluster import DEVICES, assert_lockstep, finish, start, trainer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

FIVE = (*DEVICES, "node0:cpu4")
D0, D1, D2, D3, D4 = FIVE


def test_members_or_joiners_killed_during_a_join_leave_the_survivors_training():
    # Slow steps (1 s), so the joiner is still waiting for a step boundary when the victim dies.
    config = trainer_config(devices=FIVE, initial=FIVE[:3], candidates=(FIVE[:3], FIVE[:4]), step_delay_s=1.0,
                            peer_timeout_s=1.0)
    job = start(config, op_timeout_s=60.0)
    try:
        registry = Registry(connect_store(job.host.address), job.host.address.prefix)
        join = job.command(OpKind.JOIN, (D3,), training=FIVE[:4], resize_id="r-killed")
        pending = job.ranks[D3].op(join)
        wait_for(lambda: registry.state("r-killed/join") is not None, what="the join request in the store")
        job.ranks[D1].kill()

        ok, detail = pending.result(120)
        assert not ok
        assert "node0:cpu1" in detail, detail  # the error names the dead member
        final = registry.state("r-killed/join")
        assert final is not None and final.status in (ChangeStatus.FAILED, ChangeStatus.REJECTED)

        # the daemon rolls back: EVICT to the joiner, which is not a member
        evict = job.command(OpKind.EVICT, (D3,), training=(D0, D1, D2), resize_id="r-killed")
        ok, detail = job.ranks[D3].op(evict).result(60)
        assert ok, detail

        # the survivors train on, as a group of two (a group built after the failure)
        wait_for(lambda: job.ranks[D0].view()["members"] == (0, 2) and job.ranks[D0].view()["state"] == "training",
                 what="the survivors' group")
        job.training = (D0, D2)
        step = job.ranks[D0].view()["step"]
        wait_for(lambda: job.ranks[D2].view()["step"] >= step + 2, what="two steps on the survivors")

        # and the resize can be retried with the survivors: 0, 2 and the joiner
        retry = job.grow(D3)
        assert retry.ok, retry.failures()

        # now the joiner dies while it waits for the members' step boundary
        pending = job.ranks[D4].op(job.command(OpKind.JOIN, (D4,), training=(D0, D2, D3, D4), resize_id="r-joiner"))
        wait_for(lambda: registry.state("r-joiner/join") is not None, what="the second join request")
        job.ranks[D4].kill()
        with pytest.raises(RuntimeError, match="exited"):
            pending.result(60)  # the op dies with its process: the daemon sees the worker lost
        wait_for(lambda: (s := registry.state("r-joiner/join")) is not None and s.status.final,
                 what="the members to give up on the dead joiner")
        assert registry.state("r-joiner/join").status is ChangeStatus.FAILED
        step = job.ranks[D0].view()["step"]
        wait_for(lambda: job.ranks[D3].view()["step"] >= step + 2, what="two more steps on 0, 2, 3")
        assert job.ranks[D0].view()["members"] == (0, 2, 3)
        histories = finish(job)
    finally:
        job.close()

    memberships = assert_lockstep(histories, devices=FIVE)  # the dead ranks' records are gone with them
    assert memberships[-2:] == [(0, 2), (0, 2, 3)]
