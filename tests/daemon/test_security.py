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
