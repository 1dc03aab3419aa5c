"""Inputs to the core. The daemon shell builds them from wire messages, timers and CLI
requests; the simulator builds them from virtual time. `at` is the daemon's clock (seconds),
never a client's: a client's timestamps are data, not time."""

from __future__ import annotations

from typing import Any

import msgspec

from dynaresized.domain import ActualState, DeviceId, Pool, Split, StepTiming, WorkerId, WorkerKind


class Event(msgspec.Struct, frozen=True, kw_only=True):
    at: float


class Configure(Event, frozen=True):
    """The device inventory, given once when the log is empty."""

    devices: tuple[DeviceId, ...]
    pools: tuple[Pool, ...]  # initial pool of each device, aligned with `devices`
    candidates: tuple[Split, ...] = ()


class DaemonStarted(Event, frozen=True):
    """The daemon (re)started on an existing log: a resize in flight must be reconciled."""


class Tick(Event, frozen=True):
    """Time passes: heartbeat and operation deadlines are checked."""


class WorkerHello(Event, frozen=True):
    worker_id: WorkerId
    kind: WorkerKind
    devices: tuple[DeviceId, ...]
    process: str = ""  # a new value for a live worker means its process restarted
    actual: ActualState | None = None  # what the worker says it holds; None: it does not say
    previous_connected: bool = False
    """The shell found the live registration's own connection still open: a second process
    under the same id is a duplicate, not a restart."""
    registered_here: bool = False
    """The shell holds this process's registration from this daemon start (its token): a
    hello from it repeats that registration (after a restart of the daemon it is a new one)."""
    secret_sha256: str = ""
    """SHA-256 (hex) of the hello's `secret` ("" if none): a hello naming a live registration's
    process must carry that registration's secret (the shell hashes it; the core never sees it)."""


class StateReported(Event, frozen=True):
    """A worker's account of its actual state (asked for, or sent when it changed)."""

    worker_id: WorkerId
    actual: ActualState


class Heartbeat(Event, frozen=True):
    worker_id: WorkerId


class WorkerBye(Event, frozen=True):
    worker_id: WorkerId


class StepReported(Event, frozen=True):
    worker_id: WorkerId
    timing: StepTiming


class ProgressReported(Event, frozen=True):
    worker_id: WorkerId
    step: int
    done: int
    total: int
    tokens: int = 0


class OpReported(Event, frozen=True):
    worker_id: WorkerId
    op_id: str
    ok: bool
    detail: str = ""
    actual: ActualState | None = None  # the worker's state after the op, when it says


class ResizeRequested(Event, frozen=True):
    """An operator forces a split (`dynaresized resize`); hysteresis guards are skipped,
    safety checks are not."""

    target: Split
    requested_by: str = "operator"
    reason: str = ""


class RegroupRequested(Event, frozen=True):
    """An operator regroups rollout devices into engines of `tp` devices each
    (`dynaresized regroup`): two TP-1 engines become one TP-2 engine, or back with `tp` 1."""

    devices: tuple[DeviceId, ...]
    tp: int
    requested_by: str = "operator"
    reason: str = ""


class PauseRequested(Event, frozen=True):
    requested_by: str = "operator"
    reason: str = ""


class ResumeRequested(Event, frozen=True):
    requested_by: str = "operator"


class ConfigReloaded(Event, frozen=True):
    """SIGHUP applied: [policy] and [guards] were re-read (see facts.ConfigReloaded)."""

    policy: str
    options: dict[str, Any] = {}
    guards_changed: dict[str, tuple[Any, Any]] = {}
    restart_only: tuple[str, ...] = ()


class ReloadRefused(Event, frozen=True):
    """SIGHUP refused: the running policy and guards are kept."""

    reason: str


class ShutdownRequested(Event, frozen=True):
    """SIGTERM: start no new resize; the one in flight finishes or rolls back."""


class AbortRequested(Event, frozen=True):
    """Roll back the resize in flight now (drain timeout, operator). A resize already
    committing is finished instead: commit is the point of no return."""

    requested_by: str = "operator"
    reason: str = ""


class EngineQueueEmpty(Event, frozen=True):
    """A rollout engine has no queued request of rollout step `step` left: `running` requests
    still decode, about `tokens_left` tokens to go (the engine's estimate). `running == 0`
    means the engine is idle for the rest of the step: it may be lent."""

    worker_id: WorkerId
    step: int
    running: int = 0
    tokens_left: int = 0


class MiniBatchDone(Event, frozen=True):
    """A trainer finished mini-batch `done` of `total` (an optimizer step) of training step
    `step`: the next mini-batch boundary is where a lent device can join. `done` 0 says the
    step begins (devices its pool lent to the rollout go home); `done` and `total` both 0 say
    the trainer has nothing to train until the rollout of step `step` is done (its devices
    may be lent to that rollout)."""

    worker_id: WorkerId
    step: int
    done: int
    total: int
