"""Pieces of the torch backend that need no second process: membership records in a real
TCPStore, the group cache's generations, donor choice, state outlines and config errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.communicators import Communicators  # noqa: E402
from dynaresized.backends.torch.jobs import SyntheticRegression  # noqa: E402
from dynaresized.backends.torch.membership import (  # noqa: E402
    Change,
    ChangeState,
    ChangeStatus,
    Recovery,
    Registry,
    Topology,
)
from dynaresized.backends.torch.state import StateMismatch, TrainingState  # noqa: E402
from dynaresized.backends.torch.store import StoreAddress, StoreHost, connect_store  # noqa: E402
from dynaresized.backends.torch.trainer import TrainerConfig, assign_donors  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def host():
    with StoreHost() as h:
        yield h


def test_a_change_is_published_once_whoever_of_its_movers_posts(host):
    a = Registry(connect_store(host.address), "job")
    b = Registry(connect_store(host.address), "job")
    change = Change(cid="r1/join", add=(2, 3), expect=(0, 1, 2, 3))
    assert a.post(change, by=2) is True
    assert not a.ready(change, (0, 1))
    assert b.post(change, by=3) is False
    assert a.ready(change, (0, 1))
    assert a.seq() == 1 and a.indexed(1) == "r1/join"
    with pytest.raises(ValueError, match="already posted with different content"):
        b.post(Change(cid="r1/join", add=(2,)), by=2)


def test_claim_cancel_and_settle_are_compare_and_set(host):
    reg = Registry(connect_store(host.address), "job")
    reg.post(Change(cid="r1/join", add=(2,)), by=2)
    pending = reg.state("r1/join")
    assert pending == ChangeState(ChangeStatus.PENDING)
    claim = ChangeState(ChangeStatus.APPLYING, epoch=5, members=(0, 1, 2), before=(0, 1))
    assert reg.transition("r1/join", pending, claim)
    # an evict racing the claim loses: the change is already being applied
    assert not reg.transition("r1/join", pending, ChangeState(ChangeStatus.CANCELLED))
    done = reg.settle("r1/join", ChangeState(ChangeStatus.DONE, 5, (0, 1, 2)))
    assert done.status is ChangeStatus.DONE
    # a final state stays final
    assert reg.settle("r1/join", ChangeState(ChangeStatus.FAILED)).status is ChangeStatus.DONE


def test_first_recovery_proposal_and_first_epoch_win(host):
    reg = Registry(connect_store(host.address), "job")
    first = Recovery(from_epoch=3, epoch=7, members=(0, 2), dead=(1,), reason="rank 1 died")
    second = Recovery(from_epoch=3, epoch=8, members=(0, 1, 2), dead=(), reason="timeout")
    assert reg.decide_recovery(first) == first
    assert reg.decide_recovery(second) == first
    t0 = Topology(epoch=0, members=(0, 1), step=0)
    assert reg.establish(None, t0) == t0
    t1 = Topology(epoch=1, members=(0, 1, 2), step=4)
    assert reg.establish(t0, t1) == t1
    assert reg.establish(t0, Topology(epoch=2, members=(0,), step=4)) == t1  # stale writer loses
    assert reg.new_epoch() < reg.new_epoch()


def test_group_cache_hits_until_a_taint_bumps_the_generation(host):
    store = connect_store(host.address)
    comms = Communicators(store, "job", rank=0, timeout_s=10)
    assert comms.prewarm([(0,), (1, 2), (0,)]) == 1  # only memberships with this rank, once each
    g = comms.group((0,))
    assert g is comms.group([0]) and comms.stats.hits == 2 and comms.stats.builds == 0
    t = torch.arange(4.0)
    g.all_reduce(t)
    assert g.all_gather(t)[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    comms.taint((0,), "test: saw an error")
    fresh = comms.group((0,))
    assert fresh is not g and fresh.generation == 1 and comms.stats.builds == 1
    other = Communicators(store, "job", rank=0, timeout_s=10)
    assert other.group((0,)).generation == 1  # every rank reads the bumped generation
    with pytest.raises(ValueError, match="not in"):
        comms.group((1, 2))
    comms.close()
    other.close()


def test_donors_prefer_the_joiners_node_then_spread():
    node = {0: "a", 1: "a", 2: "b", 3: "b", 4: "b"}.__getitem__
    assert assign_donors((0, 1, 2), (3, 4), node) == {3: 2, 4: 2}
    assert assign_donors((0, 1), (3, 4), node) == {3: 0, 4: 1}
    with pytest.raises(ValueError, match="no member holds"):
        assign_donors((), (3,), node)


def test_outline_mismatch_names_the_tensor():
    donor_job, joiner_job = SyntheticRegression(width=8), SyntheticRegression(width=9)
    donor_model, joiner_model = donor_job.build_model(), joiner_job.build_model()
    donor = TrainingState(donor_model, donor_job.build_optimizer(donor_model))
    joiner = TrainingState(joiner_model, joiner_job.build_optimizer(joiner_model))
    outline = donor.outline(epoch=1, step=0, members=(0, 1), with_optimizer=False, transfer="direct",
                            chunk_bytes=1)
    with pytest.raises(StateMismatch, match=r"param:0.weight \[8, 32\] float32, this rank has param:0.weight \[9"):
        joiner.check_outline(outline)


def test_optimizer_layout_is_adopted_in_place_where_it_matches():
    job = SyntheticRegression(width=8)
    a_model, b_model = job.build_model(), job.build_model()
    a, b = TrainingState(a_model, job.build_optimizer(a_model)), TrainingState(b_model, job.build_optimizer(b_model))
    for state in (a, b):
        state.model(torch.zeros(1, 32)).sum().backward()
        state.optimizer.step()
    outline = a.outline(epoch=1, step=1, members=(0, 1), with_optimizer=True, transfer="direct", chunk_bytes=1)
    before = [t.data_ptr() for t in b.optimizer_tensors()]
    b.adopt_optimizer_layout(outline)
    assert [t.data_ptr() for t in b.optimizer_tensors()] == before
    fresh_model = job.build_model()
    fresh = TrainingState(fresh_model, job.build_optimizer(fresh_model))
    fresh.adopt_optimizer_layout(outline)  # a rank that never stepped gets tensors to receive into
    assert [tuple(t.shape) for t in fresh.optimizer_tensors()] == [tuple(t.shape) for t in a.optimizer_tensors()]


def test_config_errors_name_the_key():
    devices = ("n0:cpu0", "n0:cpu1")
    with pytest.raises(ValueError, match="device 'n0:cpu9' is not one of devices"):
        TrainerConfig(devices=devices, device="n0:cpu9", initial=devices).validate()
    with pytest.raises(ValueError, match=r"candidates\[0\] names unknown devices \['x'\]"):
        TrainerConfig(devices=devices, device=devices[0], initial=devices, candidates=(("x",),)).validate()
    with pytest.raises(ValueError, match="micro_batches=1 cannot be split over 2"):
        TrainerConfig(devices=devices, device=devices[0], initial=devices, micro_batches=1).validate()
    with pytest.raises(ValueError, match="peer_timeout_s must be at least 3 heartbeat"):
        TrainerConfig(devices=devices, device=devices[0], initial=devices, peer_timeout_s=0.1).validate()
    with pytest.raises(ValueError, match="has no trainer in this job"):
        TrainerConfig(devices=devices, device=devices[0], initial=devices).rank_of("n1:cpu0")


def test_store_addresses():
    assert StoreAddress.parse("10.0.0.1:29500") == StoreAddress("10.0.0.1", 29500)
    with pytest.raises(ValueError, match="is not host:port"):
        StoreAddress.parse("10.0.0.1")
    assert StoreAddress.from_env({}) is None
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    assert StoreAddress.from_env(env) == StoreAddress("h", 7, "dr-elastic")
    with pytest.raises(ValueError, match="MASTER_ADDR/MASTER_PORT"):
        StoreAddress.from_env({"TORCHELASTIC_USE_AGENT_STORE": "true"})


def test_reachable_memberships_follow_the_cores_choice_of_devices():
    """Drive the real core through random resizes between candidate splits: every training
    pool it produces is one the trainers pre-warmed a group for."""
    import random

    from dynaresized.backends.torch.membership import reachable_memberships
    from dynaresized.core.state import Phase
    from dynaresized.domain import Pool

    from ...core.cluster import boot, device, make_core

    n, start, sizes = 12, 4, (2, 4, 6, 9)  # 12 devices: string order puts gpu10 before gpu2
    devices = tuple(device(i) for i in range(n))
    pre_warmed = {frozenset(m) for m in reachable_memberships(devices, devices[:start], sizes)}
    driver = boot(make_core(), train=start, rollout=n - start)
    rng = random.Random(5)
    seen = set()
    for _ in range(30):
        k = rng.choice([s for s in sizes if s != driver.state.split.train])
        driver.force(train=k, rollout=n - k)
        driver.finish()
        assert driver.state.phase is Phase.STEADY
        training = frozenset(d for d, p in driver.state.devices.items() if p.pool is Pool.TRAINING)
        assert training in pre_warmed, sorted(training)
        seen.add(training)
    assert len(seen) > 3
