"""Bad input over the real socket: each gets a clear error reply, a metric and a log line; the
daemon stays up and its state is unchanged."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import msgspec
import pytest
import zmq

from dynaresized import wire
from dynaresized.client import WorkerClient
from dynaresized.domain import WorkerKind

from .conftest import read_facts, until, wait_for


class RawPeer:
    """A bare DEALER that sends whatever bytes a test wants."""

    def __init__(self, endpoint: str, identity: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.decoder = wire.daemon_decoder()

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout_s: float = 5.0) -> object:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the daemon"
        return self.decoder.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def metric(daemon, name: str, label: str = "") -> float:  # type: ignore[no-untyped-def]
    text = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def hello(worker_id: str, devices: tuple[str, ...], kind: str = "trainer-rank",
          protocol: int = wire.PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode({"type": "hello", "protocol": protocol, "worker_id": worker_id, "kind": kind,
                                   "devices": list(devices)})


CASES = [
    ("not msgpack", b"\xc1\xc1garbage", wire.ErrorCode.MALFORMED, "not a msgpack message"),
    ("empty frame", b"", wire.ErrorCode.MALFORMED, "truncated"),
    ("unknown type", msgspec.msgpack.encode({"type": "launch_missiles", "worker_id": "x"}),
     wire.ErrorCode.UNKNOWN_TYPE, "launch_missiles"),
    ("wrong field type", msgspec.msgpack.encode({"type": "heartbeat", "worker_id": 42}),
     wire.ErrorCode.INVALID, "worker_id"),
    ("missing field", msgspec.msgpack.encode({"type": "op_result", "worker_id": "mallory"}),
     wire.ErrorCode.INVALID, "missing required field"),
    ("oversize", msgspec.msgpack.encode({"type": "bye", "worker_id": "mallory", "reason": "x" * 70_000}),
     None, None),  # cut off by ZMQ_MAXMSGSIZE: the connection is dropped, no reply possible
    ("wrong version", hello("mallory", ("node0:cpu1",), protocol=7), wire.ErrorCode.BAD_VERSION, "protocol 7"),
    ("heartbeat from unregistered worker", msgspec.msgpack.encode({"type": "heartbeat", "worker_id": "mallory"}),
     wire.ErrorCode.REFUSED, "not registered"),
    ("unknown device", hello("mallory", ("node7:gpu9",)), wire.ErrorCode.REFUSED, "node7:gpu9"),
    ("device owned by another worker", hello("mallory", ("node0:cpu0",)), wire.ErrorCode.REFUSED,
     "already has live trainer-rank worker 'owner'"),
    ("claims another identity", hello("owner", ("node0:cpu0",)), wire.ErrorCode.UNAUTHORIZED, "identity"),
    ("op result with no resize in flight",
     msgspec.msgpack.encode({"type": "op_result", "worker_id": "owner", "op_id": "r9/0-drain", "ok": True}),
     wire.ErrorCode.UNAUTHORIZED, "identity"),
]


def gone(daemon) -> None:  # type: ignore[no-untyped-def]
    """Wait until the daemon has dropped the last peer's connection: the next peer reuses its
    identity, and a connection for an identity still connected is not routed (no handover)."""
    wait_for(lambda: metric(daemon, "dynaresized_worker_connections") <= 1, what="the peer's connection dropped")


def send_bad_frames(daemon) -> int:  # type: ignore[no-untyped-def]
    """Each bad frame from a fresh raw peer; the error replies checked; how many came back."""
    replied = 0
    for name, frame, code, text in CASES:
        peer = RawPeer(daemon.worker_endpoint, b"mallory")
        try:
            peer.send(frame)
            if code is None:
                time.sleep(0.2)
                continue
            reply = peer.reply()
            replied += 1
            assert isinstance(reply, wire.Error), name
            assert reply.code is code, f"{name}: {reply}"
            assert text in reply.message, f"{name}: {reply.message!r}"
        finally:
            peer.close()
            gone(daemon)
    for frames in ([b"\x80", b"\x80"], [b"a", b"b", b"c"]):  # one message, several payload frames
        peer = RawPeer(daemon.worker_endpoint, b"mallory")
        try:
            peer.send(*frames)
            reply = peer.reply()
            replied += 1
            assert isinstance(reply, wire.Error) and reply.code is wire.ErrorCode.MALFORMED, reply
            assert f"expected exactly one payload frame, got {len(frames)}" in reply.message, reply.message
        finally:
            peer.close()
            gone(daemon)
    return replied


async def test_bad_input_is_refused_clearly_and_changes_nothing(make_daemon) -> None:
    daemon = make_daemon()
    owner = WorkerClient(daemon.worker_endpoint, "owner", WorkerKind.TRAINER_RANK, ("node0:cpu0",))
    await owner.start()
    try:
        before = daemon.status()
        facts_before = len(read_facts(daemon.state_dir))
        errors_before = metric(daemon, "dynaresized_decode_errors_total") + metric(daemon, "dynaresized_refusals_total")
        # In a thread: the owner's heartbeats go on meanwhile (a blocked event loop would get
        # it declared lost on a slow machine, and that would change the state under test).
        replied = await asyncio.to_thread(send_bad_frames, daemon)
        # A stale op result from the registered owner is refused by the core, not by auth.
        await owner._send(wire.OpResult(worker_id="owner", op_id="r9/0-drain", ok=True, token=owner.token))
        refused = await until(lambda: [e for e in owner.errors if e.reason == "illegal_transition"],
                              what="refusal of a stale op result")
        assert "not accepted in phase 'steady'" in refused[0].message
        after = daemon.status()
        assert after["workers"] == before["workers"] and after["devices"] == before["devices"]
        assert after["phase"] == "steady"
        assert len(read_facts(daemon.state_dir)) == facts_before, "bad input recorded nothing"
        errors_after = metric(daemon, "dynaresized_decode_errors_total") + metric(daemon, "dynaresized_refusals_total")
        assert errors_after - errors_before >= replied
        assert "refused" in daemon.output()  # and a log line per refusal
    finally:
        await owner.close()
    assert daemon.proc.poll() is None, "the daemon survived"


async def test_flood_of_garbage_does_not_stop_the_daemon(make_daemon) -> None:
    daemon = make_daemon()
    peer = RawPeer(daemon.worker_endpoint, b"flood")
    try:
        for i in range(5000):
            peer.send(b"\xff" * (i % 50 + 1))
        # The daemon answers every frame with an error; draining them shows it kept up.
        deadline = time.monotonic() + 30
        got = 0
        while got < 5000 and time.monotonic() < deadline:
            if peer.sock.poll(1000):
                peer.sock.recv()
                got += 1
        assert got == 5000
    finally:
        peer.close()
    c = WorkerClient(daemon.worker_endpoint, "after-flood", WorkerKind.ROLLOUT_ENGINE, ("node0:cpu2",))
    await c.start()
    await c.close()
    assert daemon.proc.poll() is None
    assert metric(daemon, "dynaresized_decode_errors_total") >= 5000  # counted, by kind


@pytest.mark.parametrize("problem,expected", [
    ({"guards": {"cooldown_steps": -1}}, "guards.cooldown_steps: must be >= 0"),
    ({"guards": {"min_rollout": 3, "min_train": 3}}, "exceeds the 4 devices"),
    ({"daemon": {"bogus_key": 1}}, "unknown field `bogus_key`"),
    ({"core": {"op_timeout_s": "soon"}}, "Expected `float`, got `str` - at `core.op_timeout_s`"),
    ({"policy": {"name": "no-such-policy"}}, "unknown policy 'no-such-policy'"),
    ({"daemon": {"worker_endpoint": "tcp://0.0.0.0:5599"}}, "without CurveZMQ"),
])
def test_bad_config_is_refused_at_start_naming_key_and_file(make_daemon, problem, expected) -> None:
    daemon = make_daemon(start=False, **problem)
    daemon.start(wait=False)
    code = daemon.proc.wait(timeout=30)
    out = daemon.output()
    assert code == 6, out
    assert expected in out
    if "unknown policy" not in expected and "CurveZMQ" not in expected:
        assert str(daemon.config_path) in out


def test_refused_control_requests_say_why_and_a_request_is_always_two_frames(make_daemon) -> None:
    """A refused control request names its reason (`missing_secret`, `wrong_secret`), and a
    request of one frame (no secret frame, even for status) is refused `malformed`: the docs
    say two frames, the secret (empty for status) and the request, and the daemon agrees."""
    daemon = make_daemon()
    peer = RawPeer(daemon.control_endpoint, b"operator")
    peer.decoder = wire.reply_decoder()
    try:
        for secret, reason in ((b"", "missing_secret"), (b"0" * 64, "wrong_secret")):
            peer.send(secret, wire.encode(wire.PauseRequest(reason="test")))
            reply = peer.reply()
            assert isinstance(reply, wire.Error) and reply.code is wire.ErrorCode.UNAUTHORIZED, reply
            assert (reply.reason, reply.ref_type) == (reason, "pause") and "control secret" in reply.message
        for frames in ([wire.encode(wire.StatusRequest())], [b"", b"", wire.encode(wire.StatusRequest())]):
            peer.send(*frames)
            reply = peer.reply()
            assert isinstance(reply, wire.Error) and reply.code is wire.ErrorCode.MALFORMED, reply
            assert reply.reason == "frames" and "two frames" in reply.message
        peer.send(b"", wire.encode(wire.StatusRequest()))
        reply = peer.reply()
        assert isinstance(reply, wire.ControlReply) and reply.ok and not daemon.status()["paused"]
    finally:
        peer.close()
