"""The cluster state and the one function that folds facts into it.

`mutate(state, fact)` is the only way state changes, live or on replay, so replaying the
log always gives the live state. The exceptions are soft timers: `last_seen` (heartbeat
times: heartbeats are not facts, and after a restart every worker gets a fresh grace period),
`last_sent` (when the pending op was last sent), `last_audit` (when every worker was last
asked for its state) and `last_tick` (when the core last ticked): re-sending and asking are
commands, not facts.
`ClusterState.durable()` is the part that replay must reproduce exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.guards import History
from dynaresized.core.idle import IdleLedger, step_period_s
from dynaresized.domain import (
    ActualState,
    DeviceId,
    Holding,
    OpKind,
    OpSpec,
    Placement,
    PlanKind,
    Pool,
    ResizePlan,
    Split,
    StepTiming,
    Worker,
    WorkerId,
    WorkerKind,
    WorkerStatus,
    moving,
    placed,
)

RECENT_WINDOW = 32  # steps on the current topology (cleared at every commit)
HISTORY_WINDOW = 256  # steps across resizes, for policies that learn how stages scale


class Phase(str, enum.Enum):
    STEADY = "steady"
    DRAINING = "draining"
    RELEASING = "releasing"
    JOINING = "joining"
    RESTORING = "restoring"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling_back"
    DEGRADED = "degraded"
    RECONCILING = "reconciling"  # converging one worker's actual state with the log (pools unchanged)


PHASE_OF_OP: dict[OpKind, Phase] = {
    OpKind.DRAIN: Phase.DRAINING,
    OpKind.RELEASE: Phase.RELEASING,
    OpKind.JOIN: Phase.JOINING,
    OpKind.RESTORE: Phase.RESTORING,
    OpKind.COMMIT: Phase.COMMITTING,
}


class InFlight(msgspec.Struct, frozen=True):
    """The resize in flight: its plan and where its execution stands."""

    plan: ResizePlan
    source: str
    reason: str
    started_at: float
    ops: tuple[OpSpec, ...]  # the plan's ops, or the undo ops once rolling back
    index: int
    op_started_at: float
    op_deadline: float
    acked: tuple[WorkerId, ...] = ()
    rolling_back: bool = False
    abort_reason: str = ""
    reconciling: WorkerId = ""  # set when this is a reconcile of that worker, not a resize
    then: Split | None = None  # a loan return's follow-up resize (see facts.LoanReturnStarted)
    then_source: str = ""
    then_reason: str = ""
    then_predicted_step_s: float = 0.0
    then_predicted_step_s_after: float = 0.0
    step: int = -1  # the last observed step when it started (a loan: a boundary passed if it moved)

    @property
    def op(self) -> OpSpec:
        return self.ops[self.index]


class Outcome(msgspec.Struct, frozen=True):
    """A resize whose outcome is still being measured: what was expected, and the measured
    step periods on the new split so far (from its commit until it is judged)."""

    resize_id: str
    predicted_step_s: float | None
    predicted_step_s_after: float | None
    measured_step_s: float | None
    cost_s: float | None
    payback_steps: int
    measured_s_per_token: float | None = None
    before: Split | None = None  # the split it left
    committed: bool = False
    checked: bool = False  # its PredictionChecked is in the log
    after: tuple[float, ...] = ()
    after_tokens: tuple[int, ...] = ()  # response tokens of those steps (0: not reported)


class Progress(msgspec.Struct, frozen=True, array_like=True):
    step: int
    done: int
    total: int
    tokens: int


class StepProgress(msgspec.Struct, frozen=True, array_like=True):
    """One rollout step's progress summed over the engines whose latest report is of it."""

    done: int = 0
    totals: dict[int, int] = {}  # the step's size as reported -> engines reporting it

    def moved(self, done: int, total: int, sign: int) -> StepProgress | None:
        """With one engine's report added (`sign` 1) or taken back (-1); None once no engine
        reports this step."""
        totals = dict(self.totals)
        totals[total] = totals.get(total, 0) + sign
        if totals[total] <= 0:
            del totals[total]
        return StepProgress(done=self.done + sign * done, totals=totals) if totals else None

    @property
    def total(self) -> int:
        return max(self.totals, default=0)


class Unconverged(msgspec.Struct, frozen=True, array_like=True):
    reason: str
    at: float  # when it was last found unconverged (it is tried again `reconcile_retry_s` later)


class MiniBatch(msgspec.Struct, frozen=True, array_like=True):
    """The training step in progress, as the trainer last reported it."""

    step: int
    done: int
    total: int
    at: float
    last_s: float  # seconds between the last two reports of this step (0: only one so far)


_DERIVED: dict[object, tuple[tuple[object, ...], object]] = {}
_T = TypeVar("_T")
_I = TypeVar("_I")


def derived(key: object, compute: Callable[[], _T], *sources: object) -> _T:
    """`compute()`, a pure function of `sources` (some of a state's maps), remembered for the
    latest `sources` per `key`. A state's maps are never changed in place (every fact makes
    new ones), so the same objects mean the same answer: the split and the pools are
    asked for several times per event and cost a pass over every device each (at 1,024
    devices most of a simulated run, `docs/simulator.md`). The entry holds `sources`, so their
    identities cannot be reused while remembered."""
    hit = _DERIVED.get(key)
    # Tuples compare their items by identity first, so the same maps answer in C; equal maps
    # that are other objects compare by value, which is as good (the answer is a function of it).
    if hit is not None and hit[0] == sources:
        return hit[1]  # type: ignore[return-value]
    value = compute()
    _DERIVED[key] = (sources, value)
    return value


_GROWN: dict[object, tuple[tuple[object, ...], tuple[object, ...], object]] = {}


def grown(key: object, items: tuple[_I, ...], compute: Callable[[tuple[_I, ...]], _T],
          extend: Callable[[_T, tuple[_I, ...]], _T], *sources: object) -> _T:
    """`compute(items)` remembered per `key`, like `derived`, for `items` that grow at their
    end while `sources` stay the same (an op's answers, a step's dry engines): the answer for
    a longer `items` is the last one passed to `extend` with only the new items (the prefix is
    compared in C), so T items arriving one at a time cost O(T), not O(T^2). `extend` may
    change the last answer in place: the shorter `items` it was for are not asked for again."""
    hit = _GROWN.get(key)
    if hit is not None:
        last, last_sources, value = hit
        if last_sources == sources and len(items) >= len(last) and items[:len(last)] == last:
            if len(items) > len(last):
                value = extend(value, items[len(last):])  # type: ignore[arg-type]
                _GROWN[key] = (items, sources, value)
            return value  # type: ignore[return-value]
    value = compute(items)
    _GROWN[key] = (items, sources, value)
    return value


_OWNERS: list[object] = [None, {}]  # [the workers map indexed, {(device, kind): live worker ids}]


def _owners(workers: dict[WorkerId, Worker]) -> dict[tuple[DeviceId, WorkerKind], set[WorkerId]]:
    """The live workers per (device, kind) of `workers`, remembered for the latest map and
    carried along as facts change one worker at a time (`_carry_owners`): a registration storm
    of W workers costs O(W), not O(W^2). Any other map is indexed afresh (one pass)."""
    if _OWNERS[0] is not workers:
        index: dict[tuple[DeviceId, WorkerKind], set[WorkerId]] = {}
        for w in workers.values():
            if w.status is WorkerStatus.LIVE:
                for d in w.devices:
                    index.setdefault((d, w.kind), set()).add(w.worker_id)
        _OWNERS[:] = [workers, index]
    return _OWNERS[1]  # type: ignore[return-value]


def _carry_owners(old: dict[WorkerId, Worker], new: dict[WorkerId, Worker], worker_id: WorkerId) -> None:
    """`new` is `old` with `worker_id`'s entry set: move the index from `old` to `new` (if it
    was `old`'s) by that one change. The index then answers for `new` only."""
    if _OWNERS[0] is not old:
        return
    index: dict[tuple[DeviceId, WorkerKind], set[WorkerId]] = _OWNERS[1]  # type: ignore[assignment]
    was, now = old.get(worker_id), new[worker_id]
    if was is not None and was.status is WorkerStatus.LIVE:
        for d in was.devices:
            index.get((d, was.kind), set()).discard(worker_id)
    if now.status is WorkerStatus.LIVE:
        for d in now.devices:
            index.setdefault((d, now.kind), set()).add(worker_id)
    _OWNERS[:] = [new, index]


LOAN_TIMES_KEPT = 3
"""Measured loans kept per direction: what the lending policy's cost estimate averages (verl
averages its last 3 switch durations the same way)."""


class LoanTime(msgspec.Struct, frozen=True, array_like=True):
    """One loan as measured: seconds from its start until it landed, and of its way home
    (`returned_s` < 0 while it is out)."""

    to_pool: Pool
    landed_s: float
    returned_s: float = -1.0


class ClusterState(msgspec.Struct, frozen=True):
    version: int = 0  # facts folded so far
    configured: bool = False
    devices: dict[DeviceId, Placement] = {}
    candidates: tuple[Split, ...] = ()
    workers: dict[WorkerId, Worker] = {}
    phase: Phase = Phase.STEADY
    inflight: InFlight | None = None
    last_step: int = -1
    recent: tuple[StepTiming, ...] = ()
    step_history: tuple[StepTiming, ...] = ()
    # Each engine's latest progress report, as a map and a small overlay of the latest ones
    # (read with `progress_of`; as `seen_base`/`seen_recent`: engines report many times a
    # step, and a full copy per report made every step quadratic in the engines), and the sums
    # per step the lending policy reads, kept as reports arrive.
    progress: dict[WorkerId, Progress] = {}
    progress_recent: dict[WorkerId, Progress] = {}
    step_progress: dict[int, StepProgress] = {}
    history: History = History()
    idle: IdleLedger = IdleLedger()
    outcome: Outcome | None = None  # the last committed (or in-flight) resize, until judged
    last_prediction: f.PredictionChecked | None = None
    last_verdict: f.ResizeJudged | None = None
    paused: bool = False
    stopping: bool = False
    resizes_started: int = 0
    resizes_committed: int = 0
    resizes_rolled_back: int = 0
    resizes_degraded: int = 0  # resizes that could neither finish nor roll back (a loan's are not counted)
    cost_per_device_s: dict[str, float] = {}  # learned, by direction "rollout->training"
    degraded_reason: str = ""
    reconciles_started: int = 0
    unconverged: dict[WorkerId, Unconverged] = {}  # workers that could not converge: left out of plans
    # Soft state, see module docstring: when each live worker was last heard from, as an older
    # map and a small overlay of the latest heartbeats (`last_seen` reads both). A heartbeat
    # copies only the overlay, which is folded into the map once it holds about sqrt(workers)
    # entries: a full copy per heartbeat made every second of heartbeats quadratic in the workers.
    seen_base: dict[WorkerId, float] = {}
    seen_recent: dict[WorkerId, float] = {}
    dry_step: int = -1  # the rollout step whose engines `dry` lists
    dry: tuple[DeviceId, ...] = ()  # devices whose engine has nothing left to do in `dry_step` (lendable)
    tails: tuple[tuple[DeviceId, int, int, float], ...] = ()
    """Engines of `dry_step` whose queue is empty while they still decode: (device, running, tokens
    left, when they said so), the latest report of each."""
    tail_undo: tuple[tuple[DeviceId, ...], ...] = ()
    """The engines a tail regroup made one wider engine of, to be regrouped back into at the step
    boundary (empty: none)."""
    tail_due: bool = False  # a step boundary passed since the tail regroup: regroup back now
    mini_batch: MiniBatch | None = None
    loans_started: int = 0
    loans_landed: int = 0
    loan_times: tuple[LoanTime, ...] = ()  # the last LOAN_TIMES_KEPT measured loans per direction
    step_reporter: WorkerId = ""  # the worker whose step reports the job counts (the first to send one)
    engines: dict[DeviceId, tuple[DeviceId, ...]] = {}
    """Rollout engines wider than one device (formed by regroups): each of their devices -> the
    engine's devices, its leader first. A device not here is an engine of its own."""
    regroups_started: int = 0
    regroups_committed: int = 0
    last_sent: float = 0.0  # soft: when the pending op was last sent
    last_audit: float = 0.0  # soft: when every live worker was last asked for its state
    last_tick: float = 0.0  # soft: when the core last saw a tick (a long gap: the daemon stalled)

    # -- derived views -------------------------------------------------------------
    def pool_devices(self, pool: Pool) -> tuple[DeviceId, ...]:
        return derived(("pool", pool), lambda: tuple(d for d, p in self.devices.items() if p.pool is pool),
                       self.devices)

    @property
    def split(self) -> Split:
        """Devices per pool; a lent device counts in its home pool (a loan lasts one step);
        a moving device counts in neither."""
        return derived("split", self._split, self.devices)

    def _split(self) -> Split:
        train = rollout = 0
        for p in self.devices.values():
            pool = p.pool if p.home is None or p.pool is None else p.home
            if pool is Pool.TRAINING:
                train += 1
            elif pool is Pool.ROLLOUT:
                rollout += 1
        return Split(train=train, rollout=rollout)

    def lent_devices(self) -> tuple[DeviceId, ...]:
        """Devices serving the other pool until the step boundary (loan landed, not returned)."""
        return tuple(d for d, p in self.devices.items() if p.home is not None and p.pool is not None)

    def lendable(self) -> tuple[tuple[DeviceId, ...], tuple[DeviceId, ...]]:
        """(devices of rollout engines with nothing left to do in `dry_step`, training devices),
        each placed in its home pool and not held back: what a loan may take. Asked after every
        progress report and every engine that runs dry, so remembered while the maps it reads
        are the same, and the dry engines' part extended as `dry` grows."""
        def placed_home() -> frozenset[DeviceId]:
            held_back = self.held_back()
            return frozenset(d for d, p in self.devices.items()
                             if p.home is None and p.pool is not None and d not in held_back)

        def idle(dry: tuple[DeviceId, ...]) -> tuple[DeviceId, ...]:
            # An engine of several devices is lent whole: all its devices once its first
            # device's worker (the one that runs it) has run dry, none before.
            out: list[DeviceId] = []
            for d in dry:
                group = self.engine_of(d)
                if d == group[0] and all(x in home and self.devices[x].pool is Pool.ROLLOUT for x in group):
                    out.extend(group)
            return tuple(out)

        home = derived("home", placed_home, self.devices, self.unconverged, self.workers, self.engines)
        trainers = derived("trainers", lambda: tuple(d for d in self.pool_devices(Pool.TRAINING) if d in home),
                           self.devices, home)
        return grown("idle", self.dry, idle, lambda last, more: last + idle(more), home, self.devices), trainers

    def held_back(self) -> set[DeviceId]:
        """Devices left out of every plan, resize or loan: a worker on them has not converged."""
        return {d for w in self.unconverged if w in self.workers for d in self.workers[w].devices}

    def live_owners(self, device: DeviceId, kind: WorkerKind) -> tuple[WorkerId, ...]:
        """The live workers of `kind` on `device` (one, where hellos were checked): from an
        index kept as the workers change (`_owners`), not a pass over every worker, which made a
        hello linear in the cluster and registering it quadratic (8,192 workers: seconds)."""
        return tuple(_owners(self.workers).get((device, kind), ()))

    def live_workers_by_device(self) -> dict[tuple[DeviceId, WorkerKind], Worker]:
        """A live worker of each device and kind (`live_owners` answers by worker id): one pass
        over the workers, so that a plan over many devices is linear in the cluster, not quadratic."""
        index: dict[tuple[DeviceId, WorkerKind], Worker] = {}
        for w in self.workers.values():
            if w.status is WorkerStatus.LIVE:
                for d in w.devices:
                    index.setdefault((d, w.kind), w)
        return index

    def is_live(self, worker_id: WorkerId) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.status is WorkerStatus.LIVE

    def pool_of(self, worker: Worker) -> Pool | None:
        """The pool all of `worker`'s devices are placed in; None while any of them is moving
        or they are split between the pools."""
        pools = {self.devices[d].pool for d in worker.devices if d in self.devices}
        return pools.pop() if len(pools) == 1 else None

    def engine_of(self, device: DeviceId) -> tuple[DeviceId, ...]:
        """The devices of the rollout engine `device` serves in: its own alone unless a regroup
        made it part of a wider one."""
        return self.engines.get(device, (device,))

    def wide_engines(self) -> list[tuple[DeviceId, ...]]:
        """The rollout engines of several devices, each once, in order of their leaders."""
        return sorted(set(self.engines.values()))

    def follows(self, worker: Worker) -> bool:
        """An engine worker whose device is in a wider engine that another device's worker leads:
        it holds nothing while that engine serves."""
        return (worker.kind is WorkerKind.ROLLOUT_ENGINE and len(worker.devices) == 1
                and self.engine_of(worker.devices[0])[0] != worker.devices[0])

    def desired(self, worker: Worker) -> Holding | None:
        """What the log says `worker` should do: serve when all its devices are in its kind's
        pool, hold nothing when all are in the other pool (or when another worker leads the
        wider engine its device serves in); None otherwise (nothing to converge)."""
        pool = self.pool_of(worker)
        if pool is None:
            return None
        if pool is worker.kind.pool and not self.follows(worker):
            return Holding.SERVING
        return Holding.RELEASED

    def progress_of(self, worker_id: WorkerId) -> Progress | None:
        """`worker_id`'s latest progress report (None: none yet)."""
        p = self.progress_recent.get(worker_id)
        return p if p is not None else self.progress.get(worker_id)

    def samples(self, step: int) -> tuple[int, int]:
        """(samples done, the step's samples) of rollout step `step`, summed over the engines
        whose latest report is of it ((0, 0): none)."""
        p = self.step_progress.get(step)
        return (p.done, p.total) if p is not None else (0, 0)

    @property
    def last_seen(self) -> dict[WorkerId, float]:
        """When each live worker was last heard from (a new dict: reading it is linear)."""
        if not self.seen_recent:
            return self.seen_base
        return {**self.seen_base, **self.seen_recent}

    def durable(self) -> ClusterState:
        """Without the soft state: when workers were last heard from, and the engines' progress."""
        return replace(self, seen_base={}, seen_recent={}, last_sent=0.0, last_audit=0.0, last_tick=0.0,
                       progress={}, progress_recent={}, step_progress={})


S = TypeVar("S", bound=f.Fact)
_MUTATORS: dict[type, Callable[[ClusterState, f.Fact], ClusterState]] = {}


def _on(fact_type: type[S]) -> Callable[[Callable[[ClusterState, S], ClusterState]], Callable]:
    def register(fn: Callable[[ClusterState, S], ClusterState]) -> Callable:
        _MUTATORS[fact_type] = fn  # type: ignore[assignment]
        return fn

    return register


def mutate(state: ClusterState, fact: f.Fact) -> ClusterState:
    new = _MUTATORS[type(fact)](state, fact)
    return replace(new, version=state.version + 1)


def fold(facts: Iterable[f.Fact], state: ClusterState | None = None) -> ClusterState:
    state = state if state is not None else ClusterState()
    for fact in facts:
        state = mutate(state, fact)
    return state


_V = TypeVar("_V")


def overlaid(base: dict[WorkerId, _V], recent: dict[WorkerId, _V], worker_id: WorkerId,
             value: _V) -> tuple[dict[WorkerId, _V], dict[WorkerId, _V]]:
    """A map kept as `base` and a small overlay `recent`, with `worker_id` set to `value`: a
    copy of the overlay, folded into a copy of the base once it holds about sqrt(base)
    entries (the cost per update is O(sqrt n), not O(n))."""
    recent = dict(recent)
    recent[worker_id] = value
    if len(recent) > max(32, math.isqrt(len(base))):
        base = dict(base)
        base.update(recent)
        return base, {}
    return base, recent


def seen_at(state: ClusterState, worker_id: WorkerId, at: float) -> ClusterState:
    """`state` with `worker_id` last heard from at `at` (see `ClusterState.seen_base`)."""
    base, recent = overlaid(state.seen_base, state.seen_recent, worker_id, at)
    return replace(state, seen_base=base, seen_recent=recent)


def _unseen(state: ClusterState, worker_id: WorkerId) -> ClusterState:
    base, recent = state.seen_base, state.seen_recent
    if worker_id in base:
        base = {w: t for w, t in base.items() if w != worker_id}
    if worker_id in recent:
        recent = {w: t for w, t in recent.items() if w != worker_id}
    return replace(state, seen_base=base, seen_recent=recent)


def _set_worker(state: ClusterState, worker_id: WorkerId, status: WorkerStatus) -> ClusterState:
    w = state.workers[worker_id]
    workers = dict(state.workers)
    workers[worker_id] = replace(w, status=status)
    _carry_owners(state.workers, workers, worker_id)
    return _unseen(replace(state, workers=workers), worker_id)


def _place(state: ClusterState, devices: Iterable[DeviceId], placement: Placement) -> ClusterState:
    new = dict(state.devices)
    for d in devices:
        new[d] = placement
    return replace(state, devices=new)


def _end_resize(state: ClusterState, at: float, step: int) -> ClusterState:
    if state.inflight is not None and state.inflight.plan.kind is not PlanKind.RESIZE:
        # A loan is not a resize for the guards: dwell and cooldown count from real resizes.
        return replace(state, inflight=None)
    return replace(
        state,
        inflight=None,
        history=replace(state.history, last_resize_end_at=at, last_resize_end_step=step),
    )


@_on(f.ClusterConfigured)
def _(s: ClusterState, e: f.ClusterConfigured) -> ClusterState:
    return replace(
        s,
        configured=True,
        devices={d: placed(p) for d, p in zip(e.devices, e.pools, strict=True)},
        candidates=e.candidates,
    )


@_on(f.DaemonRestarted)
def _(s: ClusterState, e: f.DaemonRestarted) -> ClusterState:
    inflight = s.inflight
    if inflight is not None and e.op_deadline is not None:
        inflight = replace(inflight, op_deadline=e.op_deadline)
    grace = {w.worker_id: e.at for w in s.workers.values() if w.status is WorkerStatus.LIVE}
    return replace(s, inflight=inflight, stopping=False, seen_base=grace, seen_recent={})


@_on(f.DaemonStalled)
def _(s: ClusterState, e: f.DaemonStalled) -> ClusterState:
    return replace(s, inflight=replace(s.inflight, op_deadline=e.op_deadline)) if s.inflight is not None else s


@_on(f.WorkerRegistered)
def _(s: ClusterState, e: f.WorkerRegistered) -> ClusterState:
    workers = dict(s.workers)
    workers[e.worker.worker_id] = e.worker
    _carry_owners(s.workers, workers, e.worker.worker_id)
    # A new registration is a new chance to converge.
    return seen_at(replace(s, workers=workers, unconverged=_without(s.unconverged, e.worker.worker_id)),
                   e.worker.worker_id, e.at)


def _without(unconverged: dict[WorkerId, Unconverged], worker_id: WorkerId) -> dict[WorkerId, Unconverged]:
    if worker_id not in unconverged:
        return unconverged
    return {w: u for w, u in unconverged.items() if w != worker_id}


def _set_actual(s: ClusterState, worker_id: WorkerId, actual: ActualState) -> ClusterState:
    workers = dict(s.workers)
    workers[worker_id] = replace(workers[worker_id], actual=actual)
    _carry_owners(s.workers, workers, worker_id)
    unconverged = s.unconverged
    if s.desired(workers[worker_id]) == actual.holding:
        unconverged = _without(unconverged, worker_id)  # it agrees with the log now
    return replace(s, workers=workers, unconverged=unconverged)


@_on(f.WorkerReported)
def _(s: ClusterState, e: f.WorkerReported) -> ClusterState:
    return _set_actual(s, e.worker_id, e.actual)


@_on(f.ReconcileStarted)
def _(s: ClusterState, e: f.ReconcileStarted) -> ClusterState:
    inflight = InFlight(plan=e.plan, source="reconcile", reason=f"{e.worker_id}: {e.actual.value}, "
                        f"the log says {e.desired.value}", started_at=e.at, ops=e.plan.ops, index=0,
                        op_started_at=e.at, op_deadline=e.op_deadline, reconciling=e.worker_id)
    return replace(s, inflight=inflight, phase=Phase.RECONCILING, reconciles_started=s.reconciles_started + 1)


@_on(f.ReconcileFinished)
def _(s: ClusterState, e: f.ReconcileFinished) -> ClusterState:
    unconverged = _without(s.unconverged, e.worker_id) if e.ok else s.unconverged
    return replace(s, inflight=None, phase=Phase.STEADY, unconverged=unconverged)


@_on(f.WorkerUnconverged)
def _(s: ClusterState, e: f.WorkerUnconverged) -> ClusterState:
    unconverged = dict(s.unconverged)
    unconverged[e.worker_id] = Unconverged(e.reason, e.at)
    return replace(s, unconverged=unconverged)


@_on(f.WorkerLost)
def _(s: ClusterState, e: f.WorkerLost) -> ClusterState:
    return _set_worker(s, e.worker_id, WorkerStatus.LOST)


@_on(f.WorkerLeft)
def _(s: ClusterState, e: f.WorkerLeft) -> ClusterState:
    return _set_worker(s, e.worker_id, WorkerStatus.GONE)


@_on(f.StepObserved)
def _(s: ClusterState, e: f.StepObserved) -> ClusterState:
    recent = (s.recent + (e.timing,))[-RECENT_WINDOW:]
    step_history = (s.step_history + (e.timing,))[-HISTORY_WINDOW:]
    outcome = s.outcome
    period = step_period_s(e.timing)
    t = e.timing
    # In a pipeline the first step reported after a commit may still have run on the old
    # split (its rollout started before): a step that says so does not measure the new one.
    ran_before = outcome is not None and outcome.before == Split(train=t.train_devices, rollout=t.rollout_devices)
    if outcome is not None and outcome.committed and period is not None and not ran_before:
        outcome = replace(outcome, after=outcome.after + (period,),
                          after_tokens=outcome.after_tokens + (e.timing.response_tokens,))
    # Engines that ran dry before a step boundary did so in the step that ended: not lendable
    # now; nor are trainers whose mini-batches were of that step (the next one begins).
    mb = s.mini_batch if s.mini_batch is not None and s.mini_batch.step > e.timing.step else None
    return replace(s, last_step=e.timing.step, recent=recent, step_history=step_history,
                   idle=s.idle.add(e.timing, s.devices), outcome=outcome, dry=(), tails=(), mini_batch=mb,
                   step_reporter=e.worker_id, tail_due=bool(s.tail_undo))


@_on(f.ProgressObserved)
def _(s: ClusterState, e: f.ProgressObserved) -> ClusterState:
    # Logs written before 5 December 2026 record progress reports; since then they are soft state.
    return progressed(s, e.worker_id, Progress(e.step, e.done, e.total, e.tokens))


def progressed(s: ClusterState, worker_id: WorkerId, new: Progress) -> ClusterState:
    """`s` with an engine's latest progress report: soft state, as a heartbeat's time is (no
    fact: a thousand engines report every second, and the log's rows were mostly these; an
    engine reports again within a second of a daemon restart)."""
    sums = dict(s.step_progress)
    old = s.progress_of(worker_id)
    if old is not None:
        _count(sums, old, -1)
    _count(sums, new, 1)
    base, recent = overlaid(s.progress, s.progress_recent, worker_id, new)
    return replace(s, progress=base, progress_recent=recent, step_progress=sums)


def _count(sums: dict[int, StepProgress], p: Progress, sign: int) -> None:
    """`sums` with one engine's report `p` added (`sign` 1) or taken back (-1)."""
    before = sums.get(p.step)
    if before is None and sign < 0:
        return  # not counted (a snapshot's sums rebuilt without it): nothing to take back
    after = (before or StepProgress()).moved(p.done, p.total, sign)
    if after is None:
        del sums[p.step]
    else:
        sums[p.step] = after


def with_step_progress(s: ClusterState) -> ClusterState:
    """`s` with `step_progress` summed from its engines' latest reports (a snapshot written
    before the sums were kept has the reports only)."""
    sums: dict[int, StepProgress] = {}
    for p in {**s.progress, **s.progress_recent}.values():
        _count(sums, p, 1)
    return replace(s, step_progress=sums)


@_on(f.ConfigReloaded)
def _(s: ClusterState, e: f.ConfigReloaded) -> ClusterState:
    return s  # a record for operators: the shell holds the configuration


@_on(f.ReloadRefused)
def _(s: ClusterState, e: f.ReloadRefused) -> ClusterState:
    return s  # a record for operators; changes nothing


@_on(f.ProposalRejected)
def _(s: ClusterState, e: f.ProposalRejected) -> ClusterState:
    return s  # a record for operators; changes nothing


@_on(f.PolicyHeld)
def _(s: ClusterState, e: f.PolicyHeld) -> ClusterState:
    return s  # a record for operators; changes nothing


@_on(f.ResizeStarted)
def _(s: ClusterState, e: f.ResizeStarted) -> ClusterState:
    plan = e.plan
    s = _place(s, plan.devices, moving(plan.from_pool, plan.to_pool))
    inflight = InFlight(
        plan=plan,
        source=e.source,
        reason=e.reason,
        started_at=e.at,
        ops=plan.ops,
        index=0,
        op_started_at=e.at,
        op_deadline=e.op_deadline,
    )
    outcome = Outcome(resize_id=plan.resize_id, predicted_step_s=e.predicted_step_s,
                      predicted_step_s_after=e.predicted_step_s_after, measured_step_s=e.measured_step_s,
                      cost_s=e.predicted_cost_s, payback_steps=e.payback_steps,
                      measured_s_per_token=e.measured_s_per_token, before=plan.before)
    return replace(
        s,
        inflight=inflight,
        phase=PHASE_OF_OP[plan.ops[0].kind],
        resizes_started=s.resizes_started + 1,
        outcome=outcome,
    )


@_on(f.OpAcked)
def _(s: ClusterState, e: f.OpAcked) -> ClusterState:
    assert s.inflight is not None
    if e.actual is not None and e.worker_id in s.workers:
        s = _set_actual(s, e.worker_id, e.actual)
    return replace(s, inflight=replace(s.inflight, acked=s.inflight.acked + (e.worker_id,)))


@_on(f.OpCompleted)
def _(s: ClusterState, e: f.OpCompleted) -> ClusterState:
    fl = s.inflight
    assert fl is not None
    nxt = fl.index + 1
    if nxt >= len(fl.ops):
        return replace(s, inflight=replace(fl, index=nxt, acked=()))
    inflight = replace(
        fl, index=nxt, acked=(), op_started_at=e.at, op_deadline=e.next_deadline or e.at
    )
    if fl.reconciling:
        phase = Phase.RECONCILING
    else:
        phase = Phase.ROLLING_BACK if fl.rolling_back else PHASE_OF_OP[fl.ops[nxt].kind]
    return replace(s, inflight=inflight, phase=phase)


@_on(f.OpFailed)
def _(s: ClusterState, e: f.OpFailed) -> ClusterState:
    return s  # what follows (abort, degraded) is its own fact


@_on(f.ResizeAborted)
def _(s: ClusterState, e: f.ResizeAborted) -> ClusterState:
    fl = s.inflight
    assert fl is not None
    inflight = replace(
        fl,
        ops=e.undo,
        index=0,
        acked=(),
        rolling_back=True,
        abort_reason=e.reason,
        op_started_at=e.at,
        op_deadline=e.op_deadline or e.at,
    )
    return replace(s, inflight=inflight, phase=Phase.ROLLING_BACK)


@_on(f.ResizeCommitted)
def _(s: ClusterState, e: f.ResizeCommitted) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = _place(_unengined(s, plan.devices), plan.devices, placed(plan.to_pool))
    costs = dict(s.cost_per_device_s)
    per_device = e.duration_s / max(len(plan.devices), 1)
    old = costs.get(plan.direction)
    costs[plan.direction] = per_device if old is None else 0.5 * old + 0.5 * per_device
    outcome = s.outcome
    if outcome is not None and outcome.resize_id == e.resize_id:
        outcome = replace(outcome, committed=True)
    s = replace(s, phase=Phase.STEADY, recent=(), resizes_committed=s.resizes_committed + 1, cost_per_device_s=costs,
                outcome=outcome)
    return _end_resize(s, e.at, e.step)


def _settled(plan: ResizePlan, pool: Pool) -> Placement:
    """Where a device of `plan` rests in `pool`: a loan's device keeps its home recorded."""
    home = plan.from_pool if plan.kind is PlanKind.LOAN else plan.to_pool
    if plan.kind is PlanKind.RESIZE or pool is home:
        return placed(pool)
    return placed(pool, home=home)


@_on(f.ResizeRolledBack)
def _(s: ClusterState, e: f.ResizeRolledBack) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = _place(s, plan.devices, _settled(plan, plan.from_pool))
    undone = 1 if plan.kind is PlanKind.RESIZE else 0  # a loan rolled back is not a resize's
    s = replace(s, phase=Phase.STEADY, resizes_rolled_back=s.resizes_rolled_back + undone,
                outcome=_outcome_without(s.outcome, plan.resize_id))
    return _end_resize(s, e.at, e.step)


@_on(f.Degraded)
def _(s: ClusterState, e: f.Degraded) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    if plan.kind is PlanKind.REGROUP and not s.inflight.rolling_back:  # type: ignore[union-attr]
        s = _regrouped(s, plan)  # its commit failed: past the point of no return, rolled forward
    if plan.kind is PlanKind.RESIZE and e.placed_in is plan.to_pool:
        s = _unengined(s, plan.devices)  # a resize's engines that left the rollout pool are gone
    s = _place(s, plan.devices, _settled(plan, e.placed_in))
    degraded = 1 if plan.kind is PlanKind.RESIZE else 0  # a loan that degraded is not a resize's
    s = replace(s, phase=Phase.DEGRADED, degraded_reason=e.reason, outcome=_outcome_without(s.outcome, plan.resize_id),
                resizes_degraded=s.resizes_degraded + degraded)
    return _end_resize(s, e.at, e.step)


@_on(f.PredictionChecked)
def _(s: ClusterState, e: f.PredictionChecked) -> ClusterState:
    outcome = s.outcome
    if outcome is not None and outcome.resize_id == e.resize_id:
        outcome = replace(outcome, checked=True)
    return replace(s, outcome=outcome, last_prediction=e)


@_on(f.ResizeJudged)
def _(s: ClusterState, e: f.ResizeJudged) -> ClusterState:
    outcome = None if s.outcome is not None and s.outcome.resize_id == e.resize_id else s.outcome
    history = replace(s.history, payback_factor=e.payback_factor)
    return replace(s, outcome=outcome, last_verdict=e, history=history)


@_on(f.ResizingPaused)
def _(s: ClusterState, e: f.ResizingPaused) -> ClusterState:
    return replace(s, paused=True)


@_on(f.ResizingResumed)
def _(s: ClusterState, e: f.ResizingResumed) -> ClusterState:
    phase = Phase.STEADY if s.phase is Phase.DEGRADED else s.phase
    return replace(s, paused=False, phase=phase, degraded_reason="")


@_on(f.ShutdownStarted)
def _(s: ClusterState, e: f.ShutdownStarted) -> ClusterState:
    return replace(s, stopping=True)


@_on(f.EngineQueueEmptyObserved)
def _(s: ClusterState, e: f.EngineQueueEmptyObserved) -> ClusterState:
    dry = () if e.step != s.dry_step else s.dry
    tails = () if e.step != s.dry_step else s.tails
    if e.step < s.dry_step:
        return s  # a late report of an older step
    if e.running == 0 and e.device not in dry:
        dry = dry + (e.device,)
    tails = tuple(t for t in tails if t[0] != e.device)
    if e.running > 0:
        tails = tails + ((e.device, e.running, e.tokens_left, e.at),)
    return replace(s, dry_step=e.step, dry=dry, tails=tails)


@_on(f.MiniBatchObserved)
def _(s: ClusterState, e: f.MiniBatchObserved) -> ClusterState:
    old = s.mini_batch
    # the pace is measured between two finished mini-batches (a step's start includes its overhead)
    last = e.at - old.at if old is not None and old.step == e.step and e.done > old.done > 0 else 0.0
    return replace(s, mini_batch=MiniBatch(e.step, e.done, e.total, e.at, last))


def _outcome_without(outcome: Outcome | None, resize_id: str) -> Outcome | None:
    """A resize that did not land is not measured; a loan's ending leaves the one measured alone."""
    return None if outcome is not None and outcome.resize_id == resize_id else outcome


def _start_sequence(s: ClusterState, e: f.LoanStarted | f.LoanReturnStarted, home: Pool) -> ClusterState:
    plan = e.plan
    s = _place(s, plan.devices, moving(plan.from_pool, plan.to_pool, home=home))
    inflight = InFlight(plan=plan, source=e.source if isinstance(e, f.LoanStarted) else "loan",
                        reason=e.reason, started_at=e.at, ops=plan.ops, index=0, op_started_at=e.at,
                        op_deadline=e.op_deadline, step=s.last_step)
    if isinstance(e, f.LoanReturnStarted):
        inflight = replace(inflight, then=e.then, then_source=e.then_source, then_reason=e.then_reason,
                           then_predicted_step_s=e.then_predicted_step_s,
                           then_predicted_step_s_after=e.then_predicted_step_s_after)
    return replace(s, inflight=inflight, phase=PHASE_OF_OP[plan.ops[0].kind])


def _undry(s: ClusterState, devices: tuple[DeviceId, ...]) -> tuple[DeviceId, ...]:
    """`s.dry` without `devices`: their engines leave the step they ran dry in (lent, or regrouped)."""
    return tuple(d for d in s.dry if d not in devices)


@_on(f.LoanStarted)
def _(s: ClusterState, e: f.LoanStarted) -> ClusterState:
    s = _start_sequence(s, e, home=e.plan.from_pool)
    return replace(s, dry=_undry(s, e.plan.devices), loans_started=s.loans_started + 1)


@_on(f.LoanLanded)
def _(s: ClusterState, e: f.LoanLanded) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = _place(s, plan.devices, placed(plan.to_pool, home=plan.from_pool))
    times = _kept(s.loan_times + (LoanTime(plan.to_pool, e.duration_s),), plan.to_pool)
    return replace(s, inflight=None, phase=Phase.STEADY, loans_landed=s.loans_landed + 1, loan_times=times)


@_on(f.LoanReturnStarted)
def _(s: ClusterState, e: f.LoanReturnStarted) -> ClusterState:
    return _start_sequence(s, e, home=e.plan.to_pool)


@_on(f.LoanReturned)
def _(s: ClusterState, e: f.LoanReturned) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    s = _place(s, plan.devices, placed(plan.to_pool))
    # the loan that went home is the latest one out of this direction (the pool it served)
    times = list(s.loan_times)
    for i in range(len(times) - 1, -1, -1):
        if times[i].to_pool is plan.from_pool and times[i].returned_s < 0:
            times[i] = replace(times[i], returned_s=e.duration_s)
            break
    return replace(s, inflight=None, phase=Phase.STEADY, loan_times=tuple(times))


@_on(f.RegroupStarted)
def _(s: ClusterState, e: f.RegroupStarted) -> ClusterState:
    plan = e.plan
    inflight = InFlight(plan=plan, source=e.source, reason=e.reason, started_at=e.at, ops=plan.ops, index=0,
                        op_started_at=e.at, op_deadline=e.op_deadline, step=s.last_step)
    # the regrouped engines stop: whatever they had run dry in is over for them
    return replace(s, inflight=inflight, phase=PHASE_OF_OP[plan.ops[0].kind], dry=_undry(s, plan.devices),
                   tails=tuple(t for t in s.tails if t[0] not in plan.devices), tail_undo=e.undo, tail_due=False,
                   regroups_started=s.regroups_started + 1)


@_on(f.RegroupCommitted)
def _(s: ClusterState, e: f.RegroupCommitted) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    # Steps measured on the old engines do not describe the new ones (as after a resize); a
    # tail regroup's engine serves the rest of one step and is undone at its boundary: the steps
    # still describe the engines.
    tail = s.inflight.source == "tail" or bool(s.tail_undo)  # type: ignore[union-attr]
    return replace(_regrouped(s, plan), inflight=None, phase=Phase.STEADY, recent=s.recent if tail else (),
                   regroups_committed=s.regroups_committed + 1)


def _unengined(s: ClusterState, devices: Iterable[DeviceId]) -> ClusterState:
    """`s` with no engine of several devices on `devices` (a resize moved them out whole)."""
    gone = set(devices) & set(s.engines)
    if not gone:
        return s
    return replace(s, engines={d: g for d, g in s.engines.items() if d not in gone})


def _regrouped(s: ClusterState, plan: ResizePlan) -> ClusterState:
    """`s` with `plan.devices` serving as `plan.engines`."""
    engines = {d: g for d, g in s.engines.items() if d not in plan.devices}
    for group in plan.engines:
        if len(group) > 1:
            engines.update(dict.fromkeys(group, group))
    return replace(s, engines=engines)


def _kept(times: tuple[LoanTime, ...], pool: Pool) -> tuple[LoanTime, ...]:
    """The last LOAN_TIMES_KEPT loans to `pool`, and every loan the other way."""
    mine = [i for i, t in enumerate(times) if t.to_pool is pool]
    drop = set(mine[:-LOAN_TIMES_KEPT])
    return tuple(t for i, t in enumerate(times) if i not in drop)


missing = set(f.FACT_TYPES) - set(_MUTATORS)
assert not missing, f"facts without a mutator: {missing}"

_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(ClusterState)


def encode_state(state: ClusterState) -> bytes:
    return _state_encoder.encode(state.durable())


def decode_state(data: bytes) -> ClusterState:
    state = _state_decoder.decode(data)
    if (state.progress or state.progress_recent) and not state.step_progress:
        return with_step_progress(state)
    return state
