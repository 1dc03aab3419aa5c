"""Group commit: the facts of stepped batches are appended to the log in one transaction from a
thread, and only then are their metrics, log lines, replies and commands let out, in order.
Facts are durable before anything they imply leaves the daemon.

On a full disk (`DiskFull`: the append was rolled back whole) the batches wait, in order, and
are tried again every `DISK_RETRY_S`; meanwhile the cluster steps nothing that writes a fact or
sends an op (`Cluster.disk_full`), and what writes nothing (heartbeat answers, status) goes out
at once. When the append goes through, everything resumes by itself."""

from __future__ import annotations

import asyncio
import concurrent.futures

import structlog

from dynaresized.core import facts as f
from dynaresized.core.state import ClusterState
from dynaresized.daemon.cluster import Cluster
from dynaresized.daemon.endpoints import Endpoints, Outbox
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.status import observe
from dynaresized.store import DiskFull, FactLog

log = structlog.get_logger("dynaresized")

_PENDING_MAX = 16  # stepped batches awaiting the log before the reactor waits for it (backpressure)
DISK_RETRY_S = 1.0  # how often a write that found the disk full is tried again


class GroupCommit:
    def __init__(self, metrics: Metrics, endpoints: Endpoints, cluster: Cluster) -> None:
        self.metrics = metrics
        self.endpoints = endpoints
        self.cluster = cluster  # told when the disk is full, and when it is not
        self._durable: ClusterState | None = None  # the state as of the last facts written
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
        if self.cluster.disk_full and not facts:
            # Nothing to write (the cluster steps nothing else meanwhile): heartbeat answers and
            # status replies must not wait behind the batches the full disk holds back.
            self.endpoints.send_replies([outbox])
            self.metrics.flush_messages()
            return
        self._pending.append((facts, state, outbox))
        self._pending_changed.set()
        while len(self._pending) > _PENDING_MAX:  # the log is the bottleneck: let it catch up
            await self._progress()

    async def flush(self) -> None:
        """Until everything queued is durable and sent, or the disk is full: then what waits is
        dropped, and nothing it implied was sent (as after a crash before the write)."""
        while self._pending or self._writing:
            if self.cluster.disk_full and not self._writing:
                log.error("stopping with facts the full disk kept out of the log: nothing they imply was sent",
                          batches=len(self._pending), facts=sum(len(b[0]) for b in self._pending))
                return
            await self._progress()

    def held(self, facts: list[f.Fact], state: ClusterState) -> None:
        """Start-up's facts that found the disk full: written, in order, once there is space."""
        self._pending.append((facts, state, []))

    def durable(self, state: ClusterState, problem: str) -> None:
        """Start-up's facts are written (`problem`: why the snapshot after them was not)."""
        self._durable = state
        self.full(problem)

    async def _progress(self) -> None:
        self._pending_changed.clear()
        await self._pending_changed.wait()

    async def run(self) -> None:
        """Append what the reactor has stepped, durably and in order; only then send the replies
        and commands it implies. Facts are durable before anything they imply leaves."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if not self.cluster.disk_full:
                    await self._progress()
                    continue
                # the facts are written but a snapshot (or compaction) found the disk full: again
                await asyncio.sleep(DISK_RETRY_S)
                if self._durable is not None and self.factlog is not None:
                    self.full(await loop.run_in_executor(self._writer, self._snapshot, self._durable))
                continue
            batches, self._pending = self._pending, []
            self._writing = True
            facts = [fact for batch_facts, _, _ in batches for fact in batch_facts]
            problem = ""
            if facts:
                # Any other failed append ends this task, and so the daemon: nothing it implied was sent.
                try:
                    problem = await loop.run_in_executor(self._writer, self.persist, facts, batches[-1][1])
                except DiskFull as exc:  # rolled back whole: the same batches, in order, later
                    self._pending = batches + self._pending
                    self._writing = False
                    self.full(str(exc))
                    self._pending_changed.set()
                    await asyncio.sleep(DISK_RETRY_S)
                    continue
                self._durable = batches[-1][1]
            self._writing = False
            self.full(problem)
            for batch_facts, state, _ in batches:
                if batch_facts:
                    observe(self.metrics, batch_facts, state)
            self.endpoints.send_replies([outbox for _, _, outbox in batches])
            self.metrics.flush_messages()
            self._pending_changed.set()

    def persist(self, facts: list[f.Fact], state: ClusterState) -> str:
        """Append facts durably (and snapshot now and then). Runs in the writer thread. Raises
        DiskFull where the append found the disk full (nothing of it written); returns why the
        snapshot after it could not be written ("" if it could): the facts are durable then."""
        assert self.factlog is not None
        self.factlog.append(facts)
        return self._snapshot(state)

    def _snapshot(self, state: ClusterState) -> str:
        assert self.factlog is not None
        try:
            self.factlog.maybe_snapshot(state)
        except DiskFull as exc:
            return str(exc)
        return ""

    def full(self, problem: str) -> None:
        """Say when the disk fills (and the cluster stops starting transitions), and when it has
        space again (and everything resumes)."""
        if problem and not self.cluster.disk_full:
            log.error("the disk under the event log is full: no transition starts until there is space; heartbeats "
                      "and status go on, and what waits is written, in order, once there is", error=problem)
        elif not problem and self.cluster.disk_full:
            log.warning("the event log is written again: transitions resume")
        self.cluster.disk_full = problem
        self.metrics.disk_full.set(1 if problem else 0)

    def stop(self) -> None:
        """Let the writer thread finish what it was given."""
        self._writer.shutdown(wait=True)

    def close_log(self) -> None:
        if self.factlog is not None:
            self.factlog.close()
