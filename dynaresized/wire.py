"""The wire protocol between the daemon and its workers and operators.

Every message is one msgpack-encoded msgspec Struct in one ZeroMQ frame (the ROUTER adds the
peer's routing identity in front). Messages are tagged unions on the field `type`. Rules that
keep old and new peers talking:

* `PROTOCOL_VERSION` is sent in `Hello` and `ControlRequest`s; a daemon refuses other versions
  with a clear error (`Error(code="bad_version")`).
* `Welcome` hands out a per-registration `token`; every later message of that worker carries
  it, and one with a stale or missing token is refused (`stale_token`, `missing_token`).
* Fields are only ever appended, always with a default. Unknown fields are ignored (a newer
  peer may send more); unknown message types, wrong types and missing fields are errors.
* Decoding never raises anything but `WireError`, whose `kind` says what was wrong.

`docs/protocol.md` documents every message; `tests/test_wire.py` checks it against
`json_schema()` so it cannot drift.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, Split, StepTiming, WorkerKind

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 64 * 1024
"""Default size limit of one frame; the daemon also sets ZMQ_MAXMSGSIZE to this."""
DAEMON_MESSAGE_MAX_BYTES = 16 * 1024 * 1024
"""What a worker accepts from the daemon: its messages grow with the cluster (an `op` names both
pools' devices and those it moves, about 14 bytes each: up to 72 KB at 4,096 devices)."""

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Devices = Annotated[tuple[Name, ...], msgspec.Meta(max_length=256)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Token = Annotated[str, msgspec.Meta(max_length=64)]
Secret = Annotated[str, msgspec.Meta(max_length=128)]


ROUTING_ID_MAX_BYTES = 255
"""A ZeroMQ routing identity is at most 255 bytes: a worker's, `<worker_id>#<process>`, must fit."""
SECRET_HEX_MIN = 32
"""`hello.secret`, where sent: at least 32 hex characters (128 bits), at most 128."""
_HEX = frozenset("0123456789abcdefABCDEF")


def identity_of(worker_id: str, process: str) -> bytes:
    """The routing identity of a worker's connection, `<worker_id>#<process>` (the bare worker id
    where there is no `process`); ValueError where it exceeds `ROUTING_ID_MAX_BYTES`."""
    identity = f"{worker_id}#{process}".encode() if process else worker_id.encode()
    if len(identity) > ROUTING_ID_MAX_BYTES:
        raise ValueError(f"worker id and process make a routing identity of {len(identity)} bytes "
                         f"(`<worker_id>#<process>`); ZeroMQ allows {ROUTING_ID_MAX_BYTES}: "
                         "len(worker_id) + 1 + len(process) must be at most 255 bytes")
    return identity


def hello_problem(msg: Hello) -> str:
    """What makes a well-typed `hello` unacceptable ("" if nothing): a `secret` that is not 32
    to 128 hex characters, or a worker id and process too long for one routing identity."""
    if msg.secret and (len(msg.secret) < SECRET_HEX_MIN or not set(msg.secret) <= _HEX):
        return (f"hello.secret must be {SECRET_HEX_MIN} to 128 hex characters (128 bits or more, chosen at random "
                f"once per process, e.g. secrets.token_hex(16)); got {len(msg.secret)} character(s)"
                + ("" if set(msg.secret) <= _HEX else ", not all hex"))
    try:
        identity_of(msg.worker_id, msg.process)
    except ValueError as exc:
        return str(exc)
    return ""


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


# -- worker -> daemon ---------------------------------------------------------------------


class Hello(_Msg, frozen=True, kw_only=True, tag="hello"):
    """Register (or re-register after a restart of either side). Answered by `Welcome` or `Error`."""

    protocol: int
    worker_id: Name
    kind: WorkerKind
    devices: Devices
    pid: Count = 0
    host: Text = ""
    sent_at: float = 0.0
    process: Text = ""  # unique per process run: a new value means the worker restarted
    actual: ActualState | None = None  # what this process holds now (see docs/protocol.md, reconciliation)
    secret: Secret = ""  # chosen at random by this process, the same in all its hellos, never shown to anyone




class Heartbeat(_Msg, frozen=True, kw_only=True, tag="heartbeat"):
    """Liveness; answered by `HeartbeatAck` when `ack` is true. A worker that sends nothing
    (no heartbeat nor any other message) for `heartbeat_timeout_s` is lost."""

    worker_id: Name
    seq: Count = 0
    sent_at: float = 0.0
    token: Token = ""
    ack: bool = True  # false: no `HeartbeatAck` wanted (the worker heard from the daemon lately)


class StepReport(_Msg, frozen=True, kw_only=True, tag="step_report"):
    """Stage timings of one completed RL step, sent by exactly one worker of the job (trainer
    rank 0 or the driver); a second report of the same step is refused as `stale_step`."""

    worker_id: Name
    timing: StepTiming
    sent_at: float = 0.0
    token: Token = ""


class Progress(_Msg, frozen=True, kw_only=True, tag="progress"):
    """Per-sample completion of the current step on this worker (batched by the client). Kept
    as soft state, as a heartbeat's time is: not a fact in the log (`status` shows the sums)."""

    worker_id: Name
    step: Count
    done: Count
    total: Count
    tokens: Count = 0
    sent_at: float = 0.0
    token: Token = ""


class OpResult(_Msg, frozen=True, kw_only=True, tag="op_result"):
    """The outcome of an `OpCommand`. A re-sent op_id is answered from the record of the first
    run: the same `ok`, `detail` and `duration_s`, with the current registration's `token` (and
    `actual` as it is now)."""

    worker_id: Name
    op_id: Name
    ok: bool
    detail: Text = ""
    duration_s: Seconds = 0.0
    sent_at: float = 0.0
    token: Token = ""
    actual: ActualState | None = None  # this worker's state after the op


class Bye(_Msg, frozen=True, kw_only=True, tag="bye"):
    """Leaving on purpose; the worker's devices stay in their pools without it."""

    worker_id: Name
    reason: Text = ""
    token: Token = ""


class StateReport(_Msg, frozen=True, kw_only=True, tag="state_report"):
    """This worker's actual state: the answer to `StateQuery`, or sent unasked when it changed."""

    worker_id: Name
    actual: ActualState
    token: Token = ""
    sent_at: float = 0.0


class QueueEmpty(_Msg, frozen=True, kw_only=True, tag="queue_empty"):
    """A rollout engine has no queued request of rollout step `step` left: `running` still
    decode, about `tokens_left` tokens to go (the engine's own estimate). Sent again with
    `running` 0 when the last one finished: the engine is idle and may be lent to training.
    One that arrives while a resize, regroup or loan moves the engine's devices is dropped:
    the engine drains first, and whatever it ran dry in is over for it."""

    worker_id: Name
    step: Count
    running: Count = 0
    tokens_left: Count = 0
    sent_at: float = 0.0
    token: Token = ""


class MiniBatchDone(_Msg, frozen=True, kw_only=True, tag="mini_batch_done"):
    """A trainer finished mini-batch `done` of `total` (an optimizer step) of training step
    `step`. One rank per job reports, like `step_report`. `done` 0 says the step begins;
    `done` and `total` both 0 say the trainer has nothing to train until the rollout of step
    `step` is done (the first window of a one-step off-policy pipeline): its devices may be
    lent to that rollout, and come home when the step begins."""

    worker_id: Name
    step: Count
    done: Count
    total: Count
    sent_at: float = 0.0
    token: Token = ""


WorkerMessage = Hello | Heartbeat | StepReport | Progress | OpResult | Bye | StateReport | QueueEmpty | MiniBatchDone


# -- daemon -> worker ---------------------------------------------------------------------


class Welcome(_Msg, frozen=True, kw_only=True, tag="welcome"):
    protocol: int
    worker_id: str
    incarnation: int
    boot_id: str  # changes on every daemon start: a client that sees a new one says Hello again
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    candidates: tuple[Split, ...] = ()  # the splits a `prepare` may pre-warm communicators for
    token: str = ""  # carry it in every later message of this registration
    pool: Pool | None = None  # where the log has this worker's devices (None: moving, or split)
    desired: Holding | None = None  # what the log says this worker should do now (None: wait for ops)


class HeartbeatAck(_Msg, frozen=True, kw_only=True, tag="heartbeat_ack"):
    seq: int
    boot_id: str


class OpCommand(_Msg, frozen=True, kw_only=True, tag="op"):
    """Perform one operation of a resize. Workers must deduplicate by `op_id`: a re-sent
    command (after a daemon restart) is answered from the worker's record, not re-run."""

    op_id: str
    resize_id: str
    kind: OpKind
    devices: tuple[str, ...]
    from_pool: Pool
    to_pool: Pool
    timeout_s: float  # seconds left before the daemon gives up on this op
    training: tuple[str, ...]  # the training pool once the resize commits
    rollout: tuple[str, ...]  # the rollout pool once the resize commits
    plan: PlanKind = PlanKind.RESIZE  # a loan (lent for the rest of the step) or its return
    engine: tuple[str, ...] = ()
    """An engine worker's engine once this sequence is done (an undo: the one it goes back to),
    when wider than its own device: run it (over these devices) if your device is the first,
    hold nothing otherwise. Empty: an engine of your own device (docs/protocol.md, "Regroups")."""


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"  # not msgpack, or not a message
    UNKNOWN_TYPE = "unknown_type"
    INVALID = "invalid"  # wrong field types, missing fields, values out of range
    OVERSIZE = "oversize"
    BAD_VERSION = "bad_version"
    UNAUTHORIZED = "unauthorized"  # not who it claims: `reason` says how (wrong_key, wrong_identity, ...)
    REFUSED = "refused"  # the core refused it; `reason` has the core's code


class Error(_Msg, frozen=True, kw_only=True, tag="error"):
    code: ErrorCode
    message: str
    reason: str = ""  # finer code, e.g. "unknown_device", "device_owned", "stale_op"
    ref_type: str = ""  # type of the message that caused it, when known
    token: str = ""  # the token the refused message carried (tells a stale copy from the current one)


class StateQuery(_Msg, frozen=True, kw_only=True, tag="state_query"):
    """Report your actual state (answer with `StateReport`)."""

    boot_id: str = ""


DaemonMessage = Welcome | HeartbeatAck | OpCommand | Error | StateQuery


# -- operator (CLI) <-> daemon, on the control endpoint -------------------------------------


class StatusRequest(_Msg, frozen=True, kw_only=True, tag="status"):
    protocol: int = PROTOCOL_VERSION


class PauseRequest(_Msg, frozen=True, kw_only=True, tag="pause"):
    protocol: int = PROTOCOL_VERSION
    reason: Text = ""


class ResumeRequest(_Msg, frozen=True, kw_only=True, tag="resume"):
    protocol: int = PROTOCOL_VERSION


class ResizeRequest(_Msg, frozen=True, kw_only=True, tag="resize"):
    protocol: int = PROTOCOL_VERSION
    train: Count
    rollout: Count
    reason: Text = ""


class RegroupRequest(_Msg, frozen=True, kw_only=True, tag="regroup"):
    """Make rollout devices serve as engines of `tp` devices each (tensor parallelism)."""

    protocol: int = PROTOCOL_VERSION
    devices: Devices
    tp: Annotated[int, msgspec.Meta(ge=1, le=256)]
    reason: Text = ""


class DrainRequest(_Msg, frozen=True, kw_only=True, tag="drain"):
    """Stop the daemon gracefully, as SIGTERM does."""

    protocol: int = PROTOCOL_VERSION


ControlRequest = StatusRequest | PauseRequest | ResumeRequest | ResizeRequest | DrainRequest | RegroupRequest


class ControlReply(_Msg, frozen=True, kw_only=True, tag="reply"):
    ok: bool
    message: str
    data: dict[str, Any] = {}


class WireError(Exception):
    """A frame that is not a valid message. `kind` says why; the daemon counts by kind."""

    def __init__(self, kind: ErrorCode, message: str) -> None:
        self.kind = kind
        self.message = message
        super().__init__(f"{kind.value}: {message}")


_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Decoder:
    """One strict decoder per message union, built once (decoders are not cheap to build)."""

    def __init__(self, union: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self._tags = {
            cls.__struct_config__.tag for cls in union.__args__  # type: ignore[attr-defined]
        }
        self.max_bytes = max_bytes

    def decode(self, frame: bytes | memoryview) -> Any:
        if len(frame) > self.max_bytes:
            raise WireError(ErrorCode.OVERSIZE, f"frame of {len(frame)} bytes exceeds the {self.max_bytes}-byte limit")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            text = str(exc)
            if "Invalid value" in text and "`$.type`" in text:
                raise WireError(ErrorCode.UNKNOWN_TYPE, f"unknown message type ({text})") from None
            raise WireError(ErrorCode.INVALID, text) from None
        except msgspec.DecodeError as exc:
            raise WireError(ErrorCode.MALFORMED, f"not a msgpack message: {exc}") from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # defensive: never escape
            raise WireError(ErrorCode.MALFORMED, f"undecodable frame: {exc}") from None

    @property
    def types(self) -> frozenset[str]:
        return frozenset(self._tags)


def worker_decoder(max_bytes: int = MAX_MESSAGE_BYTES) -> Decoder:
    return Decoder(WorkerMessage, max_bytes)


def daemon_decoder(max_bytes: int = DAEMON_MESSAGE_MAX_BYTES) -> Decoder:
    return Decoder(DaemonMessage, max_bytes)


def control_decoder(max_bytes: int = MAX_MESSAGE_BYTES) -> Decoder:
    return Decoder(ControlRequest, max_bytes)


def reply_decoder(max_bytes: int = 16 * 1024 * 1024) -> Decoder:
    return Decoder(ControlReply | Error, max_bytes)


def json_schema() -> dict[str, Any]:
    """The JSON schema of every message, the source of truth for docs/protocol.md."""
    _, components = msgspec.json.schema_components(
        [WorkerMessage, DaemonMessage, ControlRequest, ControlReply], ref_template="#/$defs/{name}"
    )
    return components
