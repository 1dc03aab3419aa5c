"""What the core's transition modules share: one step's transaction (`Tx`), the errors that
refuse an event, the commands a step returns, and what a transition may ask of its core
(`CoreLike`). Decides nothing; `reject` emits the ProposalRejected of the module that rejects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.config import CoreConfig
from dynaresized.core.policy import ObservedView, Policy
from dynaresized.core.state import ClusterState, Phase, mutate
from dynaresized.domain import DeviceId, OpSpec, PlanKind, Split, Worker, WorkerStatus


class SendOp(msgspec.Struct, frozen=True):
    """Command: ask `worker_id` to perform `op`. Workers deduplicate by `op.op_id`, so a
    command re-sent after a crash is answered, not re-run."""

    worker_id: str
    resize_id: str
    op: OpSpec
    deadline: float
    training: tuple[DeviceId, ...]  # the training pool once the resize commits
    rollout: tuple[DeviceId, ...]  # the rollout pool once the resize commits
    plan: PlanKind = PlanKind.RESIZE  # a loan or its return travels as the same ops
    engine: tuple[DeviceId, ...] = ()
    """An engine worker: the devices of the engine it serves in once this sequence is done (an
    undo: the one it goes back to), when wider than its own device (it leads that engine if its
    device is the first); empty otherwise."""


class QueryState(msgspec.Struct, frozen=True):
    """Command: ask `worker_id` for its actual state (it answers with a state report)."""

    worker_id: str


Command = SendOp | QueryState


class IllegalTransition(Exception):
    def __init__(self, phase: Phase, event: ev.Event) -> None:
        self.phase = phase
        self.event = event
        super().__init__(f"event {type(event).__name__} is not accepted in phase {phase.value!r}")


class Refused(Exception):
    """The event was refused; `code` is stable for programs, `message` is for people."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class Tx:
    """One step's accumulation: facts are folded as they are emitted."""

    __slots__ = ("state", "facts", "commands")

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.facts: list[f.Fact] = []
        self.commands: list[Command] = []

    def emit(self, fact: f.Fact) -> None:
        self.state = mutate(self.state, fact)
        self.facts.append(fact)


class CoreLike(Protocol):
    """What a transition asks of the core that runs it (`machine.Core`): its configuration and
    policy, the view the policy decides on, and the end of an operation sequence, which the
    dispatch module hands to the module of the sequence's family (`machine.ENDINGS`)."""

    config: CoreConfig
    policy: Policy

    def view(self, state: ClusterState, now: float) -> ObservedView: ...

    def end_sequence(self, tx: Tx, at: float) -> None: ...


Handler = Callable[[CoreLike, Tx, ev.Event], None]


def require_worker(state: ClusterState, worker_id: str) -> Worker:
    """The live worker `worker_id`, or `Refused`: every message but a hello comes from one."""
    w = state.workers.get(worker_id)
    if w is None:
        raise Refused("unknown_worker", f"worker {worker_id!r} is not registered; send hello first")
    if w.status is not WorkerStatus.LIVE:
        raise Refused("not_registered", f"worker {worker_id!r} is {w.status.value}; send hello again")
    return w


def reject(tx: Tx, at: float, source: str, target: Split | None, guard: str, reason: str,
           proposal: PlanKind = PlanKind.RESIZE) -> None:
    """Record that `source`'s `proposal` (a resize, a loan, a regroup) did not go ahead, and why
    (`guard` names the check)."""
    tx.emit(f.ProposalRejected(at=at, source=source, target=target, guard=guard, reason=reason,
                               step=tx.state.last_step, proposal=proposal))
