"""CurveZMQ: only authorized keys get in, and a key acts only as the worker it names."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from dynaresized import wire
from dynaresized.client import CurveKeys, DaemonRejected, DaemonUnavailable, WorkerClient
from dynaresized.daemon.security import keygen
from dynaresized.domain import WorkerKind

from .conftest import read_facts, until


@pytest.fixture
def keys(tmp_path):  # type: ignore[no-untyped-def]
    server_pub, server_secret = keygen(tmp_path / "server", "server")
    authorized = tmp_path / "authorized"
    pub, _ = keygen(tmp_path / "workers", "trainer0")
    authorized.mkdir()
    (authorized / "trainer0.key").write_bytes(pub.read_bytes())
    keygen(tmp_path / "intruders", "intruder")
    return tmp_path, server_pub, server_secret, authorized


async def test_unknown_key_is_refused_and_reaches_nothing(make_daemon, keys) -> None:
    root, server_pub, server_secret, authorized = keys
    daemon = make_daemon(security={"server_secret_key": str(server_secret), "authorized_keys_dir": str(authorized)})

    intruder = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, ("node0:cpu0",),
                            curve=CurveKeys(root / "intruders" / "intruder.key_secret", server_pub),
                            hello_timeout_s=1.5)
    with pytest.raises(DaemonUnavailable):
        await intruder.start()

    plain = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, ("node0:cpu0",),
                         hello_timeout_s=1.5)
    with pytest.raises(DaemonUnavailable):
        await plain.start()  # no CURVE at all

    impostor = WorkerClient(daemon.worker_endpoint, "trainer1", WorkerKind.TRAINER_RANK, ("node0:cpu1",),
                            curve=CurveKeys(root / "workers" / "trainer0.key_secret", server_pub))
    with pytest.raises(DaemonRejected, match="may act as worker 'trainer0', not 'trainer1'"):
        await impostor.start()

    good = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, ("node0:cpu0",),
                        curve=CurveKeys(root / "workers" / "trainer0.key_secret", server_pub))
    await good.start()
    await good.close()
    registered = [x.worker.worker_id for x in read_facts(daemon.state_dir) if type(x).__name__ == "WorkerRegistered"]
    assert registered == ["trainer0"]


def test_non_loopback_bind_with_keys_starts(make_daemon, keys) -> None:
    _, _, server_secret, authorized = keys
    daemon = make_daemon(start=False, security={"server_secret_key": str(server_secret),
                                                "authorized_keys_dir": str(authorized)})
    port = daemon.worker_endpoint.rsplit(":", 1)[1]
    daemon.sections["daemon"]["worker_endpoint"] = f"tcp://0.0.0.0:{port}"
    from .conftest import write_config

    write_config(daemon.config_path, daemon.sections)
    daemon.start()
    assert daemon.status()["phase"] == "steady"


# -- a connection is bound to one worker (#16, point 1) ----------------------------------------

def _curve_daemon(make_daemon, tmp_path, *worker_ids: str):  # type: ignore[no-untyped-def]
    """A CURVE daemon that authorizes one key per worker id; returns it, the server's public key
    file and the directory holding each worker's secret key."""
    server_pub, server_secret = keygen(tmp_path / "server", "server")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for worker_id in worker_ids:
        pub, _ = keygen(tmp_path / "workers", worker_id)
        (authorized / pub.name).write_bytes(pub.read_bytes())
    daemon = make_daemon(security={"server_secret_key": str(server_secret), "authorized_keys_dir": str(authorized)})
    return daemon, server_pub, tmp_path / "workers"


def _squatter(endpoint: str, identity: bytes, curve: CurveKeys | None):  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = curve.secret, curve.public, \
            curve.server_public
    sock.connect(endpoint)
    return ctx, sock


@pytest.mark.parametrize("with_curve", [True, False], ids=["curve", "loopback-plaintext"])
async def test_a_second_connection_with_a_workers_identity_neither_takes_its_slot_nor_goes_unseen(
        make_daemon, tmp_path, with_curve) -> None:
    from .conftest import DEVICES, until
    from .test_bad_input import metric

    if with_curve:
        daemon, server_pub, secrets = _curve_daemon(make_daemon, tmp_path, "w-a", "w-b")
        keys = {w: CurveKeys(secrets / f"{w}.key_secret", server_pub) for w in ("w-a", "w-b")}
    else:
        daemon, keys = make_daemon(), {"w-a": None, "w-b": None}
    victim = WorkerClient(daemon.worker_endpoint, "w-b", WorkerKind.TRAINER_RANK, (DEVICES[0],), curve=keys["w-b"])
    await victim.start()
    # w-a's key (or, without CURVE, any local process) connects with w-b's routing identity (the
    # very one w-b's client set, as if it had leaked), sits silent, then claims every device.
    identity = victim._sock.getsockopt(zmq.IDENTITY)
    ctx, squatter = _squatter(daemon.worker_endpoint, identity, keys["w-a"])
    try:
        await asyncio.sleep(0.5)
        squatter.send(wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id="w-a",
                                             kind=WorkerKind.TRAINER_RANK, devices=tuple(DEVICES))))
        first_ack = victim._last_ack
        # The squatter is counted and logged once it has stood a heartbeat timeout (3 s) without
        # a live worker behind it; with ROUTER_HANDOVER the victim was lost by then.
        await until(lambda: metric(daemon, "dynaresized_security_refusals_total", 'kind="idle_connection"') >= 1,
                    timeout=15, what="the squatting connection counted")
        assert "without a live worker" in daemon.output()
        await until(lambda: victim._last_ack > first_ack + 3.5, timeout=10, what="acks past the heartbeat timeout")
        assert squatter.poll(100) == 0, "the squatter got an answer"
        status = daemon.status()
        assert [(w["id"], w["status"], w["devices"]) for w in status["workers"]] == [("w-b", "live", [DEVICES[0]])]
        assert victim._registered.is_set() and victim.errors == []
    finally:
        squatter.close()
        ctx.term()
        await victim.close()


async def test_without_handover_a_worker_still_comes_back_on_a_new_connection_and_after_a_daemon_restart(
        make_daemon) -> None:
    from .conftest import DEVICES, until

    daemon = make_daemon()
    # A worker process that dies (no bye) and is started again at once, on a new connection
    # with the same identity: the daemon has dropped the old connection by then.
    for _ in range(5):
        restarted = WorkerClient(daemon.worker_endpoint, "w-b", WorkerKind.TRAINER_RANK, (DEVICES[0],),
                                 hello_timeout_s=3.0)
        await restarted.start()
        await restarted.close(say_bye=False)
    client = WorkerClient(daemon.worker_endpoint, "w-b", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    await client.start()
    first_boot = client.boot_id
    daemon.kill()
    daemon.start()  # same endpoints: the client's socket reconnects and it registers again
    await until(lambda: client.boot_id not in ("", first_boot) and client._registered.is_set(), timeout=20,
                what="re-registration with the restarted daemon")
    assert [(w["id"], w["status"]) for w in daemon.status()["workers"]] == [("w-b", "live")]
    await client.close()


# -- files born private (#16, point 3) ---------------------------------------------------------

def test_keygen_creates_the_secret_key_0600_before_its_first_byte(tmp_path, monkeypatch) -> None:
    """Every write to the secret key file finds it 0600 already, and nothing widens or narrows
    it later (a chmod after writing means it was readable in between), even under umask 0."""
    import os
    import sys

    secret_path = str(tmp_path / "w-a.key_secret")
    seen: list[tuple[str, int]] = []
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if os.path.realpath(f"/proc/self/fd/{fd}") == secret_path:
            seen.append(("write", os.fstat(fd).st_mode & 0o777))
        return real_write(fd, data)

    def audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
        if event == "os.chmod" and str(args[0]) == secret_path and os.path.exists(secret_path):
            seen.append(("chmod", os.stat(secret_path).st_mode & 0o777))
        if event == "open" and str(args[0]) == secret_path and os.path.exists(secret_path):
            seen.append(("reopen", os.stat(secret_path).st_mode & 0o777))

    monkeypatch.setattr(os, "write", write)
    sys.addaudithook(audit)  # hooks cannot be removed; this one only records for this test's path
    old = os.umask(0)
    try:
        keygen(tmp_path, "w-a")
    finally:
        os.umask(old)
        secret_path = "/done"  # the hook and the wrapper go quiet
    assert seen and seen[0][0] == "write", seen
    assert all(mode == 0o600 for _, mode in seen), seen
    assert (tmp_path / "w-a.key_secret").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "w-a.key").stat().st_mode & 0o777 == 0o644  # the public half is for copying around
    CurveKeys(tmp_path / "w-a.key_secret", tmp_path / "w-a.key")  # and the pair loads
    with pytest.raises(FileExistsError):
        keygen(tmp_path, "w-a")  # never overwrites a key in use


def test_state_dir_is_0750_and_its_files_private_whoever_starts_the_daemon(make_daemon) -> None:
    import os

    old = os.umask(0)  # the widest umask a user could start the daemon with
    try:
        daemon = make_daemon(start=False)
        del daemon.sections["daemon"]["control_endpoint"]  # the default: ipc://<state_dir>/control.sock
        from .conftest import write_config

        write_config(daemon.config_path, daemon.sections)
        daemon.start()
    finally:
        os.umask(old)
    state = daemon.state_dir
    modes = {p.name: p.stat().st_mode & 0o777 for p in [state, *state.iterdir()]}
    assert modes == {"state": 0o750, "events.sqlite": 0o640, "events.sqlite-wal": 0o640,
                     "events.sqlite-shm": 0o640, "events.sqlite.lock": 0o640, "control.secret": 0o600,
                     "control.sock": 0o600}, {k: oct(v) for k, v in modes.items()}
    assert daemon.status()["phase"] == "steady"  # the CLI's default finds the ipc socket


# -- visible refusals (#16, points 4 and 5) ----------------------------------------------------

async def test_every_refused_handshake_is_counted_and_logged(make_daemon, tmp_path) -> None:
    from .conftest import until
    from .test_bad_input import metric

    daemon, server_pub, secrets = _curve_daemon(make_daemon, tmp_path, "w-a")
    keygen(tmp_path / "intruders", "intruder")
    wrong_server_pub, _ = keygen(tmp_path / "other-server", "server")

    def refusals(kind: str) -> float:
        return metric(daemon, "dynaresized_security_refusals_total", f'kind="{kind}"')

    attempts = [
        ("unknown_key", CurveKeys(tmp_path / "intruders" / "intruder.key_secret", server_pub)),
        ("handshake_failed", None),  # plaintext against a CURVE endpoint
        ("handshake_failed", CurveKeys(secrets / "w-a.key_secret", wrong_server_pub)),
    ]
    for kind, curve in attempts:
        before = refusals(kind)
        ctx, sock = _squatter(daemon.worker_endpoint, b"w-a", curve)
        try:
            await until(lambda: refusals(kind) > before, timeout=10, what=f"{kind} counted")  # noqa: B023
        finally:
            sock.close()
            ctx.term()
    text = daemon.output()
    assert "refused a CURVE handshake: key not in authorized_keys_dir" in text
    assert "refused a handshake on the worker endpoint" in text
    assert daemon.status()["workers"] == []


def test_a_flood_of_refusals_is_all_counted_but_logged_once_per_window() -> None:
    from prometheus_client import CollectorRegistry, Counter
    from structlog.testing import capture_logs

    from dynaresized.daemon.security import Refusals

    now = [100.0]
    counter = Counter("refusals_total", "test", ["kind"], registry=CollectorRegistry())
    refusals = Refusals(counter, clock=lambda: now[0])
    with capture_logs() as logs:
        for _ in range(1000):
            refusals.record("unknown_key", "refused", key="k")
        now[0] += 10.0
        refusals.record("unknown_key", "refused", key="k")
        refusals.record("control_secret", "refused", request="pause")
    assert counter.labels("unknown_key")._value.get() == 1001
    assert [(e["refusal"], e.get("not_logged_since_last")) for e in logs] == [
        ("unknown_key", None), ("unknown_key", 999), ("control_secret", None)]


async def test_a_worker_whose_new_connection_is_not_routed_reconnects_until_it_is(make_daemon) -> None:
    """The worker's connection dropped (only its side saw it, as when a host link flaps) and,
    meanwhile, another connection took its identity's free slot: the daemon parks the worker's
    new connection, so the client must open another one until the slot is free again."""

    from .conftest import DEVICES, until
    from .test_bad_input import metric

    daemon = make_daemon()
    client = WorkerClient(daemon.worker_endpoint, "w-b", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    await client.start()
    client._sock.disconnect(daemon.worker_endpoint)  # the drop
    await until(lambda: metric(daemon, "dynaresized_worker_connections") == 0, what="the drop seen")
    ctx, holder = _squatter(daemon.worker_endpoint, client._sock.getsockopt(zmq.IDENTITY), None)
    try:
        await until(lambda: metric(daemon, "dynaresized_worker_connections") == 1, what="the slot taken")
        client._sock.connect(daemon.worker_endpoint)  # parked: the slot is held
        await until(lambda: [w["status"] for w in daemon.status()["workers"]] == ["lost"], timeout=15,
                    what="the worker declared lost")
        await asyncio.sleep(1.0)
    finally:
        holder.close()
        ctx.term()
    await until(lambda: [w["status"] for w in daemon.status()["workers"]] == ["live"] and client._registered.is_set(),
                timeout=20, what="the worker registered again on a new connection")
    await client.close()


async def test_a_client_told_its_connection_lost_its_identity_reconnects_and_says_hello_again() -> None:
    """`unauthorized` with reason `wrong_identity` is not the client's doing (it always names its
    connection): it opens a new connection and registers again instead of giving up."""
    ctx = zmq.asyncio.Context()
    daemon = ctx.socket(zmq.ROUTER)  # a stand-in for the daemon: the test says what it answers
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind("tcp://127.0.0.1:0")
    endpoint = daemon.getsockopt_string(zmq.LAST_ENDPOINT)
    decoder = wire.worker_decoder()
    client = WorkerClient(endpoint, "tr-0", WorkerKind.TRAINER_RANK, ("node0:cpu0",), hello_timeout_s=5.0)

    async def next_hello() -> tuple[bytes, wire.Hello]:
        while True:  # heartbeats may come first
            identity, data = await asyncio.wait_for(daemon.recv_multipart(), 10)
            msg = decoder.decode(data)
            if isinstance(msg, wire.Hello):
                return identity, msg

    async def welcome(identity: bytes, token: str) -> None:
        await daemon.send_multipart([identity, wire.encode(wire.Welcome(
            protocol=wire.PROTOCOL_VERSION, worker_id="tr-0", incarnation=1, boot_id="b1",
            heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, token=token))])

    try:
        starting = asyncio.create_task(client.start())
        identity, hello = await next_hello()
        await welcome(identity, "t1")
        await asyncio.wait_for(starting, 10)
        assert identity == f"tr-0#{client.process}".encode() and client.token == "t1"
        await daemon.send_multipart([identity, wire.encode(wire.Error(
            code=wire.ErrorCode.UNAUTHORIZED, reason="wrong_identity", ref_type="heartbeat", token="t1",
            message="messages for worker 'tr-0' must come from a connection whose ZeroMQ identity is 'tr-0'"))])
        identity, again = await next_hello()
        assert again.process == hello.process, "the same process, registering again"
        await welcome(identity, "t2")
        await until(lambda: client.token == "t2", what="the new registration")
        await client.report_state()  # not refused by the client itself: it did not give up
        assert client._fatal is None
    finally:
        await client.close(say_bye=False)
        daemon.close(0)
        ctx.term()


async def test_a_refused_curve_handshake_says_why_in_the_hello_timeout(make_daemon, keys) -> None:
    root, server_pub, server_secret, authorized = keys
    daemon = make_daemon(security={"server_secret_key": str(server_secret), "authorized_keys_dir": str(authorized)})
    wrong_server_pub, _ = keygen(root / "other-server", "server")
    cases = [
        (CurveKeys(root / "intruders" / "intruder.key_secret", server_pub), "refused this worker's CURVE key"),
        (CurveKeys(root / "workers" / "trainer0.key_secret", wrong_server_pub), "the CURVE handshake failed"),
    ]
    for curve, why in cases:
        client = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, ("node0:cpu0",),
                              curve=curve, hello_timeout_s=1.5)
        with pytest.raises(DaemonUnavailable, match=why):
            await asyncio.wait_for(client.start(), 30)  # start() ends by its own hello timeout, never hangs
    good = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, ("node0:cpu0",),
                        curve=CurveKeys(root / "workers" / "trainer0.key_secret", server_pub))
    await asyncio.wait_for(good.start(), 30)
    assert good.registered and good.handshake_failure == ""
    await asyncio.wait_for(good.close(), 30)
    assert not good.registered


def test_a_worker_whose_key_file_is_missing_is_told_which_and_how_to_make_one(tmp_path) -> None:
    keygen(tmp_path, "w-a")
    with pytest.raises(ValueError, match=r"secret key file .*nope\.key_secret does not exist .*dynaresized keygen"):
        CurveKeys(tmp_path / "nope.key_secret", tmp_path / "w-a.key")
    with pytest.raises(ValueError, match=r"daemon's public key file .* is a directory"):
        CurveKeys(tmp_path / "w-a.key_secret", tmp_path)


async def test_a_daemon_that_answers_late_is_not_asked_with_every_beat() -> None:
    """A heartbeat asks for an answer once the last answer, and the last ask, are a quarter of
    the timeout old: a daemon that falls behind is not asked ten times as often (at 4,096 devices
    the asks multiplied as it slowed: docs/benchmarks.md, "Scale")."""
    ctx = zmq.asyncio.Context()
    daemon = ctx.socket(zmq.ROUTER)  # a stand-in that welcomes and then never answers a beat
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind("tcp://127.0.0.1:0")
    decoder = wire.worker_decoder()
    client = WorkerClient(daemon.getsockopt_string(zmq.LAST_ENDPOINT), "tr-0", WorkerKind.TRAINER_RANK,
                          ("node0:cpu0",), hello_timeout_s=5.0)
    try:
        starting = asyncio.create_task(client.start())
        while True:
            identity, data = await asyncio.wait_for(daemon.recv_multipart(), 10)
            if isinstance(decoder.decode(data), wire.Hello):
                break
        await daemon.send_multipart([identity, wire.encode(wire.Welcome(
            protocol=wire.PROTOCOL_VERSION, worker_id="tr-0", incarnation=1, boot_id="b1",
            heartbeat_interval_s=0.1, heartbeat_timeout_s=4.0, token="t1"))])
        await asyncio.wait_for(starting, 10)
        beats: list[wire.Heartbeat] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + 3.0  # under the 4 s timeout: the client stays registered
        while (left := end - loop.time()) > 0:
            try:
                _, data = await asyncio.wait_for(daemon.recv_multipart(), left)
            except TimeoutError:
                break
            if isinstance(msg := decoder.decode(data), wire.Heartbeat):
                beats.append(msg)
        asks = sum(b.ack for b in beats)
        assert len(beats) >= 20, "a silent worker beats every interval"
        assert 2 <= asks <= 3, f"{asks} of {len(beats)} beats asked for an answer: one a second (4 s / 4) is the rule"
        assert client.registered
    finally:
        await client.close(say_bye=False)
        daemon.close(0)
        ctx.term()
