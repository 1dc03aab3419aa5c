"""The engine worker: one rollout engine attached to the daemon, executing resize operations.

Each op is one async method taking the daemon's `OpRequest` and returning a short detail
(raising reports the op failed); `handlers()` maps op kinds to them for
`WorkerClient.on_all`. The rollout side of a resize (DESIGN.md §5):

| op      | rollout -> training (engine is the source) | training -> rollout (engine is the destination) |
|---------|---------------------------------------------|--------------------------------------------------|
| drain   | stop admitting; hand requests over          |                                                  |
| release | GPU: sleep(level); CPU: shut down           |                                                  |
| join    |                                             | GPU: wake_up; CPU: start                         |
| restore |                                             | reload the current policy version                |
| commit  | leaves the router (no-op if drained)        | admitted by the router                           |
| resume  | undo drain: admitted again                  |                                                  |
| reclaim | undo release: wake/start + reload           |                                                  |
| evict   |                                             | undo join: leave the router, sleep/shut down     |

A loan (`op.plan` LOAN: lent to the other stage until the step boundary; RETURN: its way
home) is drain, release and join with no restore or commit, and takes the cheap path. Both
ways: an engine lent to the training step, and the engine on a trainer's device when that
trainer is lent to the rollout (verl's hybrid replicas; the trainer's side is
backends/torch/lending.py):

| op (plan)              | what the engine does                                                   |
|------------------------|------------------------------------------------------------------------|
| drain (LOAN or RETURN) | as for a resize: admit nothing more, near-done requests finish, the rest move |
| release (LOAN, RETURN) | `engine.lend()`: GPU sleep; CPU pause (loaded, admitting nothing, CPU unused) |
| join (RETURN or LOAN)  | resume (or wake/start), load the current policy version, admitted     |
| reclaim                | undo release: resume and bring the weights up to date                 |
| evict (RETURN or LOAN) | undo join: leave the router and pause again (the device stays lent)   |

With `keep_loaded=True` (for CPU devices, which are short of CPU time, not memory) a resize
takes the loan's cheap path too: release and evict pause the engine instead of shutting it
down, and the way back (join or reclaim, then restore and commit as for any resize) resumes it
and reloads the current policy version, so it never serves stale weights. A dead or stopped
engine is released (and later started) as without the option.

A regroup (`op.plan` REGROUP: rollout devices form engines of another size, issue 22) is
the same five ops on the engine workers of the devices, each op naming in `op.engine` the
engine the worker serves in once it is done (empty: one of its own device). Release and evict
shut the engine down (a vLLM engine cannot change its number of ranks while it runs); join,
reclaim and resume start it shaped as `op.engine` says (tensor parallelism `len(op.engine)`,
one rank per device, bound to the device's core where `device_cores` says which) on the
worker whose device is the engine's first, and restore loads the current policy version on
every rank (each takes its slice of the published weights). The other devices' workers hold
nothing while that engine serves (their answers say `released`), whatever op reaches them.

Every op is idempotent: a repeated op finds the work done and says so. The worker also
reports its engine's per-sample progress and, once the step's queue holds nothing for it,
`queue_empty` (running requests and an upper bound on their tokens left; again with running
0 once idle), which is what the daemon lends on. It watches the engine's health: a dead engine
(EngineDeadError) or one that misses `missed_heartbeats` pings in a row, with no output for
any request meanwhile, is reported lost, its requests are re-placed by the router, and the
worker stops heartbeating to the daemon so that the daemon marks it lost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from dynaresized.backends.vllm.engine import EngineState, RolloutEngine
from dynaresized.backends.vllm.ledger import SampleResult
from dynaresized.backends.vllm.router import RequestRouter, StepResult
from dynaresized.client import op_handlers
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, StepTiming

log = structlog.get_logger("dynaresized.backends.vllm")

OpHandler = Callable[[Any], Awaitable[str]]
_LOANS = (PlanKind.LOAN, PlanKind.RETURN)  # ops of a loan or its way home: no restore or commit follows


class Progress(msgspec.Struct, frozen=True):
    """What this engine did in a step: `done` of the step's `total` samples, `tokens` generated."""

    step: int
    done: int
    total: int
    tokens: int


class QueueEmptyReport(msgspec.Struct, frozen=True):
    """What `queue_empty` tells the daemon: no queued request of `step` is left for this engine."""

    step: int
    running: int
    tokens_left: int


class OpMismatch(ValueError):
    """An op that is not for this worker (wrong device or direction)."""


class EngineWorker:
    """One engine's worker: executes ops on it, reports its progress, watches its health."""

    def __init__(
        self,
        engine: RolloutEngine,
        router: RequestRouter,
        devices: tuple[str, ...],
        *,
        worker_id: str | None = None,
        heartbeat_interval_s: float = 1.0,
        missed_heartbeats: int = 3,
        drain_timeout_s: float | None = None,
        keep_loaded: bool = False,
        device_cores: dict[str, int] | None = None,
        return_hold_s: float = 30.0,
    ) -> None:
        if not devices:
            raise ValueError(f"engine {engine.engine_id}: a worker needs at least one device")
        if heartbeat_interval_s <= 0 or missed_heartbeats < 1:
            raise ValueError("heartbeat_interval_s must be > 0 and missed_heartbeats >= 1")
        self.engine = engine
        self.router = router
        self.devices = tuple(devices)
        self.worker_id = worker_id or engine.engine_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.missed_heartbeats = missed_heartbeats
        self.drain_timeout_s = drain_timeout_s
        self.keep_loaded = keep_loaded
        self.return_hold_s = return_hold_s
        """Coming home from a loan, at most this long the router holds the engine's share of
        the step (`RequestRouter.expect`); 0: never held."""
        self.device_cores = dict(device_cores or {})  # CPU: the core of each device, for a wide engine's ranks
        self.runs: tuple[str, ...] = ()  # the devices of the wide engine this worker's engine is shaped as (): its own
        self.lost_reason: str | None = None
        self.progress = Progress(step=-1, done=0, total=0, tokens=0)
        self.client: Any = None  # a dynaresized.client.WorkerClient once attached
        self._queue_empty: deque[QueueEmptyReport] = deque()  # to send, in order
        self._reports_waiting = asyncio.Event()  # progress changed or a queue_empty is waiting
        self._tasks: list[asyncio.Task[None]] = []
        self._reporter: asyncio.Task[None] | None = None
        router.add(engine)
        router.on_sample(self._sample_done)
        router.on_step_start(self._step_started)
        router.on_dry(self._ran_dry)
        router.on_lost(self._engine_lost)

    # -- ops -------------------------------------------------------------------------------
    def handlers(self) -> dict[OpKind, OpHandler]:
        return op_handlers(self)

    def _check(self, op: Any, *, leaving: bool) -> None:
        """The op must name this worker's device, and move it the way this op kind can."""
        if not set(self.devices) & set(op.devices):
            raise OpMismatch(
                f"{op.kind.value} {op.op_id} is for devices {list(op.devices)}, "
                f"but worker {self.worker_id} owns {list(self.devices)}"
            )
        if leaving and op.from_pool is not Pool.ROLLOUT:
            raise OpMismatch(
                f"{op.kind.value} {op.op_id} moves {op.from_pool.value}->{op.to_pool.value}; a rollout "
                f"engine only does {op.kind.value} when its device leaves the rollout pool"
            )
        if not leaving and op.to_pool is not Pool.ROLLOUT:
            raise OpMismatch(
                f"{op.kind.value} {op.op_id} moves {op.from_pool.value}->{op.to_pool.value}; a rollout "
                f"engine only does {op.kind.value} when its device joins the rollout pool"
            )

    def _follows(self, op: Any) -> bool:
        """The op says this worker's device serves in an engine another device's worker runs."""
        engine = tuple(getattr(op, "engine", ()))
        return bool(engine) and engine[0] not in self.devices

    async def _stop_out(self) -> float | None:
        """Out of the router and stopped (a regroup's engines, which cannot change their ranks
        while they run): the seconds the stop took, None if it was stopped already."""
        if self.engine.engine_id in self.router.admitted:
            await self.router.drain(self.engine.engine_id, timeout_s=0.0)
        if self.engine.state is EngineState.STOPPED:
            return None
        return await self.engine.stop()

    async def _follow(self, op: Any) -> str:
        """Hold nothing: the device serves in the engine `op.engine`'s first device's worker runs."""
        seconds = await self._stop_out()
        stopped = "" if seconds is None else f"stopped {self.engine.engine_id} in {seconds:.3f}s; "
        return f"{stopped}{self.devices[0]} serves in the TP-{len(op.engine)} engine [{', '.join(op.engine)}]"

    def _tp(self) -> str:
        """", TP-k" for an engine of several ranks, "" for one of one."""
        tp = self.engine.config.tensor_parallel_size
        return f", TP-{tp}" if tp > 1 else ""

    async def _shape(self, op: Any) -> str:
        """Shape the engine as `op.engine` says before it starts: its tensor parallelism, and
        each rank's core (stopping it first if it runs in another shape)."""
        want = tuple(getattr(op, "engine", ()))
        if want == self.runs:
            return ""
        await self._stop_out()
        cores = tuple(self.device_cores[d] for d in want) if want and all(
            d in self.device_cores for d in want) else ()
        self.engine.reconfigure(msgspec.structs.replace(self.engine.config, tensor_parallel_size=max(len(want), 1),
                                                        cpu_cores=cores))
        self.runs = want
        return f"; shaped as TP-{max(len(want), 1)} over [{', '.join(want or self.devices)}]"

    async def drain(self, op: Any) -> str:
        self._check(op, leaving=True)
        if self.engine.engine_id not in self.router.admitted:
            return f"{self.engine.engine_id} already out of the pool"
        timeout = self.drain_timeout_s if self.drain_timeout_s is not None else max(op.timeout_s / 2, 0.0)
        report = await self.router.drain(self.engine.engine_id, timeout_s=timeout)
        return (
            f"drained {self.engine.engine_id} in {report.seconds:.3f}s: "
            f"{report.handed_over} handed over, {report.finished} finished here"
        )

    async def release(self, op: Any) -> str:
        self._check(op, leaving=True)
        if self.engine.engine_id in self.router.admitted:
            raise RuntimeError(f"release before drain: {self.engine.engine_id} is still admitting samples")
        if op.plan is PlanKind.REGROUP:  # a new engine shape needs a new engine
            seconds = await self._stop_out()
            if seconds is None:
                return f"{self.engine.engine_id} already stopped"
            return f"stopped {self.engine.engine_id} for a regroup in {seconds:.3f}s"
        if op.plan in _LOANS or self._stays_loaded():
            return await self._lend()
        # a resize takes the device for good: a paused (lent) engine is shut down too
        if self.engine.state in (EngineState.STOPPED, EngineState.SLEEPING):
            return f"{self.engine.engine_id} already released ({self.engine.state.value})"
        seconds = await self.engine.release()
        return f"released {self.engine.engine_id} ({self.engine.state.value}) in {seconds:.3f}s"

    def _stays_loaded(self) -> bool:
        """A resize away from rollout pauses the engine instead of shutting it down
        (`keep_loaded`), unless it is dead or already down: then there is nothing to keep."""
        return self.keep_loaded and self.engine.state in (EngineState.RUNNING, EngineState.PAUSED)

    async def _lend(self) -> str:
        if self.engine.state in (EngineState.STOPPED, EngineState.SLEEPING, EngineState.PAUSED):
            return f"{self.engine.engine_id} already released ({self.engine.state.value})"
        seconds = await self.engine.lend()
        return f"lent {self.engine.engine_id} ({self.engine.state.value}) in {seconds:.3f}s"

    async def join(self, op: Any) -> str:
        self._check(op, leaving=False)
        if self._follows(op):
            return await self._follow(op)
        if op.plan in _LOANS:
            return await self._start_serving(op.plan)
        shaped = await self._shape(op)
        if self.engine.state is EngineState.RUNNING:
            return f"{self.engine.engine_id} already running"
        seconds = await self.engine.join()
        self.lost_reason = None
        return f"{self.engine.engine_id} up ({self.engine.device_type.value}{self._tp()}) in {seconds:.3f}s{shaped}"

    async def _start_serving(self, plan: PlanKind) -> str:
        """A loan's way home, or a trainer's device lent to the rollout: no restore or commit
        follows, so join does all three: resume (or wake, or start) the engine, bring it to the
        current policy version, admit it."""
        how = "home" if plan is PlanKind.RETURN else "lent to the rollout"
        if self.engine.engine_id in self.router.admitted:
            return f"{self.engine.engine_id} already {how} and admitting"
        was = self.engine.state.value
        if plan is PlanKind.RETURN:  # the step's own engine: the router holds its share until it is in
            self.router.expect(self.engine.engine_id, within_s=self.return_hold_s)
        try:
            seconds, restored = await self._start_at_current_version()
            await self.router.admit(self.engine.engine_id)
        except BaseException:
            self.router.unexpect(self.engine.engine_id)
            raise
        return f"{self.engine.engine_id} {how} (it was {was}) in {seconds:.3f}s; {restored}; admitting"

    async def restore(self, op: Any) -> str:
        self._check(op, leaving=False)
        if self._follows(op):
            return await self._follow(op)
        return await self._restore()

    async def _restore(self) -> str:
        target = self.router.version if self.router.version is not None else self.router.weights.latest()
        if target is None:
            return f"{self.engine.engine_id} keeps its base weights: no policy version published yet"
        if self.engine.loaded_version == target:
            return f"{self.engine.engine_id} already at policy version {target}"
        seconds = await self.engine.reload(target, self.router.weights.path(target))
        return f"{self.engine.engine_id} reloaded policy version {target} in {seconds:.3f}s"

    async def commit(self, op: Any) -> str:
        """The pools switch: this engine is admitted iff one of its devices is in the rollout pool.

        Commit goes to every worker of the new topology, not only to those on the moved devices.
        """
        if not set(self.devices) & (set(op.rollout) | set(op.training)):
            raise OpMismatch(
                f"commit {op.op_id} places neither pool on worker {self.worker_id}'s devices {list(self.devices)}"
            )
        if set(self.devices) & set(op.rollout):
            if self._follows(op):
                return await self._follow(op)
            if self.engine.engine_id in self.router.admitted:
                return f"{self.engine.engine_id} already in the pool"
            revived = await self._revive(op)
            await self.router.admit(self.engine.engine_id)
            return f"{self.engine.engine_id} admitted at policy version {self.engine.loaded_version}{revived}"
        if self.engine.engine_id in self.router.admitted:
            raise RuntimeError(
                f"commit puts {list(self.devices)} outside the rollout pool, but {self.engine.engine_id} "
                "was never drained"
            )
        return f"{self.engine.engine_id} out of the rollout pool"

    async def resume(self, op: Any) -> str:
        """Undo drain: the engine (still loaded) takes samples again."""
        self._check(op, leaving=True)
        if self._follows(op):
            return await self._follow(op)
        if self.engine.engine_id in self.router.admitted and tuple(op.engine) == self.runs:
            return f"{self.engine.engine_id} already admitting"
        revived = await self._revive(op)
        await self.router.admit(self.engine.engine_id)
        return f"{self.engine.engine_id} admitting again{revived}"

    async def _revive(self, op: Any = None) -> str:
        """Before the engine takes samples again: restart it if it died (or was stopped) in the
        meantime, at the current policy version. An undo or a commit that finds its engine dead
        leaves it serving rather than failing, which would leave the daemon degraded."""
        if self.engine.state is EngineState.RUNNING and (op is None or tuple(op.engine) == self.runs):
            return ""
        was = self.engine.state.value
        seconds, restored = await self._start_at_current_version(op)
        return f" (it was {was}: restarted in {seconds:.3f}s; {restored})"

    async def _start_at_current_version(self, op: Any = None) -> tuple[float, str]:
        """Wake or (re)start the engine (shaped as `op.engine` says) and load the current policy
        version: (seconds, detail)."""
        if op is not None:
            await self._shape(op)
        seconds = await self.engine.join()
        self.lost_reason = None
        return seconds, await self._restore()

    async def reclaim(self, op: Any) -> str:
        """Undo release: wake or restart the engine and bring its weights up to date."""
        self._check(op, leaving=True)
        if self._follows(op):
            return await self._follow(op)
        seconds, restored = await self._start_at_current_version(op)
        return f"{self.engine.engine_id} reclaimed in {seconds:.3f}s{self._tp()}; {restored}"

    async def evict(self, op: Any) -> str:
        """Undo join: the engine gives the device back (a loan's failed way home: lent again)."""
        self._check(op, leaving=False)
        if self.engine.engine_id in self.router.admitted:
            await self.router.drain(self.engine.engine_id, timeout_s=0.0)
        if op.plan is PlanKind.REGROUP:  # the new engine goes: reclaim starts the old one
            seconds = await self._stop_out()
            return f"evicted {self.engine.engine_id} (stopped) in {seconds or 0.0:.3f}s"
        if op.plan in _LOANS or self._stays_loaded():
            return await self._lend()
        if self.engine.state in (EngineState.STOPPED, EngineState.SLEEPING):
            return f"{self.engine.engine_id} already released"
        seconds = await self.engine.release()
        return f"evicted {self.engine.engine_id} ({self.engine.state.value}) in {seconds:.3f}s"

    async def recover(self) -> str:
        """Bring a lost engine back: restart, reload the current version, admit it again.

        The daemon learns about it when the worker attaches again with a fresh client.
        """
        seconds = await self.engine.join()
        restored = await self._restore()
        await self.router.admit(self.engine.engine_id)
        self.lost_reason = None
        return f"{self.engine.engine_id} recovered in {seconds:.3f}s; {restored}"

    def actual(self) -> ActualState:
        """What this engine really does, for the daemon's reconciliation: admitting samples
        (serving), loaded but admitting nothing (drained), or paused/asleep/stopped/dead
        (released: a paused engine holds memory but leaves the device's CPU to the trainer)."""
        state = self.engine.state
        if self.engine.engine_id in self.router.admitted and state is EngineState.RUNNING:
            holding = Holding.SERVING
        elif state is EngineState.RUNNING:
            holding = Holding.DRAINED
        else:
            holding = Holding.RELEASED
        return ActualState(holding=holding, engine=self.runs if state is EngineState.RUNNING else (),
                           detail=f"engine {state.value}" + (f", lost: {self.lost_reason}" if self.lost_reason else ""))

    # -- reporting ---------------------------------------------------------------------------
    def _step_started(self, step: int, total: int) -> None:
        """An admitted engine says at once that it has done none of the step's samples yet: what
        verl's rule reads after a training step (the next batch's samples done) is then known
        before the first sample finishes."""
        if self.engine.engine_id in self.router.admitted:
            self.progress = Progress(step=step, done=0, total=total, tokens=0)
            self._reports_waiting.set()

    def _sample_done(self, result: SampleResult, total: int) -> None:
        if result.engine_id != self.engine.engine_id:
            return
        p = self.progress
        if p.step != result.step:
            p = Progress(step=result.step, done=0, total=total, tokens=0)
        self.progress = Progress(p.step, p.done + 1, total, p.tokens + len(result.token_ids))
        self._reports_waiting.set()

    def _ran_dry(self, engine_id: str, step: int, running: int, tokens_left: int) -> None:
        if engine_id != self.engine.engine_id or self.client is None:
            return  # nobody to tell: a detached worker's daemon lends nothing
        self._queue_empty.append(QueueEmptyReport(step, running, tokens_left))
        self._reports_waiting.set()

    async def report_step(self, result: StepResult, train_s: float = 0.0) -> StepTiming:
        """Send a step's timing to the daemon; one party per step should do this."""
        timing = result.timing(train_s=train_s)
        if self.client is not None:
            await self.client.report_step(timing)
        return timing

    async def _report(self, client: Any) -> None:
        """Send the latest progress whenever it changed (bursts coalesce into one report), then
        every queue_empty in order: an engine's last progress goes out before its idle report."""
        sent = self.progress
        while True:
            await self._reports_waiting.wait()
            self._reports_waiting.clear()
            p = self.progress
            if p != sent:
                await client.report_progress(p.step, p.done, p.total, p.tokens)
                sent = p
            while self._queue_empty:
                q = self._queue_empty.popleft()
                await client.report_queue_empty(q.step, q.running, q.tokens_left)

    # -- health ------------------------------------------------------------------------------
    def _engine_lost(self, engine_id: str, reason: str) -> None:
        if engine_id != self.engine.engine_id or self.lost_reason is not None:
            return
        self.lost_reason = reason
        log.error("engine lost", engine=engine_id, worker=self.worker_id, reason=reason)
        if self.client is not None:
            # Stop heartbeating without a goodbye: the daemon marks the worker LOST (it may come back).
            client, self.client = self.client, None
            if self._reporter is not None:
                self._reporter.cancel()
                self._tasks.append(self._reporter)
                self._reporter = None
            self._tasks.append(asyncio.create_task(client.close(say_bye=False), name=f"{self.worker_id}-lost"))

    async def _watch(self) -> None:
        missed = 0
        starts = self.engine.starts
        while True:
            outputs = self.engine.outputs
            await asyncio.sleep(self.heartbeat_interval_s)
            if self.engine.starts != starts:  # a fresh engine: count its misses from zero
                starts, missed = self.engine.starts, 0
            if self.engine.changing:
                missed = 0  # starting, stopping or reloading: silence is expected
                continue
            if self.engine.state not in (EngineState.RUNNING, EngineState.PAUSED) and not (
                self.engine.state is EngineState.DEAD and self.lost_reason is None
            ):
                missed = 0  # stopped, asleep, or already reported lost: nothing to watch (a lent,
                # paused engine is watched: it must come back at the step boundary)
                continue
            if await self.engine.ping(self.heartbeat_interval_s) or self.engine.outputs != outputs:
                # A ping waits behind the engine's model step: on a loaded machine a busy engine
                # answers late, but its requests still make progress, and that is alive too.
                missed = 0
                continue
            missed += 1
            if self.engine.state is EngineState.DEAD or missed >= self.missed_heartbeats:
                why = "engine died" if self.engine.state is EngineState.DEAD else f"missed {missed} heartbeats"
                self.router.lose(self.engine.engine_id, why)
                self._engine_lost(self.engine.engine_id, why)  # also when it was not admitted
                missed = 0

    async def start(self) -> None:
        """Start watching the engine's health."""
        self._tasks.append(asyncio.create_task(self._watch(), name=f"{self.worker_id}-watch"))

    async def attach(self, client: Any) -> None:
        """Attach to the daemon through a `WorkerClient`: its ops come here, progress goes there."""
        if self.client is not None:
            raise RuntimeError(f"worker {self.worker_id} is already attached; detach first")
        if tuple(client.devices) != self.devices:
            raise ValueError(f"client devices {list(client.devices)} differ from the worker's {list(self.devices)}")
        client.on_all(self.handlers())
        if client.actual is None:
            client.actual = self.actual
        await client.start()
        self.client = client
        self._queue_empty.clear()  # left over from an earlier attachment, whose reporter was cancelled
        self._reporter = asyncio.create_task(self._report(client), name=f"{self.worker_id}-progress")

    async def detach(self, reason: str = "engine worker detaching") -> None:
        """Say goodbye to the daemon; the engine keeps running."""
        client, self.client = self.client, None
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.cancel()
            outcome = (await asyncio.gather(reporter, return_exceptions=True))[0]
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                log.error("progress reporting had failed", worker=self.worker_id, error=repr(outcome))
        if client is not None:
            await client.close(reason=reason)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                log.error("worker task ended with an error", worker=self.worker_id, error=repr(outcome))
        await self.detach("engine worker closing")
