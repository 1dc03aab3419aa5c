"""Who may speak for a worker (issue #26, item 1): the registration's token and the right to
repeat or renew a live registration go only to what its process can prove and a reader of the
event log cannot: the secret it chose (the log keeps only its SHA-256), or its open connection.
And one rule for re-sent answers (item 2): a repeat is answered from the record with the
current token, which a worker written from the docs alone does across a daemon restart."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from dynaresized import wire
from dynaresized.client import WorkerClient
from dynaresized.core import facts as f
from dynaresized.domain import WorkerKind

from .conftest import DEVICES, read_facts, until
from .literal_worker import LiteralWorker
from .test_bad_input import RawPeer, metric


class Peer(RawPeer):
    """A bare DEALER under a chosen identity: what another local user can open."""

    def ask(self, msg: dict[str, Any], timeout_s: float = 3.0) -> Any:
        """Send one message; the first answer that is not a heartbeat ack, or None."""
        self.sock.send(msgspec.msgpack.encode(msg))
        deadline = timeout_s * 1000
        while self.sock.poll(int(deadline)):
            answer = self.decoder.decode(self.sock.recv())
            if not isinstance(answer, wire.HeartbeatAck):
                return answer
        return None


S1 = "5e" * 16  # a process's secret: 32 hex characters


def hello(worker_id: str, process: str, devices: list[str], secret: str = "") -> dict[str, Any]:
    return {"type": "hello", "protocol": wire.PROTOCOL_VERSION, "worker_id": worker_id, "kind": "trainer-rank",
            "devices": devices, "process": process, "secret": secret}


def registered(daemon: Any, worker_id: str) -> list[Any]:
    return [x.worker for x in read_facts(daemon.state_dir)
            if isinstance(x, f.WorkerRegistered) and x.worker.worker_id == worker_id]


async def test_a_reader_of_the_log_cannot_take_a_live_workers_registration(make_daemon) -> None:
    """The attack of issue #26: a hello that names a live worker's `process` (it is in the log)
    from a new connection got that registration's welcome and token, and then spoke for it."""
    daemon = make_daemon()
    victim = WorkerClient(daemon.worker_endpoint, "tr-0", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    await victim.start()
    process = registered(daemon, "tr-0")[0].process  # what a member of control_group reads
    assert process == victim.process
    peers: list[Peer] = []
    try:
        # 1. From a connection of its own: its identity does not name that process.
        mallory = Peer(daemon.worker_endpoint, b"tr-0#mallory")
        peers.append(mallory)
        answer = mallory.ask(hello("tr-0", process, [DEVICES[0]]))
        assert isinstance(answer, wire.Error), f"the impostor got {answer!r}"
        assert answer.code is wire.ErrorCode.UNAUTHORIZED and answer.reason == "wrong_identity"
        # 2. Under the victim's own identity while it is connected: not routed, no answer.
        squatter = Peer(daemon.worker_endpoint, f"tr-0#{process}".encode())
        peers.append(squatter)
        assert squatter.ask(hello("tr-0", process, [DEVICES[0]]), timeout_s=1.0) is None
        squatter.close()
        peers.remove(squatter)
        # 3. The victim's connection drops for a moment and the impostor takes its identity: it
        #    names the process but cannot name its secret.
        victim._sock.disconnect(daemon.worker_endpoint)
        await until(lambda: metric(daemon, "dynaresized_worker_connections") == 1, what="the victim's drop seen")
        squatter = Peer(daemon.worker_endpoint, f"tr-0#{process}".encode())
        peers.append(squatter)
        for secret in ("", "0123456789abcdef" * 2):  # none, or a well-formed guess
            answer = squatter.ask(hello("tr-0", process, [DEVICES[0]], secret))
            assert isinstance(answer, wire.Error) and answer.reason == "not_the_process", answer
            state = squatter.ask({"type": "state_report", "worker_id": "tr-0", "token": "",
                                  "actual": {"holding": "failed"}})
            assert isinstance(state, wire.Error) and state.reason == "missing_token"
    finally:
        for peer in peers:
            peer.close()
    victim._sock.connect(daemon.worker_endpoint)
    await until(lambda: victim._last_ack and victim._registered.is_set(), what="the victim on")
    w = daemon.status()["workers"][0]
    assert (w["id"], w["status"], w["incarnation"], w["actual"]) == ("tr-0", "live", 1, None)
    assert len(registered(daemon, "tr-0")) == 1 and not [x for x in read_facts(daemon.state_dir)
                                                        if isinstance(x, f.WorkerLost | f.WorkerLeft)]
    log = b"".join(p.read_bytes() for p in daemon.state_dir.glob("events.sqlite*"))
    assert victim._secret.encode() not in log and victim.process.encode() in log  # the log has the digest only
    await victim.close()


async def test_after_a_daemon_restart_only_the_registered_process_gets_its_worker_back(make_daemon) -> None:
    """A restarted daemon knows no token: the log's live worker is renewed only by its own
    process (its secret), and a new process is refused while the old one's connection, which
    its identity names, is open again, even before it has said hello to the new daemon."""
    daemon = make_daemon()
    victim = LiteralWorker(daemon.worker_endpoint, "tr-0", "trainer-rank", [DEVICES[0]])
    victim.start()
    peers: list[Peer] = []
    try:
        victim.pause()
        daemon.kill()
        daemon.start()
        await asyncio.sleep(1.0)  # its DEALER reconnects by itself every 100 ms (the connection gauge can
        # miss a connection made before the daemon's monitor starts)
        for identity, msg in ((b"tr-0#p2", hello("tr-0", "p2", [DEVICES[0]])),
                              (b"tr-0", hello("tr-0", "", [DEVICES[0]]))):
            peer = Peer(daemon.worker_endpoint, identity)
            peers.append(peer)
            answer = peer.ask(msg)
            assert isinstance(answer, wire.Error) and answer.reason == "duplicate_worker", answer
        victim.resume()
        await until(lambda: victim.incarnation == 2, what="the victim's renewal")
        w = daemon.status()["workers"][0]
        assert (w["status"], w["incarnation"]) == ("live", 2)
        assert [x.process for x in registered(daemon, "tr-0")] == [victim.process] * 2
    finally:
        for peer in peers:
            peer.close()
        victim.close()


def test_a_hello_from_a_new_process_on_a_registered_connection_is_refused(make_daemon) -> None:
    """A connection registers one process: a hello naming another one on it is refused
    (`wrong_identity`), not made a new registration (an outside worker registered 123 times so)."""
    daemon = make_daemon()
    peer = Peer(daemon.worker_endpoint, b"tr-0#p1")
    try:
        welcome = peer.ask(hello("tr-0", "p1", [DEVICES[0]], S1))
        assert isinstance(welcome, wire.Welcome) and welcome.incarnation == 1
        for n in range(3):
            answer = peer.ask(hello("tr-0", f"p{n + 2}", [DEVICES[0]], S1))
            assert isinstance(answer, wire.Error) and answer.reason == "wrong_identity", answer
        again = peer.ask(hello("tr-0", "p1", [DEVICES[0]], S1))  # its own process: the same registration
        assert isinstance(again, wire.Welcome) and (again.incarnation, again.token) == (1, welcome.token)
        assert len(registered(daemon, "tr-0")) == 1
    finally:
        peer.close()


def literal_pair(daemon: Any) -> tuple[LiteralWorker, LiteralWorker]:
    """An engine and a trainer on one device, written from the docs; the engine withholds its drain answer."""
    engine = LiteralWorker(daemon.worker_endpoint, "eng-3", "rollout-engine", [DEVICES[3]])
    trainer = LiteralWorker(daemon.worker_endpoint, "tr-3", "trainer-rank", [DEVICES[3]])
    engine.withhold = {"drain"}
    return engine, trainer


def start_a_resize_whose_drain_answer_is_lost(daemon: Any, engine: LiteralWorker, trainer: LiteralWorker) -> None:
    engine.start()
    trainer.start()
    assert daemon.control(wire.ResizeRequest(train=3, rollout=1, reason="test")).ok


async def test_a_worker_written_from_the_docs_answers_a_re_sent_op_across_a_daemon_restart(make_daemon) -> None:
    """The engine runs `drain`, its answer is lost, the daemon restarts. Both workers say hello
    again, the daemon re-sends the pending `drain`, and the engine answers from its record with
    the current token (the old one is refused `stale_token` after a restart): the resize
    commits instead of timing out and rolling back."""
    daemon = make_daemon()
    engine, trainer = literal_pair(daemon)
    try:
        start_a_resize_whose_drain_answer_is_lost(daemon, engine, trainer)
        await until(lambda: [op["kind"] for op in engine.ops] == ["drain"], what="the drain")
        first_token = engine.token
        daemon.kill()
        daemon.start()
        status = await until(lambda: (s := daemon.status())["resizes"]["committed"] == 1 and s, timeout=30,
                             what="the resize committed")
        assert status["split"] == {"train": 3, "rollout": 1}
        assert status["resizes"] == {"started": 1, "committed": 1, "rolled_back": 0, "degraded": 0, "in_flight": 0}
        drains = [op for op in engine.ops if op["kind"] == "drain"]
        assert len(drains) >= 2 and len({op["op_id"] for op in drains}) == 1  # re-sent, answered from the record
        assert engine.token != first_token and engine.incarnation == 2
        # Late answers to an op answered twice are refused `stale_op` (harmless); none was refused otherwise.
        assert not [e for e in engine.errors + trainer.errors
                    if e.get("ref_type") == "op_result" and e.get("reason") not in ("stale_op", "illegal_transition")]
        assert not [x for x in read_facts(daemon.state_dir) if isinstance(x, f.OpFailed | f.ResizeRolledBack)]
    finally:
        engine.close()
        trainer.close()


def test_a_re_sent_answer_under_the_old_token_is_refused_after_a_restart(make_daemon) -> None:
    """The other half of the rule: the recorded answer sent unchanged (the token of the
    registration before the restart) is refused `stale_token`, that token in `error.token`."""
    daemon = make_daemon()
    engine, trainer = literal_pair(daemon)
    try:
        start_a_resize_whose_drain_answer_is_lost(daemon, engine, trainer)
        asyncio.run(until(lambda: engine.records, what="the drain"))
        engine.pause()  # from here the test reads the engine's socket itself
        old = next(iter(engine.records.values()))
        daemon.kill()
        daemon.start()
        engine._send(old)
        with engine._lock:
            assert engine.sock.poll(5000), "no answer"
            answer = wire.daemon_decoder().decode(engine.sock.recv())
        assert isinstance(answer, wire.Error) and answer.reason == "stale_token", answer
        assert answer.token == old["token"] and answer.ref_type == "op_result"
    finally:
        engine.close()
        trainer.close()
