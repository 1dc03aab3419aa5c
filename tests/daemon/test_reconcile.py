"""Reconciliation over real sockets: a real daemon process and real worker clients that say
what they hold. Lost workers come back to a log that disagrees with them and are converged; a
lost answer costs a re-send, not a degraded daemon; a duplicate process is refused; every
message after hello carries its registration's token."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import zmq

from dynaresized import wire
from dynaresized.backends.sim import HOLDING_AFTER as AFTER
from dynaresized.client import DaemonRejected, OpRequest, WorkerClient
from dynaresized.core import facts as f
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, WorkerKind

from .conftest import DEVICES, read_facts, until, wait_for
from .literal_worker import LiteralWorker



class Device:
    """What one worker process really holds, and its handlers: an op changes it as a real
    backend's would. `hold_answer` makes a handler act and then never answer (the process is
    cut off before its answer leaves)."""

    def __init__(self, kind: WorkerKind, device: str, pool: Pool) -> None:
        self.kind = kind
        self.device = device
        self.holding = Holding.SERVING if pool is kind.pool else Holding.RELEASED
        self.ran: list[str] = []
        self.plans: dict[str, PlanKind] = {}  # op id -> the plan it came with
        self.hold_answer: OpKind | None = None
        self.acted = asyncio.Event()

    def actual(self) -> ActualState:
        return ActualState(holding=self.holding, last_op=self.ran[-1] if self.ran else "")

    async def handle(self, op: OpRequest) -> str:
        self.ran.append(op.op_id)
        self.plans[op.op_id] = op.plan
        if self.device in op.devices and op.kind in AFTER:
            self.holding = AFTER[op.kind]
        if op.kind is self.hold_answer:
            self.acted.set()
            await asyncio.Event().wait()  # never answers
        return f"{op.kind.value} done"

    def client(self, endpoint: str, name: str, **kw: Any) -> WorkerClient:
        c = WorkerClient(endpoint, name, self.kind, (self.device,), actual=self.actual, **kw)
        c.on_all({k: self.handle for k in OpKind})
        return c


def worker_name(kind: WorkerKind, device: str) -> str:
    return ("eng-" if kind is WorkerKind.ROLLOUT_ENGINE else "tr-") + device.replace(":", "-")


async def attach_all(daemon: Any) -> tuple[dict[str, Device], dict[str, WorkerClient]]:
    devices, clients = {}, {}
    for i, d in enumerate(DEVICES):
        pool = Pool.TRAINING if i < 2 else Pool.ROLLOUT
        for kind in WorkerKind:
            name = worker_name(kind, d)
            devices[name] = Device(kind, d, pool)
            clients[name] = devices[name].client(daemon.worker_endpoint, name)
            await clients[name].start()
    return devices, clients


def facts_of(daemon: Any, kind: type) -> list[Any]:
    return [x for x in read_facts(daemon.state_dir) if isinstance(x, kind)]


def worker(daemon: Any, name: str) -> dict[str, Any]:
    return next(w for w in daemon.status()["workers"] if w["id"] == name)


async def test_a_trainer_lost_after_release_is_reclaimed_when_it_comes_back(make_daemon) -> None:
    daemon = make_daemon()
    devices, clients = await attach_all(daemon)
    tr1 = worker_name(WorkerKind.TRAINER_RANK, DEVICES[1])
    devices[tr1].hold_answer = OpKind.RELEASE
    try:
        reply = daemon.control(wire.ResizeRequest(train=1, rollout=3))  # moves node0:cpu1 to rollout
        assert reply.ok, reply.message
        await asyncio.wait_for(devices[tr1].acted.wait(), 10)
        process, secret = clients[tr1].process, clients[tr1]._secret
        await clients[tr1].close(say_bye=False)  # released, then cut off before its answer left
        await until(lambda: facts_of(daemon, f.ResizeRolledBack), timeout=15, what="the rollback")
        assert daemon.status()["devices"][DEVICES[1]] == "training"  # the log says training...
        assert devices[tr1].holding is Holding.RELEASED  # ...but the trainer left its group
        back = devices[tr1].client(daemon.worker_endpoint, tr1)
        back.process, back._secret = process, secret  # the same process, reconnecting
        clients[tr1] = back
        welcome = await back.start()
        assert welcome.desired is Holding.SERVING and welcome.pool is Pool.TRAINING
        done = await until(lambda: facts_of(daemon, f.ReconcileFinished), timeout=15, what="the reconcile")
        assert done[0].ok and done[0].worker_id == tr1
        started = facts_of(daemon, f.ReconcileStarted)[0]
        assert [op.kind for op in started.plan.ops] == [OpKind.RECLAIM, OpKind.RESUME]
        # A worker tells a reconcile's ops from a resize's by `op.plan`.
        assert {devices[tr1].plans[op.op_id] for op in started.plan.ops} == {PlanKind.RECONCILE}
        assert {p for op_id, p in devices[tr1].plans.items() if op_id.startswith("r1/")} == {PlanKind.RESIZE}
        assert devices[tr1].holding is Holding.SERVING
        w = worker(daemon, tr1)
        assert w["actual"] == w["desired"] == "serving" and daemon.status()["phase"] == "steady"
        # and the next resize finds it a member: it drains and releases, as any member would
        devices[tr1].hold_answer = None
        assert daemon.control(wire.ResizeRequest(train=1, rollout=3)).ok
        await until(lambda: len(facts_of(daemon, f.ResizeCommitted)) == 1, timeout=15, what="the second resize")
        assert devices[tr1].holding is Holding.RELEASED
        assert not facts_of(daemon, f.Degraded)
    finally:
        for c in clients.values():
            await c.close()


async def test_one_lost_commit_answer_costs_a_re_send_not_a_degraded_daemon(make_daemon) -> None:
    daemon = make_daemon(core={"op_resend_s": 0.3})
    devices, clients = await attach_all(daemon)
    tr0 = clients[worker_name(WorkerKind.TRAINER_RANK, DEVICES[0])]
    real_send = tr0._send
    dropped: list[str] = []

    async def lossy_send(msg: Any) -> None:
        if isinstance(msg, wire.OpResult) and msg.op_id.endswith("commit") and not dropped:
            dropped.append(msg.op_id)  # this answer never reaches the daemon
            return
        await real_send(msg)

    tr0._send = lossy_send  # type: ignore[method-assign]
    try:
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1)).ok
        committed = await until(lambda: facts_of(daemon, f.ResizeCommitted), timeout=15, what="the commit")
        assert committed and dropped
        assert not facts_of(daemon, f.Degraded) and daemon.status()["phase"] == "steady"
        assert tr0.ops_run.count(dropped[0]) == 1  # the re-sent copy was answered from the record
    finally:
        for c in clients.values():
            await c.close()


async def test_a_duplicate_worker_process_is_refused_and_the_first_is_undisturbed(make_daemon) -> None:
    daemon = make_daemon()
    first = Device(WorkerKind.TRAINER_RANK, DEVICES[2], Pool.ROLLOUT).client(daemon.worker_endpoint, "w")
    await first.start()
    try:
        second = Device(WorkerKind.TRAINER_RANK, DEVICES[2], Pool.ROLLOUT).client(daemon.worker_endpoint, "w")
        with pytest.raises(DaemonRejected) as info:
            await second.start()
        assert info.value.reason == "duplicate_worker"
        assert "another process whose connection is still open" in str(info.value)
        seq = first._seq
        await until(lambda: first._seq >= seq + 3, what="heartbeats")
        assert not first.errors and first._registered.is_set()
        w = worker(daemon, "w")
        assert w["status"] == "live" and w["incarnation"] == 1
        assert "duplicate_worker" in daemon.output()
    finally:
        await first.close()


async def test_a_restarted_worker_process_registers_at_once(make_daemon) -> None:
    daemon = make_daemon()
    first = Device(WorkerKind.TRAINER_RANK, DEVICES[2], Pool.ROLLOUT).client(daemon.worker_endpoint, "w")
    await first.start()
    await first.close(say_bye=False)  # the process died: its connection is gone
    second = Device(WorkerKind.TRAINER_RANK, DEVICES[2], Pool.ROLLOUT).client(daemon.worker_endpoint, "w")
    try:
        await second.start()
        assert worker(daemon, "w")["incarnation"] == 2
        lost = facts_of(daemon, f.WorkerLost)
        assert lost and "restarted" in lost[0].reason
    finally:
        await second.close()


def test_messages_after_hello_must_carry_the_current_token(make_daemon) -> None:
    daemon = make_daemon()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"raw#1")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.worker_endpoint)
    decoder = wire.daemon_decoder()

    def ask(msg: msgspec.Struct) -> Any:
        sock.send(wire.encode(msg))
        assert sock.poll(5000), "no answer"
        return decoder.decode(sock.recv())

    def hello() -> wire.Welcome:
        w = ask(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id="raw", kind=WorkerKind.ROLLOUT_ENGINE,
                           devices=(DEVICES[3],), process="1"))
        assert isinstance(w, wire.Welcome) and len(w.token) == 32
        return w

    try:
        first = hello()
        missing = ask(wire.Heartbeat(worker_id="raw", seq=1))
        assert isinstance(missing, wire.Error) and missing.reason == "missing_token"
        assert "must carry the token its welcome gave" in missing.message
        wrong = ask(wire.Heartbeat(worker_id="raw", seq=2, token="0" * 32))
        assert isinstance(wrong, wire.Error) and wrong.reason == "stale_token" and wrong.token == "0" * 32
        ok = ask(wire.Heartbeat(worker_id="raw", seq=3, token=first.token))
        assert isinstance(ok, wire.HeartbeatAck) and ok.seq == 3
        # a beat that asks for no answer gets none: the next answer is the next asked-for one's
        sock.send(wire.encode(wire.Heartbeat(worker_id="raw", seq=4, token=first.token, ack=False)))
        asked = ask(wire.Heartbeat(worker_id="raw", seq=5, token=first.token))
        assert isinstance(asked, wire.HeartbeatAck) and asked.seq == 5
        again = hello()  # the same process again: its registration and token stand
        assert (again.token, again.incarnation) == (first.token, first.incarnation)
        stale = ask(wire.Bye(worker_id="raw", token="1" * 32))
        assert isinstance(stale, wire.Error) and stale.reason == "stale_token"
        assert worker(daemon, "raw")["status"] == "live"  # the stale bye did nothing
    finally:
        sock.close()
        ctx.term()


async def test_hellos_delivered_together_leave_the_client_on_its_one_registration(make_daemon) -> None:
    """Hellos sent while the daemon was down, or because no heartbeat answer came, arrive
    together (chaos runs: three in a millisecond). They used to register anew each, so the
    token the client took was stale by the time it used it, and it said hello again, churning
    until it was lost. Now the same process keeps its registration and its token."""
    daemon = make_daemon()
    dev = Device(WorkerKind.TRAINER_RANK, DEVICES[2], Pool.ROLLOUT)
    client = dev.client(daemon.worker_endpoint, "w")
    await client.start()
    try:
        token = client.token
        for _ in range(3):  # more hellos of this process, as if queued during an outage
            await client._send(client._hello_message())
        errors_before = len(client.errors)
        await client.report_state()  # carries the token: accepted only if it is still current
        hb = client._seq
        await until(lambda: client._seq >= hb + 3)  # a few heartbeats later
        assert [e.reason for e in client.errors[errors_before:]] == []
        assert client.token == token and client.incarnation == 1
        assert worker(daemon, "w")["incarnation"] == 1 and worker(daemon, "w")["status"] == "live"
        assert len(facts_of(daemon, f.WorkerRegistered)) == 1
    finally:
        await client.close()


# -- a loan and its return, with workers written from docs/protocol.md alone ----------------


def literal_workers(daemon: Any, after: dict[str, str] | None = None) -> dict[str, LiteralWorker]:
    """An engine and a trainer on every device, each reporting what it holds as the docs' tables
    say (`after`: otherwise), started."""
    workers = {}
    for i, d in enumerate(DEVICES):
        pool = Pool.TRAINING if i < 2 else Pool.ROLLOUT
        for kind in WorkerKind:
            name = worker_name(kind, d)
            workers[name] = LiteralWorker(daemon.worker_endpoint, name, kind.value, [d], after=after,
                                          holding="serving" if kind.pool is pool else "released")
    for w in workers.values():
        w.start()
    return workers


def lend_and_send_home(daemon: Any, workers: dict[str, LiteralWorker], to_pool: Pool) -> list[str]:
    """Lend devices to `to_pool` (an idle engine to training; trainers with nothing to train
    to the rollout), then send them home at the step boundary; the lent devices."""
    tr0, eng3 = workers[worker_name(WorkerKind.TRAINER_RANK, DEVICES[0])], workers[worker_name(
        WorkerKind.ROLLOUT_ENGINE, DEVICES[3])]
    if to_pool is Pool.TRAINING:
        for done in (1, 2):
            tr0.report("mini_batch_done", step=0, done=done, total=8)
            time.sleep(0.2)
        eng3.report("queue_empty", step=1, running=0)
    else:
        tr0.report("mini_batch_done", step=0, done=0, total=0)
    lent = wait_for(lambda: (s := daemon.status())["phase"] == "steady" and s["lent"], what="the loan landed")
    time.sleep(1.0)  # ticks, and an audit: time for a reconcile to start if the reports disagreed
    if to_pool is Pool.TRAINING:
        tr0.report("step_report", timing={"step": 0, "rollout_s": 10.0, "train_s": 10.0, "rollout_devices": 2,
                                          "train_devices": 2})
    else:
        tr0.report("mini_batch_done", step=0, done=0, total=8)
    wait_for(lambda: facts_of(daemon, f.LoanReturned), what="the loan home")
    time.sleep(1.0)
    wait_for(lambda: daemon.status()["phase"] == "steady", what="steady")
    return sorted(lent)


@pytest.mark.parametrize("to_pool", [Pool.TRAINING, Pool.ROLLOUT])
def test_workers_that_report_what_the_loan_tables_say_are_not_reconciled(make_daemon, to_pool: Pool) -> None:
    daemon = make_daemon(policy={"name": "hysteresis"}, core={"audit_interval_s": 0.5},
                         loan_costs={"to_training_s": 0.0, "return_s": 0.0, "lead_s": 0.0})
    workers = literal_workers(daemon)
    try:
        lent = lend_and_send_home(daemon, workers, to_pool)
    finally:
        for w in workers.values():
            w.close()
    assert lent == (list(DEVICES[3:]) if to_pool is Pool.TRAINING else list(DEVICES[:2]))
    facts = read_facts(daemon.state_dir)
    assert [type(x) for x in facts if isinstance(x, (f.LoanLanded, f.LoanReturned))] == [f.LoanLanded, f.LoanReturned]
    assert not [x for x in facts if isinstance(x, f.ReconcileStarted)]
    joined = {op["kind"] for w in workers.values() for op in w.ops if op["plan"] in ("loan", "return")}
    assert joined == {"drain", "release", "join"}  # no restore, no commit
    reported = [x for x in facts if isinstance(x, (f.OpAcked, f.WorkerReported)) and x.actual is not None]
    assert {x.actual.holding for x in reported} >= {Holding.DRAINED, Holding.RELEASED, Holding.SERVING}


def test_a_literal_worker_that_stays_drained_after_a_loans_join_is_reconciled_with_a_resume(make_daemon) -> None:
    daemon = make_daemon(policy={"name": "hysteresis"},
                         loan_costs={"to_training_s": 0.0, "return_s": 0.0, "lead_s": 0.0})
    workers = literal_workers(daemon, after={"join": "drained"})  # waits for a commit that never comes
    try:
        lend_and_send_home(daemon, workers, Pool.TRAINING)
    finally:
        for w in workers.values():
            w.close()
    started = [(x.worker_id, x.desired, x.actual, [op.kind for op in x.plan.ops])
               for x in read_facts(daemon.state_dir) if isinstance(x, f.ReconcileStarted)]
    # the trainer lent the engine's device after the loan, the engine back home after the return
    assert started == [(worker_name(WorkerKind.TRAINER_RANK, DEVICES[3]), Holding.SERVING, Holding.DRAINED,
                        [OpKind.RESUME]),
                       (worker_name(WorkerKind.ROLLOUT_ENGINE, DEVICES[3]), Holding.SERVING, Holding.DRAINED,
                        [OpKind.RESUME])]
