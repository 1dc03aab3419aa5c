"""Facts: what happened, as recorded in the event log. State is the fold of these.

Facts are appended to the store before the commands they imply leave the daemon. Fields are
only ever appended, with defaults, so old logs stay readable.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from dynaresized.domain import DeviceId, OpSpec, Pool, ResizePlan, Split, StepTiming, Worker, WorkerId


class Fact(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    at: float


class ClusterConfigured(Fact, frozen=True, tag="cluster_configured"):
    devices: tuple[DeviceId, ...]
    pools: tuple[Pool, ...]
    candidates: tuple[Split, ...] = ()


class DaemonRestarted(Fact, frozen=True, tag="daemon_restarted"):
    """The daemon started on this log; any operation in flight gets a fresh deadline."""

    op_deadline: float | None = None


class WorkerRegistered(Fact, frozen=True, tag="worker_registered"):
    worker: Worker


class WorkerLost(Fact, frozen=True, tag="worker_lost"):
    worker_id: WorkerId
    reason: str


class WorkerLeft(Fact, frozen=True, tag="worker_left"):
    worker_id: WorkerId


class StepObserved(Fact, frozen=True, tag="step_observed"):
    worker_id: WorkerId
    timing: StepTiming


class ProgressObserved(Fact, frozen=True, tag="progress_observed"):
    worker_id: WorkerId
    step: int
    done: int
    total: int
    tokens: int = 0


class ProposalRejected(Fact, frozen=True, tag="proposal_rejected"):
    """A proposal that did not become a resize, and why (the operator's 'why nothing happened')."""

    source: str  # policy name or "operator"
    target: Split | None
    guard: str
    reason: str
    step: int = -1


class ResizeStarted(Fact, frozen=True, tag="resize_started"):
    plan: ResizePlan
    source: str
    reason: str
    op_deadline: float


class OpAcked(Fact, frozen=True, tag="op_acked"):
    op_id: str
    worker_id: WorkerId
    detail: str = ""


class OpCompleted(Fact, frozen=True, tag="op_completed"):
    op_id: str
    duration_s: float
    next_deadline: float | None = None  # deadline of the next op, when there is one


class OpFailed(Fact, frozen=True, tag="op_failed"):
    op_id: str
    worker_id: WorkerId | None
    reason: str


class ResizeAborted(Fact, frozen=True, tag="resize_aborted"):
    resize_id: str
    reason: str
    undo: tuple[OpSpec, ...]
    op_deadline: float | None


class ResizeCommitted(Fact, frozen=True, tag="resize_committed"):
    resize_id: str
    duration_s: float
    step: int


class ResizeRolledBack(Fact, frozen=True, tag="resize_rolled_back"):
    resize_id: str
    reason: str
    step: int


class Degraded(Fact, frozen=True, tag="degraded"):
    """A resize could neither finish nor roll back cleanly; resizing waits for an operator."""

    resize_id: str
    reason: str
    placed_in: Pool  # where the moving devices were put
    step: int


class ResizingPaused(Fact, frozen=True, tag="resizing_paused"):
    requested_by: str
    reason: str = ""


class ResizingResumed(Fact, frozen=True, tag="resizing_resumed"):
    requested_by: str


class ShutdownStarted(Fact, frozen=True, tag="shutdown_started"):
    pass


class EngineQueueEmptyObserved(Fact, frozen=True, tag="engine_queue_empty"):
    """An engine ran out of queued requests of rollout step `step` (see events.EngineQueueEmpty)."""

    worker_id: WorkerId
    device: DeviceId
    step: int
    running: int
    tokens_left: int = 0


class MiniBatchObserved(Fact, frozen=True, tag="mini_batch_done"):
    worker_id: WorkerId
    step: int
    done: int
    total: int


class LoanStarted(Fact, frozen=True, tag="loan_started"):
    """Idle devices are lent to `plan.to_pool` for the rest of the step; `plan.kind` is LOAN."""

    plan: ResizePlan
    source: str
    reason: str  # what an operator reads: "lent ... at mini-batch 5/16: ..., saves ~41 s"
    op_deadline: float
    saves_s: float = 0.0  # the policy's predicted saving in the rest of the step
    cost_s: float = 0.0  # the loan's predicted cost on the critical path


class LoanLanded(Fact, frozen=True, tag="loan_landed"):
    """The lent devices serve `plan.to_pool` until the step boundary; their home is recorded."""

    resize_id: str
    duration_s: float


class LoanReturnStarted(Fact, frozen=True, tag="loan_return_started"):
    """At a step boundary the lent devices go home (`plan.kind` is RETURN). A resize the policy
    asked for at the same boundary (`then`) starts once they are home: one sequence at a time."""

    plan: ResizePlan
    reason: str
    op_deadline: float
    then: Split | None = None
    then_source: str = ""
    then_reason: str = ""


class LoanReturned(Fact, frozen=True, tag="loan_returned"):
    resize_id: str
    duration_s: float


AnyFact = (
    ClusterConfigured
    | DaemonRestarted
    | WorkerRegistered
    | WorkerLost
    | WorkerLeft
    | StepObserved
    | ProgressObserved
    | ProposalRejected
    | ResizeStarted
    | OpAcked
    | OpCompleted
    | OpFailed
    | ResizeAborted
    | ResizeCommitted
    | ResizeRolledBack
    | Degraded
    | ResizingPaused
    | ResizingResumed
    | ShutdownStarted
    | EngineQueueEmptyObserved
    | MiniBatchObserved
    | LoanStarted
    | LoanLanded
    | LoanReturnStarted
    | LoanReturned
)

FACT_TYPES: tuple[type[Fact], ...] = AnyFact.__args__  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyFact)
_json_encoder = msgspec.json.Encoder()


def encode_fact(fact: Fact) -> bytes:
    return _encoder.encode(fact)


def decode_fact(data: bytes) -> Fact:
    return _decoder.decode(data)


def fact_type(fact: Fact) -> str:
    return type(fact).__struct_config__.tag  # type: ignore[return-value]


_TAGS: dict[type, str] = {cls: cls.__struct_config__.tag for cls in FACT_TYPES}  # type: ignore[misc]


def encode_facts(facts: Iterable[Fact]) -> list[tuple[str, bytes]]:
    """(fact_type(fact), encode_fact(fact)) for each fact: what the fact log appends."""
    tags, encode = _TAGS, _encoder.encode
    return [(tags.get(type(fact)) or fact_type(fact), encode(fact)) for fact in facts]


def fact_to_json(fact: Fact) -> bytes:
    return _json_encoder.encode(fact)
