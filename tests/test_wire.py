"""The wire protocol: round trips, strict decoding, fuzzing, and docs/protocol.md kept current."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized import wire
from dynaresized.domain import OpKind, Pool, StepTiming, WorkerKind
from dynaresized.protocol_doc import render

SAMPLES = [
    wire.Hello(protocol=1, worker_id="trainer-0", kind=WorkerKind.TRAINER_RANK, devices=("node0:gpu0",)),
    wire.Heartbeat(worker_id="engine-1", seq=7),
    wire.StepReport(worker_id="trainer-0", timing=StepTiming(step=3, rollout_s=12.5, train_s=7.0)),
    wire.Progress(worker_id="engine-1", step=3, done=5, total=16, tokens=900),
    wire.OpResult(worker_id="engine-1", op_id="r1/0-drain", ok=True, detail="drained 3 requests"),
    wire.Bye(worker_id="engine-1", reason="done"),
]
FRAMES = [wire.encode(m) for m in SAMPLES]


def test_every_worker_message_round_trips() -> None:
    decoder = wire.worker_decoder()
    for message, frame in zip(SAMPLES, FRAMES, strict=True):
        assert decoder.decode(frame) == message


def test_daemon_messages_round_trip() -> None:
    op = wire.OpCommand(op_id="r1/2-join", resize_id="r1", kind=OpKind.JOIN, devices=("n0:gpu3",),
                        from_pool=Pool.ROLLOUT, to_pool=Pool.TRAINING, timeout_s=30.0,
                        training=("n0:gpu0", "n0:gpu3"), rollout=("n0:gpu1",))
    assert wire.daemon_decoder().decode(wire.encode(op)) == op


def test_a_worker_decodes_an_op_of_a_cluster_of_4096_devices() -> None:
    """An op names both pools whole and the devices it moves: at 4,096 devices over the 64 KiB a
    worker may send, which a worker must still take from the daemon (the scale benchmark's
    workers once refused one)."""
    devices = tuple(f"node{i // 8}:gpu{i % 8}" for i in range(4096))
    op = wire.OpCommand(op_id="r1/5-commit", resize_id="r1", kind=OpKind.COMMIT, devices=devices[600:2100],
                        from_pool=Pool.ROLLOUT, to_pool=Pool.TRAINING, timeout_s=30.0,
                        training=devices[:2100], rollout=devices[2100:])
    frame = wire.encode(op)
    assert wire.MAX_MESSAGE_BYTES < len(frame) <= wire.DAEMON_MESSAGE_MAX_BYTES
    assert wire.daemon_decoder().decode(frame) == op
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.worker_decoder().decode(frame)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    frame = msgspec.msgpack.encode({"type": "heartbeat", "worker_id": "w1", "seq": 1, "added_in_v2": [1, 2]})
    assert wire.worker_decoder().decode(frame) == wire.Heartbeat(worker_id="w1", seq=1)


def test_daemon_messages_are_not_accepted_from_workers() -> None:
    frame = wire.encode(wire.HeartbeatAck(seq=1, boot_id="x"))
    try:
        wire.worker_decoder().decode(frame)
    except wire.WireError as exc:
        assert exc.kind is wire.ErrorCode.UNKNOWN_TYPE
    else:
        raise AssertionError("a daemon message decoded as a worker message")


def test_oversize_frames_are_refused_before_decoding() -> None:
    decoder = wire.worker_decoder(max_bytes=1024)
    frame = wire.encode(wire.Bye(worker_id="w1", reason="x" * 2000))
    try:
        decoder.decode(frame)
    except wire.WireError as exc:
        assert exc.kind is wire.ErrorCode.OVERSIZE and "1024" in exc.message
    else:
        raise AssertionError("oversize frame decoded")


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "dup"]),
                                       st.integers(0, max(len(frame) - 1, 0)), st.integers(0, 255)),
                             min_size=1, max_size=4))
    b = bytearray(frame)
    for op, pos, value in ops:
        pos = min(pos, max(len(b) - 1, 0))
        if op == "flip" and b:
            b[pos] ^= value or 1
        elif op == "cut":
            del b[pos:]
        elif op == "insert":
            b.insert(pos, value)
        elif op == "dup":
            b[pos:pos] = b[pos:pos + 8]
    return bytes(b)


def _decode_is_total(frame: bytes) -> None:
    try:
        result = wire.worker_decoder().decode(frame)
    except wire.WireError as exc:
        assert isinstance(exc.kind, wire.ErrorCode) and exc.message
    else:
        assert isinstance(result, wire.WorkerMessage.__args__)  # type: ignore[attr-defined]


DECODER = wire.worker_decoder()


@settings(max_examples=3000)
@given(st.data())
def test_fuzz_mutated_frames_yield_a_message_or_a_typed_error(data: st.DataObject) -> None:
    frame = _mutate(data.draw(st.sampled_from(FRAMES)), data)
    _decode_is_total(frame)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=1200)
@given(st.dictionaries(st.sampled_from(["type", "worker_id", "protocol", "kind", "devices", "timing", "step",
                                        "done", "total", "op_id", "ok", "seq"]), _msgpack_values, max_size=6)
       | _msgpack_values)
def test_fuzz_random_msgpack_values_yield_a_message_or_a_typed_error(value: object) -> None:
    _decode_is_total(msgspec.msgpack.encode(value))


@settings(max_examples=2000)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_yield_a_message_or_a_typed_error(frame: bytes) -> None:
    _decode_is_total(frame)


def test_protocol_doc_matches_the_schema() -> None:
    committed = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    assert committed == render(), "docs/protocol.md is stale: python -m dynaresized.protocol_doc > docs/protocol.md"
    for cls in [*wire.WorkerMessage.__args__, *wire.DaemonMessage.__args__]:  # type: ignore[attr-defined]
        assert f'type: "{cls.__struct_config__.tag}"' in committed


def test_a_step_report_with_and_without_response_lengths() -> None:
    from dynaresized.domain import ResponseLengths

    lengths = ResponseLengths(quantiles=(900, 4000, 12000, 16384), token_s=0.021)
    new = wire.StepReport(worker_id="trainer-0", timing=StepTiming(step=3, rollout_s=12.5, train_s=7.0,
                                                                    lengths=lengths))
    assert wire.worker_decoder().decode(wire.encode(new)) == new
    # an older worker's report has no `lengths` key: accepted, None
    old = msgspec.msgpack.encode({"type": "step_report", "worker_id": "trainer-0",
                                  "timing": {"step": 3, "rollout_s": 12.5, "train_s": 7.0}})
    decoded = wire.worker_decoder().decode(old)
    assert isinstance(decoded, wire.StepReport) and decoded.timing.lengths is None
