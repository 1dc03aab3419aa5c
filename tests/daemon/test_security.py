"""CurveZMQ: only authorized keys get in, and a key acts only as the worker it names."""

from __future__ import annotations

import pytest

from dynaresized.client import CurveKeys, DaemonRejected, DaemonUnavailable, WorkerClient
from dynaresized.daemon.security import keygen
from dynaresized.domain import WorkerKind

from .conftest import read_facts


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
    import zmq

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
    import asyncio

    from dynaresized import wire

    from .conftest import DEVICES, until
    from .test_bad_input import metric

    if with_curve:
        daemon, server_pub, secrets = _curve_daemon(make_daemon, tmp_path, "w-a", "w-b")
        keys = {w: CurveKeys(secrets / f"{w}.key_secret", server_pub) for w in ("w-a", "w-b")}
    else:
        daemon, keys = make_daemon(), {"w-a": None, "w-b": None}
    victim = WorkerClient(daemon.worker_endpoint, "w-b", WorkerKind.TRAINER_RANK, (DEVICES[0],), curve=keys["w-b"])
    await victim.start()
    # w-a's key (or, without CURVE, any local process) connects with w-b's routing identity, sits
    # silent, then claims every device as itself.
    ctx, squatter = _squatter(daemon.worker_endpoint, b"w-b", keys["w-a"])
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
