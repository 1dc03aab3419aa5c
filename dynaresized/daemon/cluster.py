"""The cluster as the daemon holds it: the state in force and the core that steps it. Only the
reactor's task (and start-up) steps it; a refusal of the core becomes a `Reply`, an error for
the sender, and changes nothing."""

from __future__ import annotations

import structlog

from dynaresized import wire
from dynaresized.core import Command, Core, IllegalTransition, Refused
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.state import ClusterState
from dynaresized.domain import WorkerStatus

log = structlog.get_logger("dynaresized")


class Reply(Exception):
    def __init__(self, code: wire.ErrorCode, message: str, reason: str = "") -> None:
        self.code, self.message, self.reason = code, message, reason
        super().__init__(message)


class Cluster:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.state = ClusterState()
        # Why the event log cannot be written now ("" while it can): meanwhile only what writes no
        # fact and sends no op is stepped (heartbeats, progress), the rest is refused `disk_full`.
        self.disk_full = ""

    def step(self, event: ev.Event, facts: list[f.Fact], commands: list[Command]) -> None:
        """Step the core; a refusal becomes an error reply to the sender and changes nothing."""
        try:
            state, new_facts, new_commands = self.core.step(self.state, event)
        except Refused as exc:
            raise Reply(wire.ErrorCode.REFUSED, exc.message, exc.code) from None
        except IllegalTransition as exc:
            raise Reply(wire.ErrorCode.REFUSED, str(exc), "illegal_transition") from None
        if self.disk_full and (new_facts or new_commands):
            raise Reply(wire.ErrorCode.REFUSED, f"the disk under the event log is full, so nothing that would be "
                        f"recorded is accepted until there is space again (heartbeats and status go on): "
                        f"{self.disk_full}", "disk_full")
        self.state = state
        facts.extend(new_facts)
        commands.extend(new_commands)

    def step_quiet(self, event: ev.Event, facts: list[f.Fact], commands: list[Command]) -> None:
        try:
            self.step(event, facts, commands)
        except Reply as r:  # operator/daemon events are accepted in every phase; log if not
            if r.reason != "disk_full":  # said once, when the disk filled
                log.error("daemon event refused", event=type(event).__name__, error=r.message)

    def live_workers(self) -> int:
        return sum(1 for w in self.state.workers.values() if w.status is WorkerStatus.LIVE)
