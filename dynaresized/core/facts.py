"""Facts: what happened, as recorded in the event log. State is the fold of these.

Facts are appended to the store before the commands they imply leave the daemon. Fields are
only ever appended, with defaults, so old logs stay readable.
"""

from __future__ import annotations

from collections.abc import Iterable

import enum

from typing import Any

import msgspec

from dynaresized.domain import ActualState, DeviceId, Holding, OpSpec, PlanKind, Pool, ResizePlan, Split, StepTiming, Worker, WorkerId


class Fact(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """What every fact has: `type` (its tag) and `at`, when it happened on the daemon's clock
    (seconds since the Unix epoch; `daemon.time_scale` speeds that clock up for demos). A
    fact's class docstring says when the daemon writes it: docs/facts.md is rendered from them."""

    at: float


class ClusterConfigured(Fact, frozen=True, tag="cluster_configured"):
    """The first fact of every log: the daemon's first start on an empty log records the device
    inventory (`[cluster].devices`), each device's initial pool and the candidate splits. Never
    written again: a later start with other devices is refused."""

    devices: tuple[DeviceId, ...]  # the inventory: `[cluster].devices`
    pools: tuple[Pool, ...]  # each device's initial pool, in the order of `devices`
    candidates: tuple[Split, ...] = ()  # the allowed splits (empty: every split)


class DaemonRestarted(Fact, frozen=True, tag="daemon_restarted"):
    """The daemon started on this log; any operation in flight gets a fresh deadline."""

    op_deadline: float | None = None  # the op in flight's new deadline (null: nothing in flight)


class DaemonStalled(Fact, frozen=True, tag="daemon_stalled"):
    """The daemon did not run for `seconds` (no CPU, a slow disk) while an operation was in
    flight: its answers may be waiting in the socket, unread, so its deadline moves on by that
    time, as the workers' heartbeat clocks do (only time the daemon was running counts)."""

    seconds: float  # how long the daemon did not run
    op_deadline: float  # the op in flight's deadline, moved on by `seconds`


class WorkerRegistered(Fact, frozen=True, tag="worker_registered"):
    """A `hello` was accepted as a new registration (a first hello, a new process, or the same
    process after a daemon restart or after it was declared lost). `worker.incarnation` counts
    this worker id's registrations. A repeated hello of the registered process writes nothing."""

    worker: Worker  # the registration: id, kind, devices, incarnation, process, what it holds


class WorkerLost(Fact, frozen=True, tag="worker_lost"):
    """A live worker was declared lost: silent for `heartbeat_timeout_s`, or a new process
    registered under its id after its connection closed. A resize it takes part in rolls back."""

    worker_id: WorkerId
    reason: str  # e.g. "no heartbeat for 10.3s (heartbeat_timeout_s=10)"


class WorkerLeft(Fact, frozen=True, tag="worker_left"):
    """A worker said `bye` (left on purpose); its devices stay in their pools."""

    worker_id: WorkerId


class StepObserved(Fact, frozen=True, tag="step_observed"):
    """A `step_report` was accepted: the stage timings of one RL step, as its reporter measured
    them (one per step, in order). This is what the policy decides on."""

    worker_id: WorkerId  # the worker that reported the step
    timing: StepTiming


class ProgressObserved(Fact, frozen=True, tag="progress_observed"):
    """A `progress` message was accepted: per-sample completion of a step on one worker. Written
    until 5 December 2026 and still read from older logs; progress is soft state since (the core
    keeps each engine's latest report without a fact, as it keeps heartbeat times)."""

    worker_id: WorkerId
    step: int
    done: int
    total: int
    tokens: int = 0


class ProposalRejected(Fact, frozen=True, tag="proposal_rejected"):
    """A proposal that did not go ahead, and why (the operator's 'why nothing happened'):
    `proposal` says what was refused, a resize, a loan or a regroup."""

    source: str  # policy name or "operator"
    target: Split | None
    guard: str  # the guard that refused, e.g. threshold, signal_run, cooldown, payback, capacity, in_flight
    reason: str
    step: int = -1
    proposal: PlanKind = PlanKind.RESIZE  # what was refused (logs written before it had this: resize)


class PolicyHeld(Fact, frozen=True, tag="policy_held"):
    """The policy looked at step `step` and proposed no resize, and why: the operator's "why
    nothing moved" when no guard was even asked (a refused proposal is `ProposalRejected`)."""

    source: str  # policy name
    step: int
    split: Split
    reason: str


class ResizeStarted(Fact, frozen=True, tag="resize_started"):
    """A resize passed its guards (the policy's proposal, or an operator's `resize`) and begins:
    `plan` holds its ops, the first of which is sent now; `op_deadline` is that op's deadline."""

    plan: ResizePlan
    source: str
    reason: str
    op_deadline: float
    # What the decision expected, kept so that the outcome can be checked against it
    # (PredictionChecked, ResizeJudged). None where nobody predicted (an operator's resize).
    predicted_step_s: float | None = None  # the policy's step time if nothing changed
    predicted_step_s_after: float | None = None  # ... and on the target split
    measured_step_s: float | None = None  # mean measured step period on the old split
    predicted_cost_s: float | None = None  # critical-path cost the payback guard assumed
    payback_steps: int = 0  # steps after the commit over which the resize is judged
    measured_s_per_token: float | None = None  # old split's step period per response token


class OpAcked(Fact, frozen=True, tag="op_acked"):
    """One target answered the op in flight with `ok: true` (`detail` and `actual` from its
    `op_result`). A repeated answer to the same op writes nothing."""

    op_id: str
    worker_id: WorkerId
    detail: str = ""
    actual: ActualState | None = None  # the worker's state after the op, when it said


class OpCompleted(Fact, frozen=True, tag="op_completed"):
    """Every live target of the op in flight acknowledged it; the next op of the plan (if any)
    is sent now, due by `next_deadline`."""

    op_id: str
    duration_s: float
    next_deadline: float | None = None  # deadline of the next op, when there is one


class OpFailed(Fact, frozen=True, tag="op_failed"):
    """The op in flight failed: a target answered `ok: false` (`worker_id` is that target), or
    it timed out, a target was lost, or an operator aborted it (`worker_id` is null). A resize
    then rolls back (`resize_aborted`), a rollback or commit ends `degraded`, a reconcile ends."""

    op_id: str
    worker_id: WorkerId | None  # the target that answered ok: false; null: timeout, loss or abort
    reason: str


class ResizeAborted(Fact, frozen=True, tag="resize_aborted"):
    """A resize, a loan or a loan's return gave up before its commit: `undo` lists the undo
    ops, in order, for every op that was sent (`op_deadline` is the first one's, null when
    there is nothing to undo)."""

    resize_id: str
    reason: str
    undo: tuple[OpSpec, ...]
    op_deadline: float | None


class ResizeCommitted(Fact, frozen=True, tag="resize_committed"):
    """Every op of a resize, its commit included, was acknowledged: the new split holds from
    now on (`step` is the last observed RL step; `duration_s` from `resize_started`)."""

    resize_id: str
    duration_s: float
    step: int  # the last observed RL step (-1: none yet)


class ResizeRolledBack(Fact, frozen=True, tag="resize_rolled_back"):
    """Every undo op of an aborted resize or loan was acknowledged: the devices are home again,
    the split is what it was (`reason` is why it was aborted)."""

    resize_id: str
    reason: str
    step: int  # the last observed RL step (-1: none yet)


class Degraded(Fact, frozen=True, tag="degraded"):
    """A resize could neither finish nor roll back cleanly; resizing waits for an operator."""

    resize_id: str
    reason: str
    placed_in: Pool  # where the moving devices were put
    step: int


class PredictionChecked(Fact, frozen=True, tag="prediction_checked"):
    """The first steps after a resize, measured against the step time its policy predicted."""

    resize_id: str
    steps: int  # steps on the new split the measurement averages
    predicted_step_s_after: float
    measured_step_s_after: float
    error_s: float  # measured - predicted: positive when the run is slower than predicted
    predicted_step_s: float | None = None  # prediction for the old split
    measured_step_s: float | None = None  # what the old split measured


class Verdict(str, enum.Enum):
    PAID_BACK = "paid_back"  # the steps saved cover the resize's cost
    NOT_PAID_BACK = "not_paid_back"  # faster per step, but not by enough to cover the cost yet
    WORSE = "worse"  # the new split is slower per step than the old one: the resize hurt
    UNKNOWN = "unknown"  # no measured step on one side of the resize


class ResizeJudged(Fact, frozen=True, tag="resize_judged"):
    """A committed resize measured over its payback window (or until the next resize)."""

    resize_id: str
    verdict: Verdict
    steps: int  # steps measured after the commit
    payback_steps: int  # the window it was to be judged over
    saved_s: float | None  # what the old split would have taken for those steps - what they took
    cost_s: float | None  # the resize cost the payback guard assumed
    payback_factor: float = 1.0  # the payback guard's learned multiplier from now on
    undo_to: Split | None = None
    """Judged worse after its first `verify_steps` steps (`GuardConfig.undo_worse`): the split it
    left, which the next step boundary the safety checks allow goes back to."""


class ResizingPaused(Fact, frozen=True, tag="resizing_paused"):
    """An operator's `pause` (while not paused): no new resize or loan starts; one in flight
    finishes."""

    requested_by: str  # "operator" for the control request
    reason: str = ""


class ResizingResumed(Fact, frozen=True, tag="resizing_resumed"):
    """An operator's `resume` while paused or degraded: resizing may start again (a degraded
    daemon leaves degraded; devices still lent go home)."""

    requested_by: str  # "operator" for the control request


class ShutdownStarted(Fact, frozen=True, tag="shutdown_started"):
    """SIGTERM or an operator's `drain`: no new resize starts; the one in flight finishes or
    rolls back within `daemon.drain_timeout_s`, then the daemon exits."""


class WorkerReported(Fact, frozen=True, tag="worker_reported"):
    """A live worker's account of its actual state changed (a state report or an op result)."""

    worker_id: WorkerId
    actual: ActualState


class ReconcileStarted(Fact, frozen=True, tag="reconcile_started"):
    """A worker's actual state differs from what the log says it should be: `plan` holds the
    ops that converge it. Serialized like a resize; the pools do not change."""

    plan: ResizePlan
    worker_id: WorkerId
    desired: Holding
    actual: Holding
    op_deadline: float


class ReconcileFinished(Fact, frozen=True, tag="reconcile_finished"):
    """The reconcile in flight ended: converged (`ok`), or not (a `WorkerUnconverged` follows
    when the worker answered but could not converge)."""

    resize_id: str
    worker_id: WorkerId
    ok: bool
    reason: str = ""


class WorkerUnconverged(Fact, frozen=True, tag="worker_unconverged"):
    """A worker could not be converged (its converging ops failed or timed out, or it reports
    that it cannot act): its devices are left out of resize plans until it reports a state that
    agrees with the log, or registers again."""

    worker_id: WorkerId
    reason: str
class EngineQueueEmptyObserved(Fact, frozen=True, tag="engine_queue_empty"):
    """An engine ran out of queued requests of rollout step `step` (see events.EngineQueueEmpty)."""

    worker_id: WorkerId
    device: DeviceId
    step: int
    running: int
    tokens_left: int = 0


class MiniBatchObserved(Fact, frozen=True, tag="mini_batch_done"):
    """A trainer's `mini_batch_done` was accepted: mini-batch `done` of `total` of training step
    `step` is done (the boundaries where a lent device joins)."""

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
    check_step: int = -1
    """The step whose lent-to stage the prediction is of (the rollout step in progress for a loan
    to the rollout, the training step for one to training; -1: the policy predicted nothing)."""
    ends_in_s: float = 0.0  # the policy's predicted seconds until that stage finishes the step, with the loan
    stage_elapsed_s: float = 0.0  # of a loan to the rollout: seconds the rollout had run at `at`


class LoanChecked(Fact, frozen=True, tag="loan_checked"):
    """A loan's prediction against what was measured once its stage finished the step: the seconds
    from the loan's start until the lent-to stage was done, as the policy predicted them
    (`LoanStarted.ends_in_s`) and as measured (a loan to training: its step's last mini-batch; to
    the rollout: the step report's `rollout_s` less the rollout's time before the loan)."""

    resize_id: str
    to_pool: Pool
    step: int
    predicted_s: float
    measured_s: float
    error_s: float  # measured - predicted: positive when the stage finished later than predicted
    saves_s: float = 0.0  # the saving the loan was started for


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
    then_predicted_step_s: float = 0.0  # the policy's prediction for `then` (0: none)
    then_predicted_step_s_after: float = 0.0


class LoanReturned(Fact, frozen=True, tag="loan_returned"):
    """Every op of a loan's return was acknowledged: the lent devices are home."""

    resize_id: str
    duration_s: float


class RegroupStarted(Fact, frozen=True, tag="regroup_started"):
    """Rollout devices begin to form engines of another size (`plan.kind` REGROUP,
    `plan.engines` the engines once it commits): drain, release, join, restore and commit on
    their engine workers, serialized and undone like a resize's. No device changes pool."""

    plan: ResizePlan
    source: str  # "operator", the policy that asked, or "tail" (a tail regroup's way back)
    reason: str
    op_deadline: float
    undo: tuple[tuple[DeviceId, ...], ...] = ()
    """A tail regroup (the policy's, inside a step): the engines its devices were, which the core
    regroups them back into at the step boundary. Empty for every other regroup."""


class RegroupCommitted(Fact, frozen=True, tag="regroup_committed"):
    """Every op of a regroup was acknowledged: its devices serve as `plan.engines` from now on."""

    resize_id: str
    duration_s: float
    step: int  # the last observed RL step (-1: none yet)


class ConfigReloaded(Fact, frozen=True, tag="config_reloaded"):
    """SIGHUP: [policy] and [guards] were re-read from the configuration file and apply from the
    next decision on (a resize in flight runs on as planned). `guards_changed` maps each guard
    that changed to [old, new]; `restart_only` names the other sections that differ from the
    running ones, which take effect only at the next start."""

    policy: str
    options: dict[str, Any] = {}
    guards_changed: dict[str, tuple[Any, Any]] = {}
    restart_only: tuple[str, ...] = ()


class ReloadRefused(Fact, frozen=True, tag="reload_refused"):
    """SIGHUP: the configuration file did not load, or its policy did not build; the running
    policy and guards are kept. `reason` says why."""

    reason: str


AnyFact = (
    ClusterConfigured
    | DaemonRestarted
    | DaemonStalled
    | WorkerRegistered
    | WorkerLost
    | WorkerLeft
    | StepObserved
    | ProgressObserved
    | ProposalRejected
    | PolicyHeld
    | ResizeStarted
    | OpAcked
    | OpCompleted
    | OpFailed
    | ResizeAborted
    | ResizeCommitted
    | ResizeRolledBack
    | Degraded
    | PredictionChecked
    | ResizeJudged
    | ResizingPaused
    | ResizingResumed
    | ShutdownStarted
    | WorkerReported
    | ReconcileStarted
    | ReconcileFinished
    | WorkerUnconverged
    | EngineQueueEmptyObserved
    | MiniBatchObserved
    | LoanStarted
    | LoanChecked
    | LoanLanded
    | LoanReturnStarted
    | LoanReturned
    | ConfigReloaded
    | ReloadRefused
    | RegroupStarted
    | RegroupCommitted
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
