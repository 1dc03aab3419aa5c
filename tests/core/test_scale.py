"""What keeps the core linear in the cluster's size (benchmarks/scale.py found a plan, the
answers to an op and the engines' progress reports quadratic): the same answers as the
per-device scans they replace, and an op's answers stepped together as one by one."""

from __future__ import annotations

import msgspec
import pytest

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import Refused, fold
from dynaresized.core.machine import _pending, plan_resize
from dynaresized.core.state import decode_state, encode_state
from dynaresized.domain import Split, WorkerKind

from .cluster import boot, device, engine, make_core, snapshot, trainer


def _scanned(state, device_id, kind):  # what the owner index replaced: a pass over every worker
    return tuple(sorted(w.worker_id for w in state.workers.values()
                        if w.status.value == "live" and w.kind is kind and device_id in w.devices))


def test_the_live_worker_indexes_answer_what_a_scan_of_every_worker_answers() -> None:
    d = boot(make_core(), 3, 3)
    d.send(ev.WorkerBye(at=d.at(), worker_id=engine(1)))  # a device without a live engine
    d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(4)))
    d.send(ev.WorkerHello(at=d.at(), worker_id="eng1-new", kind=WorkerKind.ROLLOUT_ENGINE, devices=(device(1),)))
    d.send(ev.WorkerHello(at=d.at(), worker_id=trainer(4), kind=WorkerKind.TRAINER_RANK, devices=(device(4),),
                          process="p2"))  # the same id again, after its goodbye
    index = d.state.live_workers_by_device()
    replayed = decode_state(encode_state(d.state))  # another map: indexed afresh
    for i in range(7):  # device(6) is not in the inventory
        for kind in WorkerKind:
            expected = _scanned(d.state, device(i), kind)
            assert tuple(sorted(d.state.live_owners(device(i), kind))) == expected
            assert tuple(sorted(replayed.live_owners(device(i), kind))) == expected
            assert (index[(device(i), kind)].worker_id,) == expected if expected else (device(i), kind) not in index
    assert d.state.live_owners(device(1), WorkerKind.ROLLOUT_ENGINE) == ("eng1-new",)
    assert d.state.live_owners(device(4), WorkerKind.TRAINER_RANK) == (trainer(4),)


def test_a_hello_for_an_owned_device_is_refused_after_losses_and_new_registrations() -> None:
    """The owner index follows every change of the workers (registration, loss, goodbye,
    report), also when the states it was built for are left behind (a refused event)."""
    d = boot(make_core(), 2, 2)
    with_owner = d.state
    with pytest.raises(Refused, match=f"device_owned|{trainer(0)}") as refused:
        d.send(ev.WorkerHello(at=d.at(), worker_id="intruder", kind=WorkerKind.TRAINER_RANK, devices=(device(0),)))
    assert refused.value.code == "device_owned" and trainer(0) in refused.value.message
    d.send(ev.WorkerBye(at=d.at(), worker_id=trainer(0)))
    d.send(ev.WorkerHello(at=d.at(), worker_id="intruder", kind=WorkerKind.TRAINER_RANK, devices=(device(0),)))
    assert d.state.live_owners(device(0), WorkerKind.TRAINER_RANK) == ("intruder",)
    # the state from before the goodbye still answers for itself
    assert with_owner.live_owners(device(0), WorkerKind.TRAINER_RANK) == (trainer(0),)
    with pytest.raises(Refused) as again:
        d.send(ev.WorkerHello(at=d.at(), worker_id=trainer(0), kind=WorkerKind.TRAINER_RANK, devices=(device(0),),
                              process="p3"))
    assert again.value.code == "device_owned" and "intruder" in again.value.message


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


def _answers(d, workers):
    fl = d.state.inflight
    assert fl is not None
    return [ev.OpReported(at=d.at(), worker_id=w, op_id=fl.op.op_id, ok=True) for w in workers]


def test_one_ops_answers_stepped_together_are_those_stepped_one_by_one() -> None:
    one, many = boot(make_core(), 2, 30), boot(make_core(), 2, 30)
    for d in (one, many):
        d.force(24, 8)
    for _ in range(12):  # every op of the resize, each answered by all its targets at once
        fl = one.state.inflight
        if fl is None:
            break
        answers = _answers(one, fl.op.targets)
        facts, commands = [], []
        for a in answers:
            got, sent = one.send(a)
            facts += got
            commands += sent
        state, together, sent_together = many.core.step_answers(many.state, answers)
        many.state = state
        many.log.extend(together)
        assert together == facts and sent_together == commands
        assert snapshot(many.state) == snapshot(one.state)
    assert one.state.inflight is None and many.state.inflight is None
    assert snapshot(fold(many.log)) == snapshot(fold(one.log))


def test_answers_that_cannot_be_taken_together_are_taken_one_by_one() -> None:
    d = boot(make_core(), 2, 8)
    d.force(6, 4)
    fl = d.state.inflight
    assert fl is not None
    first, second, *rest = fl.op.targets
    d.ack(first)
    # an answer again (a duplicate: the first counted), the rest, and one that failed
    again = ev.OpReported(at=d.at(), worker_id=first, op_id=fl.op.op_id, ok=True)
    failed = ev.OpReported(at=d.at(), worker_id=second, op_id=fl.op.op_id, ok=False, detail="oom")
    batch = [again, *_answers(d, rest), failed]
    twin = boot(make_core(), 2, 8)
    twin.state, twin.log = d.state, list(d.log)
    state, facts, commands = d.core.step_answers(d.state, batch)
    for a in batch:
        twin.send(a)
    assert snapshot(state) == snapshot(twin.state)
    assert facts == twin.log[len(d.log):]
    assert any(type(x).__name__ == "OpFailed" for x in facts)  # the failure was stepped as itself


def test_the_samples_done_are_summed_as_engines_report_and_rebuilt_from_an_older_snapshot() -> None:
    d = boot(make_core(), 4, 60)
    for i in range(4, 64):  # every engine reports step 0, then half of them move on to step 1
        d.send(ev.ProgressReported(at=d.at(), worker_id=engine(i), step=0, done=i % 5, total=400))
    for i in range(4, 34):
        d.send(ev.ProgressReported(at=d.at(), worker_id=engine(i), step=1, done=1, total=512))
    latest = {**d.state.progress, **d.state.progress_recent}
    assert len(d.state.progress_recent) <= 32  # the overlay is folded into the map
    for step in (0, 1):
        mine = [p for p in latest.values() if p.step == step]
        assert d.state.samples(step) == (sum(p.done for p in mine), max(p.total for p in mine))
    assert d.state.samples(2) == (0, 0)
    # a snapshot written before the sums were kept has the reports only (and one written since
    # progress became soft state, 5 December 2026, has neither)
    older = decode_state(msgspec.msgpack.encode(msgspec.structs.replace(d.state, step_progress={})))
    assert older.step_progress == d.state.step_progress
    assert decode_state(encode_state(d.state)).step_progress == {}
    # the reports, like when each engine was last heard from, are soft state (not logged)
    assert not any(isinstance(x, f.ProgressObserved) for x in d.log)
    assert snapshot(fold(d.log).durable()) == snapshot(d.state.durable())
