"""The request router: places a step's samples over the engines in the rollout pool.

Samples wait in one queue per step; each admitted engine holds at most `max_inflight`
of them, so an engine that joins mid-step starts pulling work at once and one that leaves
stops. On `drain` the engine is no longer admitted; its requests that will finish soon
(at most `finish_within_tokens` tokens left) finish there, the rest are aborted and go back
to the front of the queue for the remaining engines. An engine that dies is handled the
same way, except nothing is waited for.

Hand-over drops partial outputs and regenerates the sample from scratch, with the same
request (prompt, per-sample seed, sampling parameters) and the same policy version: every
engine admitted during a step holds that step's version (the router loads it before
admitting), so the regenerated sample is a fresh draw from exactly the policy that the step
was assigned, and its tokens and log-probs come from one policy, never a prefix from one
engine glued to a suffix from another. The cost is recomputing the dropped tokens, which
`finish_within_tokens` bounds from the other side.

Every placement goes through the step's `StepLedger`; `run_step` checks it at the step
boundary and raises `LedgerError` if any sample is missing, duplicated or off-version.

An engine coming home from a loan is expected (`expect`): until it is admitted (or gives up,
or its time runs out), each admitted engine holds at most its share of the step,
ceil(samples / (admitted + expected engines)), so the one that wakes a few seconds late finds
its share still queued rather than the engines on time running all of it in batches twice as
wide (the simulator's pull router holds the same, `sim.stages.hold_share`).

Once every sample of the step has been placed, the step's queue holds nothing for anyone:
each admitted engine's `on_dry` listeners hear so once, with the requests it still runs and
an upper bound on their tokens left, and once more when its last one finished (running 0).
That is what the daemon lends an engine on. A hand-over that refills the queue makes an
engine pull work again; it is not told twice, and a loan drains it like any other engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import msgspec
import structlog

from dynaresized.backends.vllm.engine import EngineFailure, EngineState, RolloutEngine, SampleRequest
from dynaresized.backends.vllm.ledger import Attempt, LedgerSummary, SampleResult, StepLedger
from dynaresized.backends.vllm.weights import WeightStore
from dynaresized.domain import ResponseLengths, StepTiming

log = structlog.get_logger("dynaresized.backends.vllm")

SampleListener = Callable[[SampleResult, int], None]  # (result, samples in the step)
LossListener = Callable[[str, str], None]  # (engine id, reason)
DryListener = Callable[[str, int, int, int], None]  # (engine id, step, running, tokens left)
StartListener = Callable[[int, int], None]  # (step, samples in the step)


class DrainReport(msgspec.Struct, frozen=True):
    engine_id: str
    handed_over: int  # aborted here and placed again elsewhere
    finished: int  # left to finish here because they were close to done
    seconds: float  # from the drain command to no request left on the engine


class StepResult(msgspec.Struct, frozen=True):
    step: int
    policy_version: int
    samples: tuple[SampleResult, ...]
    ledger: LedgerSummary
    rollout_s: float  # from the step's start to its last sample, weight sync included
    weight_sync_s: float
    engines: tuple[str, ...]  # engines that produced at least one sample
    # engine-seconds that served the step: an engine there from the start counts until it left
    # (drained) or the step ended; one that joined mid-step (a trainer's device lent to the
    # rollout) only while it ran requests, since one that pulls a few and runs dry did not
    # serve the rest of the step (the simulator counts a lent engine the same way)
    rollout_device_s: float = 0.0
    lengths: ResponseLengths | None = None  # the samples' response tokens and the longest's pace

    def timing(self, train_s: float = 0.0, train_devices: int = 0) -> StepTiming:
        """The step's timing as the daemon takes it; the trainer side supplies `train_s`."""
        return StepTiming(
            step=self.step,
            rollout_s=self.rollout_s,
            train_s=train_s,
            weight_sync_s=self.weight_sync_s,
            rollout_devices=len(self.engines),
            train_devices=train_devices,
            samples=len(self.samples),
            response_tokens=self.ledger.response_tokens,
            rollout_device_s=self.rollout_device_s,
            lengths=self.lengths,
        )


class _Step:
    def __init__(self, ledger: StepLedger, requests: Sequence[SampleRequest]) -> None:
        self.ledger = ledger
        self.requests = {r.sample_id: r for r in requests}
        self.pending: deque[str] = deque(r.sample_id for r in requests)
        self.tasks: dict[Attempt, asyncio.Task[None]] = {}
        self.progress: dict[Attempt, int] = {}  # response tokens so far, per in-flight attempt
        self.finished = asyncio.Event()
        self.failure: BaseException | None = None
        self.told_dry: dict[str, int] = {}  # engine -> the running count its dry report said
        self.admitted_since: dict[str, float] = {}  # engine there from the step's start -> when it began
        self.joined: set[str] = set()  # engines admitted mid-step: they count while they run requests
        self.busy_since: dict[str, float] = {}  # such an engine -> since when it runs at least one
        self.device_s = 0.0  # engine-seconds that served, of intervals already closed
        self.placed_at: dict[Attempt, float] = {}  # when each attempt went to its engine
        self.decoded: dict[str, tuple[int, float]] = {}  # sample -> (response tokens, seconds on its engine)
        if not requests:
            self.finished.set()


class RequestRouter:
    """Places samples over admitted engines, hands them over on drain, re-places on loss."""

    def __init__(
        self,
        weights: WeightStore,
        *,
        max_inflight: int = 64,
        finish_within_tokens: int = 8,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if finish_within_tokens < 0:
            raise ValueError(f"finish_within_tokens must be >= 0, got {finish_within_tokens}")
        self.weights = weights
        self.max_inflight = max_inflight
        self.finish_within_tokens = finish_within_tokens
        self.engines: dict[str, RolloutEngine] = {}
        self.admitted: set[str] = set()
        self.version: int | None = None  # the policy version of the current (or last) step
        self._step: _Step | None = None
        self._membership = asyncio.Lock()  # admit vs. a step's weight sync
        self._sample_listeners: list[SampleListener] = []
        self._loss_listeners: list[LossListener] = []
        self._dry_listeners: list[DryListener] = []
        self._start_listeners: list[StartListener] = []
        self._cancelled: list[asyncio.Task[None]] = []
        self._expected: dict[str, float] = {}  # engine coming home -> until when (perf_counter) it is waited for

    # -- membership --------------------------------------------------------------------
    def add(self, engine: RolloutEngine) -> None:
        """Know an engine (not yet admitted)."""
        if engine.engine_id in self.engines and self.engines[engine.engine_id] is not engine:
            raise ValueError(f"another engine is already known as {engine.engine_id!r}")
        self.engines[engine.engine_id] = engine

    def _engine(self, engine_id: str) -> RolloutEngine:
        try:
            return self.engines[engine_id]
        except KeyError:
            raise KeyError(f"unknown engine {engine_id!r} (known: {sorted(self.engines)})") from None

    def in_flight(self, engine_id: str | None = None) -> dict[str, int]:
        """Samples of the running step in flight (on `engine_id`, or anywhere) → tokens so far."""
        step = self._step
        if step is None:
            return {}
        return {a.sample_id: step.progress.get(a, 0) for a in step.ledger.in_flight(engine_id)}

    @property
    def step_running(self) -> bool:
        return self._step is not None

    def on_sample(self, listener: SampleListener) -> None:
        self._sample_listeners.append(listener)

    def on_lost(self, listener: LossListener) -> None:
        self._loss_listeners.append(listener)

    def on_step_start(self, listener: StartListener) -> None:
        """`listener(step, samples)` when a step's samples are queued, before any is placed."""
        self._start_listeners.append(listener)

    def on_dry(self, listener: DryListener) -> None:
        """`listener(engine, step, running, tokens_left)` once the step's queue holds nothing
        for an admitted engine, and again with running 0 when that engine is idle."""
        self._dry_listeners.append(listener)

    def expect(self, engine_id: str, within_s: float) -> None:
        """`engine_id` is coming home and should be admitted within `within_s` seconds: hold its
        share of the step for it until then (or until it is admitted or `unexpect`ed)."""
        self._engine(engine_id)
        if engine_id in self.admitted or within_s <= 0:
            return
        self._expected[engine_id] = time.perf_counter() + within_s
        try:
            asyncio.get_running_loop().call_later(within_s, self._dispatch)  # the hold lapses: place again
        except RuntimeError:  # no loop: the next dispatch sees it lapsed
            pass

    def unexpect(self, engine_id: str) -> None:
        """`engine_id` is not coming after all (its wake failed): stop holding its share."""
        if self._expected.pop(engine_id, None) is not None:
            self._dispatch()

    def _share(self, step: _Step) -> int:
        """How many samples of the step an admitted engine may hold now (`max_inflight`, or its
        share while an engine coming home is expected)."""
        now = time.perf_counter()
        for engine_id in [e for e, until in self._expected.items() if until <= now or e in self.admitted]:
            del self._expected[engine_id]
        if not self._expected or not self.admitted:
            return self.max_inflight
        share = -(-len(step.requests) // (len(self.admitted) + len(self._expected)))
        return min(self.max_inflight, max(share, 1))

    async def admit(self, engine_id: str) -> float:
        """Let an engine take samples, after loading the current policy version into it.

        Returns the seconds spent reloading weights (0 if it already held the version).
        """
        engine = self._engine(engine_id)
        async with self._membership:
            if engine.state is not EngineState.RUNNING:
                raise EngineFailure(engine_id, f"cannot admit: state {engine.state.value}")
            seconds = 0.0
            target = self.version if self.version is not None else self.weights.latest()
            if target is not None and engine.loaded_version != target:
                seconds = await engine.reload(target, self.weights.path(target))
            self.admitted.add(engine_id)
            self._expected.pop(engine_id, None)
            if self._step is not None and engine_id not in self._step.admitted_since:
                self._step.joined.add(engine_id)
        log.info("engine admitted", engine=engine_id, version=engine.loaded_version)
        self._dispatch()
        return seconds

    async def drain(self, engine_id: str, *, timeout_s: float | None = None) -> DrainReport:
        """Stop admitting to an engine and empty it: near-done requests finish, the rest move.

        Requests still running on it when `timeout_s` passes are handed over as well.
        """
        engine = self._engine(engine_id)
        started = time.perf_counter()
        self._leave(engine_id)
        step = self._step
        if step is None:
            return DrainReport(engine_id, 0, 0, time.perf_counter() - started)
        staying: list[Attempt] = []
        moving: list[Attempt] = []
        for attempt in step.ledger.in_flight(engine_id):
            left = step.requests[attempt.sample_id].max_tokens - step.progress.get(attempt, 0)
            (staying if left <= self.finish_within_tokens else moving).append(attempt)
        await self._hand_over(step, engine, moving)
        finished = 0
        if staying:
            tasks = [step.tasks[a] for a in staying if a in step.tasks]
            _, late = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
            late_attempts = [a for a in staying if step.tasks.get(a) in late]
            await self._hand_over(step, engine, late_attempts)
            finished = len(staying) - len(late_attempts)
            moving += late_attempts
        # the device is free only once the aborted requests have left the engine too
        leftover = self._tasks_on(step, engine_id)
        if leftover:
            await asyncio.wait(leftover)
        report = DrainReport(engine_id, len(moving), finished, time.perf_counter() - started)
        log.info("engine drained", engine=engine_id, handed_over=report.handed_over,
                 finished=report.finished, seconds=round(report.seconds, 3))
        return report

    def _leave(self, engine_id: str) -> None:
        """The engine admits nothing more; the step counts the time it was there."""
        self.admitted.discard(engine_id)
        step = self._step
        if step is None:
            return
        now = time.perf_counter()
        for since in (step.admitted_since, step.busy_since):
            if engine_id in since:
                step.device_s += now - since.pop(engine_id)
        step.joined.discard(engine_id)

    def _tasks_on(self, step: _Step, engine_id: str) -> set[asyncio.Task[None]]:
        return {t for a, t in step.tasks.items() if a.engine_id == engine_id}

    async def _hand_over(self, step: _Step, engine: RolloutEngine, attempts: list[Attempt]) -> None:
        """Supersede the attempts, queue their samples first in line, abort them on the engine."""
        moved = [a for a in attempts if step.ledger.supersede(a, lost=False)]
        for attempt in reversed(moved):
            step.pending.appendleft(attempt.sample_id)
        self._dispatch()
        try:
            await engine.abort([a.request_id for a in moved])
        except Exception as exc:  # the samples are already re-placed; the engine is the problem
            log.warning("abort failed on draining engine", engine=engine.engine_id, error=repr(exc))
            self.lose(engine.engine_id, f"abort failed: {exc!r}")

    def lose(self, engine_id: str, reason: str) -> int:
        """An engine died or stopped answering: re-place all its samples. Returns how many."""
        engine = self._engine(engine_id)
        engine.mark_dead()
        was_admitted = engine_id in self.admitted
        self._leave(engine_id)
        moved = 0
        step = self._step
        if step is not None:
            superseded = [a for a in step.ledger.in_flight(engine_id) if step.ledger.supersede(a, lost=True)]
            moved = len(superseded)
            for attempt in superseded:
                task = step.tasks.pop(attempt, None)
                step.progress.pop(attempt, None)
                if task is not None and task is not asyncio.current_task():
                    task.cancel()
                    self._cancelled.append(task)
            for attempt in reversed(superseded):
                step.pending.appendleft(attempt.sample_id)
        if was_admitted or moved:
            log.warning("engine lost", engine=engine_id, reason=reason, replaced=moved)
            for listener in self._loss_listeners:
                listener(engine_id, reason)
        self._dispatch()
        return moved

    # -- a step ----------------------------------------------------------------------------
    async def run_step(self, step: int, policy_version: int, requests: Sequence[SampleRequest]) -> StepResult:
        """Generate every sample of a step with `policy_version`; returns when all are done."""
        if self._step is not None:
            raise RuntimeError(f"step {self._step.ledger.step} is still running; steps do not overlap")
        started = time.perf_counter()
        ledger = StepLedger(step, policy_version, [r.sample_id for r in requests])
        path = self.weights.path(policy_version)
        async with self._membership:
            self.version = policy_version
            stale = [self.engines[e] for e in sorted(self.admitted) if self.engines[e].loaded_version != policy_version]
            outcomes = await asyncio.gather(*(e.reload(policy_version, path) for e in stale), return_exceptions=True)
        for engine, outcome in zip(stale, outcomes, strict=True):
            if isinstance(outcome, EngineFailure):
                self.lose(engine.engine_id, outcome.reason)
            elif isinstance(outcome, BaseException):
                raise outcome
        weight_sync_s = time.perf_counter() - started
        current = _Step(ledger, requests)
        current.admitted_since = {e: started for e in self.admitted}
        self._step = current
        for listener in self._start_listeners:
            listener(step, len(requests))
        try:
            self._dispatch()
            await current.finished.wait()
            if current.failure is not None:
                raise current.failure
            summary = ledger.check()
        finally:
            self._step = None
            for task in current.tasks.values():
                task.cancel()
                self._cancelled.append(task)
            await self._reap()
        results = tuple(ledger.results())
        ended = time.perf_counter()
        device_s = current.device_s + sum(ended - t for t in current.admitted_since.values()) + sum(
            ended - t for t in current.busy_since.values())
        return StepResult(
            step=step,
            policy_version=policy_version,
            samples=results,
            ledger=summary,
            rollout_s=ended - started,
            weight_sync_s=weight_sync_s,
            engines=tuple(sorted({r.engine_id for r in results})),
            rollout_device_s=device_s,
            lengths=response_lengths(current.decoded.values()),
        )

    async def _reap(self) -> None:
        """Collect tasks cancelled by `lose`; an error other than the engine's death is a bug."""
        cancelled, self._cancelled = self._cancelled, []
        for outcome in await asyncio.gather(*cancelled, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError | EngineFailure
            ):
                raise outcome

    def _pick(self, step: _Step) -> str | None:
        load = {e: 0 for e in self.admitted}
        for attempt in step.tasks:
            if attempt.engine_id in load:
                load[attempt.engine_id] += 1
        cap = self._share(step)
        open_ = [(n, e) for e, n in load.items() if n < cap]
        return min(open_)[1] if open_ else None

    def _dispatch(self) -> None:
        step = self._step
        if step is None:
            return
        while step.pending:
            engine_id = self._pick(step)
            if engine_id is None:
                break
            attempt = step.ledger.place(step.pending.popleft(), engine_id)
            step.placed_at[attempt] = time.perf_counter()
            step.progress[attempt] = 0
            step.tasks[attempt] = asyncio.create_task(self._run(step, attempt), name=attempt.request_id)
        self._clock(step)
        if not step.pending:
            self._tell_dry(step)

    @staticmethod
    def _clock(step: _Step) -> None:
        """Engines that joined mid-step count while they run at least one request."""
        now = time.perf_counter()
        for engine_id in step.joined:
            running = bool(step.ledger.in_flight(engine_id))
            if running and engine_id not in step.busy_since:
                step.busy_since[engine_id] = now
            elif not running and engine_id in step.busy_since:
                step.device_s += now - step.busy_since.pop(engine_id)

    def _tell_dry(self, step: _Step) -> None:
        """The queue is empty: tell each admitted engine's listeners what it still runs, once,
        and once more when it runs nothing."""
        for engine_id in sorted(self.admitted):
            attempts = step.ledger.in_flight(engine_id)
            told = step.told_dry.get(engine_id)
            if told == 0 or (told is not None and attempts):
                continue
            # an upper bound: a response may end (EOS) before its max_tokens
            left = sum(max(step.requests[a.sample_id].max_tokens - step.progress.get(a, 0), 0) for a in attempts)
            step.told_dry[engine_id] = len(attempts)
            for listener in self._dry_listeners:
                listener(engine_id, step.ledger.step, len(attempts), left)

    async def _run(self, step: _Step, attempt: Attempt) -> None:
        engine = self.engines[attempt.engine_id]
        request = step.requests[attempt.sample_id]

        def grew(n: int) -> None:
            step.progress[attempt] = n

        try:
            generated = await engine.generate(request, attempt.request_id, grew)
        except EngineFailure as exc:
            step.tasks.pop(attempt, None)
            self.lose(attempt.engine_id, exc.reason)
            return
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                step.failure = exc  # a bug, not an engine failure: end the step loudly
                step.finished.set()
            raise
        step.tasks.pop(attempt, None)
        step.progress.pop(attempt, None)
        if generated.finish_reason == "abort":
            if step.ledger.current(attempt.sample_id) == attempt:
                # aborted by someone other than the router (e.g. the engine stopped under it)
                self.lose(attempt.engine_id, "request aborted by the engine")
            self._dispatch()
            return
        result = SampleResult(
            sample_id=attempt.sample_id,
            step=step.ledger.step,
            policy_version=generated.policy_version,
            engine_id=attempt.engine_id,
            attempt=attempt.number,
            token_ids=generated.token_ids,
            finish_reason=generated.finish_reason,
        )
        placed = step.placed_at.pop(attempt, None)
        if step.ledger.complete(attempt, result):
            if placed is not None:
                step.decoded[attempt.sample_id] = (len(generated.token_ids), time.perf_counter() - placed)
            for listener in self._sample_listeners:
                listener(result, len(step.requests))
            if step.ledger.finished:
                step.finished.set()
        self._dispatch()


def response_lengths(decoded: Iterable[tuple[int, float]]) -> ResponseLengths | None:
    """A step's `ResponseLengths` from each sample's (response tokens, seconds from its placement
    on the engine that produced it to its last token), the longest's pace that of the slowest of
    the longest (`ResponseLengths.of`). None for no sample."""
    done = sorted(decoded)
    if not done:
        return None
    return ResponseLengths.of([tokens for tokens, _ in done], done[-1][1])
