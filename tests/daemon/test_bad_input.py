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


async def test_flood_of_garbage_is_answered_up_to_the_budget_then_cut(make_daemon) -> None:
    """One connection's junk: the first `daemon.junk_budget` frames are each refused and counted,
    the next one cuts the connection (counted, logged once), and what it had queued is dropped
    unread. The daemon stays up and registers the next worker."""
    daemon = make_daemon(daemon={"junk_budget": 50})
    peer = RawPeer(daemon.worker_endpoint, b"flood")
    try:
        for i in range(5000):
            peer.send(b"\xff" * (i % 50 + 1))
        await until(lambda: metric(daemon, "dynaresized_connections_cut_total", 'reason="invalid"') >= 1,
                    what="the flooding connection cut")
        got = 0
        while peer.sock.poll(500):
            reply = peer.decoder.decode(peer.sock.recv())
            assert isinstance(reply, wire.Error) and reply.code is wire.ErrorCode.INVALID, reply
            got += 1
        assert got <= 50, "nothing is answered past the budget"
    finally:
        peer.close()
    refused = metric(daemon, "dynaresized_decode_errors_total")
    assert 51 <= refused < 5000, "counted up to the cut; the rest dropped unread"
    assert daemon.output().count("cut a connection to the worker endpoint that sent junk") == 1
    assert daemon.output().count('"refused frame"') <= 2, "a line per kind every 10 s, not one per frame"
    c = WorkerClient(daemon.worker_endpoint, "after-flood", WorkerKind.ROLLOUT_ENGINE, ("node0:cpu2",))
    await c.start()
    await c.close()
    assert daemon.proc.poll() is None


async def test_registered_workers_are_answered_while_a_connection_floods(make_daemon) -> None:
    """A raw connection sends junk as fast as it can and never reads (it is cut and connects
    again, as a DEALER does): a registered worker's heartbeats are still answered, so it is
    neither lost nor registered again, and the daemon's memory stays bounded."""
    import os
    import threading

    daemon = make_daemon(core={"heartbeat_timeout_s": 3.0})
    worker = WorkerClient(daemon.worker_endpoint, "steady", WorkerKind.TRAINER_RANK, ("node0:cpu1",))
    await worker.start()
    incarnation = worker.incarnation
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.connect(daemon.worker_endpoint)
        while not stop.is_set():
            try:
                sock.send(b"\xc1junk", zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                sock.poll(5, zmq.POLLOUT)
        sock.close(0)
        ctx.term()

    def rss_mib() -> float:
        line = next(x for x in open(f"/proc/{daemon.proc.pid}/status") if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    rss_before = rss_mib()
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        silence, last = 0.0, worker._last_ack
        end = time.monotonic() + 4.0  # beyond the 3 s heartbeat timeout
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            last = worker._last_ack
            silence = max(silence, time.monotonic() - last)
    finally:
        stop.set()
        flooder.join(timeout=10)
    assert sent[0] > 1000, "the flood ran"
    assert silence < 3.0, f"answered within the heartbeat timeout during the flood (silent {silence:.2f} s)"
    assert worker.registered and worker.incarnation == incarnation, "not lost, not registered again"
    assert [w["status"] for w in daemon.status()["workers"]] == ["live"]
    assert metric(daemon, "dynaresized_connections_cut_total") >= 1
    assert rss_mib() - rss_before < 64, f"memory bounded: {rss_before:.0f} -> {rss_mib():.0f} MiB"
    assert daemon.proc.poll() is None and os.path.exists(f"/proc/{daemon.proc.pid}")
    await worker.close()


@pytest.mark.parametrize("secret,why", [("a", "got 1 character(s)"), ("z" * 40, "not all hex")])
def test_a_hello_secret_that_is_not_32_hex_characters_is_refused(make_daemon, secret: str, why: str) -> None:
    daemon = make_daemon()
    peer = RawPeer(daemon.worker_endpoint, b"w1#p1")
    try:
        peer.send(msgspec.msgpack.encode({"type": "hello", "protocol": wire.PROTOCOL_VERSION, "worker_id": "w1",
                                          "kind": "trainer-rank", "devices": ["node0:cpu1"], "process": "p1",
                                          "secret": secret}))
        reply = peer.reply()
    finally:
        peer.close()
    assert isinstance(reply, wire.Error) and reply.code is wire.ErrorCode.INVALID and reply.reason == "bad_request"
    assert "hello.secret must be 32 to 128 hex characters" in reply.message and why in reply.message
    assert daemon.status()["workers"] == [], "nothing registered"


def test_a_worker_id_and_process_too_long_for_a_routing_identity_is_refused_at_both_ends(make_daemon) -> None:
    with pytest.raises(ValueError, match="must be at most 255 bytes"):
        wire.identity_of("w" * 128, "p" * 127)
    assert len(wire.identity_of("w" * 128, "p" * 126)) == 255
    hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id="w" * 128, kind=WorkerKind.TRAINER_RANK,
                       devices=("node0:cpu1",), process="p" * 200)
    assert "routing identity of 329 bytes" in wire.hello_problem(hello)
    with pytest.raises(ValueError, match="routing identity"):  # before it connects
        WorkerClient("tcp://127.0.0.1:1", "w" * 223, WorkerKind.TRAINER_RANK, ("node0:cpu1",))
    daemon = make_daemon()
    peer = RawPeer(daemon.worker_endpoint, b"w" * 255)  # the longest identity a socket takes
    try:
        peer.send(wire.encode(hello))
        reply = peer.reply()
    finally:
        peer.close()
    assert isinstance(reply, wire.Error) and reply.reason == "bad_request" and "255" in reply.message


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


async def test_a_chatty_worker_is_rate_bounded_and_its_repeats_write_no_fact(make_daemon) -> None:
    """Reports that write facts are bounded per worker (`daemon.report_rate`, bursts of
    `daemon.report_burst`): past them `rate_limited`, changing nothing; and 1,000 identical
    `queue_empty` of one step were never more than one fact."""
    from dynaresized.core import facts as f

    daemon = make_daemon(daemon={"report_rate": 1.0, "report_burst": 50})
    engine = WorkerClient(daemon.worker_endpoint, "chatty", WorkerKind.ROLLOUT_ENGINE, ("node0:cpu2",))
    await engine.start()
    try:
        for _ in range(1000):
            await engine.report_queue_empty(step=3)
        await until(lambda: metric(daemon, "dynaresized_refusals_total", 'reason="rate_limited"') >= 900,
                    what="the reports past the burst refused")
        assert metric(daemon, "dynaresized_refusals_total", 'reason="rate_limited"') <= 1000 - 50
        await until(lambda: any(e.reason == "rate_limited" for e in engine.errors), what="the refusal at the worker")
        dry = [x for x in read_facts(daemon.state_dir) if isinstance(x, f.EngineQueueEmptyObserved)]
        assert len(dry) == 1, "a repeat of the same queue_empty writes no fact"
        assert engine.registered and daemon.status()["workers"][0]["status"] == "live"
    finally:
        await engine.close()
