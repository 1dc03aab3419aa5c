"""The cluster state (`ClusterState`) and the fold: `mutate` runs the handler a fact's type
registered with `on` (in the families' modules). Also changes several families share, the soft
state (heartbeats, progress) and snapshots (`encode_state`). Folds no fact itself."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.guards import History
from dynaresized.core.idle import IdleLedger
from dynaresized.core.state.memo import carry_owners, derived, grown, owners
from dynaresized.domain import (
    ActualState,
    DeviceId,
    Holding,
    OpKind,
    OpSpec,
    Placement,
    Pool,
    ResizePlan,
    Split,
    StepTiming,
    Worker,
    WorkerId,
    WorkerKind,
    WorkerStatus,
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
    source: str = ""  # who asked for it (`UNDO_SOURCE`: an undo, which is never undone early)
    committed: bool = False
    checked: bool = False  # its PredictionChecked is in the log
    after: tuple[float, ...] = ()
    after_tokens: tuple[int, ...] = ()  # response tokens of those steps (0: not reported)


class LoanCheck(msgspec.Struct, frozen=True, array_like=True):
    """A loan whose prediction waits for the stage it serves to finish its step (`LoanStarted`)."""

    resize_id: str
    to_pool: Pool
    step: int
    at: float  # when it started
    ends_in_s: float
    stage_elapsed_s: float
    saves_s: float


class Accuracy(msgspec.Struct, frozen=True):
    """Predictions checked against what was measured: how many, their absolute errors and what
    was measured, summed (`PredictionChecked` for resizes, `LoanChecked` for loans)."""

    checked: int = 0
    abs_error_s: float = 0.0
    measured_s: float = 0.0

    def add(self, error_s: float, measured_s: float) -> Accuracy:
        return Accuracy(self.checked + 1, self.abs_error_s + abs(error_s), self.measured_s + measured_s)

    @property
    def mae_s(self) -> float | None:
        """Mean absolute error in seconds (None: nothing checked)."""
        return self.abs_error_s / self.checked if self.checked else None

    @property
    def relative(self) -> float | None:
        """Absolute errors over what was measured (None: nothing measured)."""
        return self.abs_error_s / self.measured_s if self.measured_s > 0 else None

    def summary(self) -> dict[str, int | float | None]:
        """As plain data (`status`'s `accuracy`, the demo's and the simulator's figures)."""
        return {"checked": self.checked, "mae_s": self.mae_s, "relative_error": self.relative}


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
    rollout_done: tuple[int, float] | None = None
    """(step, seconds) of the last rollout step whose samples were all reported done, from when
    it began (`loans.step_started_at`) until its last sample: soft state, as the reports are."""
    history: History = History()
    idle: IdleLedger = IdleLedger()
    outcome: Outcome | None = None  # the last committed (or in-flight) resize, until judged
    last_prediction: f.PredictionChecked | None = None
    last_verdict: f.ResizeJudged | None = None
    undo_to: Split | None = None  # a resize judged worse early goes back to this split (`ResizeJudged.undo_to`)
    last_step_at: float = -1.0  # when the last step report was observed: the step in progress began (-1: none yet)
    train_began_at: float = -1.0  # when the trainer last said a training step begins (mini-batch 0; -1: never)
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
    loan_checks: tuple[LoanCheck, ...] = ()  # loans whose prediction waits for their stage to finish
    resize_accuracy: Accuracy = Accuracy()
    loan_accuracy: Accuracy = Accuracy()

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
        index kept as the workers change (`owners`), not a pass over every worker, which made a
        hello linear in the cluster and registering it quadratic (8,192 workers: seconds)."""
        return tuple(owners(self.workers).get((device, kind), ()))

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
                       progress={}, progress_recent={}, step_progress={}, rollout_done=None)


# -- the fold ---------------------------------------------------------------------------


S = TypeVar("S", bound=f.Fact)
_MUTATORS: dict[type, Callable[[ClusterState, f.Fact], ClusterState]] = {}


def on(fact_type: type[S]) -> Callable[[Callable[[ClusterState, S], ClusterState]], Callable]:
    """Register the decorated function as how a fact of `fact_type` changes the state (`mutate`)."""

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


# -- changes that several families make -------------------------------------------------


def place(state: ClusterState, devices: Iterable[DeviceId], placement: Placement) -> ClusterState:
    """`state` with every one of `devices` placed so."""
    new = dict(state.devices)
    for d in devices:
        new[d] = placement
    return replace(state, devices=new)


def without(unconverged: dict[WorkerId, Unconverged], worker_id: WorkerId) -> dict[WorkerId, Unconverged]:
    """`unconverged` without `worker_id` (the same map when it is not there)."""
    if worker_id not in unconverged:
        return unconverged
    return {w: u for w, u in unconverged.items() if w != worker_id}


def set_actual(s: ClusterState, worker_id: WorkerId, actual: ActualState) -> ClusterState:
    """`s` with `worker_id`'s account of its actual state (a report, or an op's answer)."""
    workers = dict(s.workers)
    workers[worker_id] = replace(workers[worker_id], actual=actual)
    carry_owners(s.workers, workers, worker_id)
    unconverged = s.unconverged
    if s.desired(workers[worker_id]) == actual.holding:
        unconverged = without(unconverged, worker_id)  # it agrees with the log now
    return replace(s, workers=workers, unconverged=unconverged)


def undry(s: ClusterState, devices: tuple[DeviceId, ...]) -> tuple[DeviceId, ...]:
    """`s.dry` without `devices`: their engines leave the step they ran dry in (lent, or regrouped)."""
    return tuple(d for d in s.dry if d not in devices)


def unengined(s: ClusterState, devices: Iterable[DeviceId]) -> ClusterState:
    """`s` with no engine of several devices on `devices` (a resize moved them out whole)."""
    gone = set(devices) & set(s.engines)
    if not gone:
        return s
    return replace(s, engines={d: g for d, g in s.engines.items() if d not in gone})


def regrouped(s: ClusterState, plan: ResizePlan) -> ClusterState:
    """`s` with `plan.devices` serving as `plan.engines`."""
    engines = {d: g for d, g in s.engines.items() if d not in plan.devices}
    for group in plan.engines:
        if len(group) > 1:
            engines.update(dict.fromkeys(group, group))
    return replace(s, engines=engines)


# -- soft state: heartbeat times and the engines' progress ------------------------------


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


# -- snapshots --------------------------------------------------------------------------


_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(ClusterState)


def encode_state(state: ClusterState) -> bytes:
    return _state_encoder.encode(state.durable())


def decode_state(data: bytes) -> ClusterState:
    state = _state_decoder.decode(data)
    if (state.progress or state.progress_recent) and not state.step_progress:
        return with_step_progress(state)
    return state
