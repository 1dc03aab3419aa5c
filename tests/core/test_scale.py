"""What keeps the core linear in the cluster's size (benchmarks/scale.py found a plan and the
answers to an op quadratic): the same answers as the per-device scans they replace."""

from __future__ import annotations

from dynaresized.core import events as ev
from dynaresized.core.machine import _pending, plan_resize
from dynaresized.domain import Split, WorkerKind

from .cluster import boot, device, engine, make_core, trainer


def test_the_live_worker_index_answers_what_live_worker_answers() -> None:
    d = boot(make_core(), 3, 3)
    d.send(ev.WorkerBye(at=d.at(), worker_id=engine(1)))  # a device without a live engine
    d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(4)))
    d.send(ev.WorkerHello(at=d.at(), worker_id="eng1-new", kind=WorkerKind.ROLLOUT_ENGINE, devices=(device(1),)))
    index = d.state.live_workers_by_device()
    for i in range(7):  # device(6) is not in the inventory
        for kind in WorkerKind:
            expected = d.state.live_worker(device(i), kind)
            assert index.get((device(i), kind)) == expected
    assert index[(device(1), WorkerKind.ROLLOUT_ENGINE)].worker_id == "eng1-new"
    assert (device(4), WorkerKind.TRAINER_RANK) not in index


def test_a_plan_over_many_devices_names_each_devices_live_workers() -> None:
    d = boot(make_core(), 40, 24)
    d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(63)))  # the highest rollout device cannot train
    plan = plan_resize(d.state, Split(train=50, rollout=14))
    assert not isinstance(plan, str)
    assert plan.devices == tuple(sorted(device(i) for i in range(53, 63)))
    drain, _, join, _, commit = plan.ops
    assert drain.targets == tuple(engine(i) for i in range(53, 63))
    assert join.targets == tuple(trainer(i) for i in range(53, 63))
    # every device's worker of its pool after the commit
    after_training = [*range(40), *range(53, 63)]
    assert set(commit.targets) == ({trainer(i) for i in after_training}
                                   | {engine(i) for i in range(64) if i not in after_training})


def test_an_op_is_pending_until_every_live_target_answered() -> None:
    d = boot(make_core(), 2, 6)
    d.force(6, 2)
    fl = d.state.inflight
    assert fl is not None
    op_id = fl.op.op_id
    targets = list(fl.op.targets)
    d.send(ev.WorkerBye(at=d.at(), worker_id=targets[-1]))  # a target gone: nobody waits for it
    for w in targets[:-1]:
        assert w in _pending(d.state) and targets[-1] not in _pending(d.state)
        d.ack(w)
    assert d.state.inflight is None or d.state.inflight.op.op_id != op_id


def test_heartbeats_of_many_workers_are_all_seen_and_a_silent_one_is_lost_on_time() -> None:
    # 2 x 300 workers: the heartbeat overlay is folded into the older map many times over
    d = boot(make_core(heartbeat_timeout_s=10.0), 150, 150)
    silent = trainer(7)
    for t in (1.0, 2.0, 3.0):
        for w in sorted(d.state.workers):
            if w != silent:
                d.send(ev.Heartbeat(at=t, worker_id=w))
        assert len(d.state.seen_recent) <= 32
    seen = d.state.last_seen
    assert seen[silent] == 0.0 and all(seen[w] == 3.0 for w in d.state.workers if w != silent)
    facts, _ = d.send(ev.Tick(at=10.5))
    assert [x.worker_id for x in facts if type(x).__name__ == "WorkerLost"] == [silent]
    assert silent not in d.state.last_seen
    assert d.state.durable().last_seen == {}
