"""Group commit: the facts of stepped batches are appended to the log in one transaction from a
thread, and only then are their metrics, log lines, replies and commands let out, in order.
Facts are durable before anything they imply leaves the daemon."""

from __future__ import annotations

import asyncio
import concurrent.futures

from dynaresized.core import facts as f
from dynaresized.core.state import ClusterState
from dynaresized.daemon.endpoints import Endpoints, Outbox
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.status import observe
from dynaresized.store import FactLog

_PENDING_MAX = 16  # stepped batches awaiting the log before the reactor waits for it (backpressure)


class GroupCommit:
    def __init__(self, metrics: Metrics, endpoints: Endpoints) -> None:
        self.metrics = metrics
        self.endpoints = endpoints
        self.factlog: FactLog | None = None
        # The reactor queues each stepped batch (its facts, the state after it and the replies and
        # commands it implies); the log writer appends everything queued in one transaction from a
        # thread (SQLite releases the GIL while it writes and fsyncs), then sends what those facts
        # imply. The reactor steps on meanwhile, at most _PENDING_MAX ahead.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynaresized-log")
        self._pending: list[tuple[list[f.Fact], ClusterState, Outbox]] = []
        self._pending_changed = asyncio.Event()
        self._writing = False

    async def add(self, facts: list[f.Fact], state: ClusterState, outbox: Outbox) -> None:
        """Queue a stepped batch; waits while the log is _PENDING_MAX batches behind."""
        self._pending.append((facts, state, outbox))
        self._pending_changed.set()
        while len(self._pending) > _PENDING_MAX:  # the log is the bottleneck: let it catch up
            await self._progress()

    async def flush(self) -> None:
        """Until everything queued is durable and sent."""
        while self._pending or self._writing:
            await self._progress()

    async def _progress(self) -> None:
        self._pending_changed.clear()
        await self._pending_changed.wait()

    async def run(self) -> None:
        """Append what the reactor has stepped, durably and in order; only then send the replies
        and commands it implies. Facts are durable before anything they imply leaves."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                await self._progress()
                continue
            batches, self._pending = self._pending, []
            self._writing = True
            facts = [fact for batch_facts, _, _ in batches for fact in batch_facts]
            if facts:
                # An append that fails ends this task, and so the daemon: nothing it implied was sent.
                await loop.run_in_executor(self._writer, self.persist, facts, batches[-1][1])
            self._writing = False
            for batch_facts, state, _ in batches:
                if batch_facts:
                    observe(self.metrics, batch_facts, state)
            self.endpoints.send_replies([outbox for _, _, outbox in batches])
            self.metrics.flush_messages()
            self._pending_changed.set()

    def persist(self, facts: list[f.Fact], state: ClusterState) -> None:
        """Append facts durably (and snapshot now and then). Runs in the writer thread."""
        assert self.factlog is not None
        self.factlog.append(facts)
        self.factlog.maybe_snapshot(state)

    def stop(self) -> None:
        """Let the writer thread finish what it was given."""
        self._writer.shutdown(wait=True)

    def close_log(self) -> None:
        if self.factlog is not None:
            self.factlog.close()
