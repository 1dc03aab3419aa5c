"""The nouns of dynaresized: devices, pools, workers, RL steps and resize plans.

Everything here is a frozen msgspec Struct or an Enum, shared by the core, the wire
protocol, the store, the simulator and the backends. No behaviour beyond small derived
properties lives here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import msgspec

DeviceId = str  # "node0:gpu3" (or "node0:cpu1" when a CPU slot stands in for a GPU)
WorkerId = str  # chosen by the worker; authenticated by its CURVE key on non-loopback binds


class Pool(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAINING = "training"

    @property
    def other(self) -> Pool:
        return Pool.TRAINING if self is Pool.ROLLOUT else Pool.ROLLOUT


class WorkerKind(str, enum.Enum):
    """What a worker process does on its device while its device is in the matching pool."""

    ROLLOUT_ENGINE = "rollout-engine"
    TRAINER_RANK = "trainer-rank"

    @property
    def pool(self) -> Pool:
        return Pool.ROLLOUT if self is WorkerKind.ROLLOUT_ENGINE else Pool.TRAINING

    @staticmethod
    def for_pool(pool: Pool) -> WorkerKind:
        return WorkerKind.ROLLOUT_ENGINE if pool is Pool.ROLLOUT else WorkerKind.TRAINER_RANK


class WorkerStatus(str, enum.Enum):
    LIVE = "live"
    LOST = "lost"  # missed heartbeats past the deadline, or died; may come back
    GONE = "gone"  # said goodbye


class Placement(msgspec.Struct, frozen=True, array_like=True):
    """Where one device is: in a pool, or moving between the two (`pool` is None)."""

    pool: Pool | None
    moving_from: Pool | None = None
    moving_to: Pool | None = None
    home: Pool | None = None
    """Set while the device is lent (or moving for a loan): the pool it returns to at the step
    boundary. None for a device that belongs where it is."""

    @property
    def is_moving(self) -> bool:
        return self.pool is None

    @property
    def home_pool(self) -> Pool | None:
        """The pool the device counts in for the split: its home while lent, else where it is."""
        return self.home if self.home is not None else self.pool


def placed(pool: Pool, home: Pool | None = None) -> Placement:
    return Placement(pool=pool, home=home)


def moving(from_pool: Pool, to_pool: Pool, home: Pool | None = None) -> Placement:
    return Placement(pool=None, moving_from=from_pool, moving_to=to_pool, home=home)


class Holding(str, enum.Enum):
    """What a worker actually does with its device(s), as it reports it (level-triggered
    reconciliation compares this with what the log says it should do)."""

    SERVING = "serving"  # holds the device and works: engine admitting, trainer in the group
    DRAINED = "drained"  # holds the device but takes no new work (engine drained, trainer out at a boundary)
    RELEASED = "released"  # holds nothing: engine asleep or stopped, trainer outside the group
    DONE = "done"  # its job ended (training finished): nothing to converge
    FAILED = "failed"  # it cannot act (its loop died): it cannot converge until it restarts


class ActualState(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's own account of itself: sent in `hello`, with every op result and on request."""

    holding: Holding
    last_op: str = ""  # id of the last op this process applied ("" if none)
    epoch: int = 0  # trainer: its group's membership epoch; engine: 0
    members: tuple[DeviceId, ...] = ()  # trainer: the devices of the group it is in
    detail: str = ""  # free text for operators (e.g. why FAILED)
    engine: tuple[DeviceId, ...] = ()
    """Engine: the devices the engine it runs serves, when wider than its own (a tensor-parallel
    engine formed by a regroup, led by this worker); empty: its own devices, or it says not."""


class Worker(msgspec.Struct, frozen=True):
    worker_id: WorkerId
    kind: WorkerKind
    devices: tuple[DeviceId, ...]
    status: WorkerStatus = WorkerStatus.LIVE
    registered_at: float = 0.0
    incarnation: int = 1  # bumped on every re-registration (worker or daemon restart)
    process: str = ""  # the registering process's token (see wire.Hello.process)
    actual: ActualState | None = None  # its last report (hello, op result, state report); None: never said
    secret_sha256: str = ""
    """SHA-256 (hex) of the secret the registering process chose (wire.Hello.secret), "" if it
    sent none: a later hello that names this process must carry that secret. The secret itself
    is never recorded, so a log reader cannot speak for the worker."""


LENGTH_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 1.0)
"""The quantiles of a step's response tokens a step report's `lengths` carries, in this order
(1.0: the longest response)."""


class ResponseLengths(msgspec.Struct, frozen=True):
    """A step's response-length distribution and its latency floor, as the router saw them
    (optional in a step report: a worker that does not send it leaves the daemon on its linear
    stage model, and `status` says so)."""

    quantiles: tuple[int, ...]
    """Response tokens at `LENGTH_QUANTILES` (p50, p90, p99, max), non-decreasing."""
    token_s: float = 0.0
    """Seconds an engine took per token of the step's longest response, from its admission to
    its last token (0: not measured). With the longest response's tokens it is the rollout's
    latency floor: no pool of engines of this size generates that response sooner."""

    def problem(self) -> str | None:
        """Why these figures cannot be a length distribution, or None."""
        if len(self.quantiles) != len(LENGTH_QUANTILES):
            return (f"lengths.quantiles has {len(self.quantiles)} value(s); it takes {len(LENGTH_QUANTILES)}, "
                    f"the response tokens at quantiles {', '.join(f'{q:g}' for q in LENGTH_QUANTILES)}")
        if any(q < 0 for q in self.quantiles) or any(b < a for a, b in zip(self.quantiles, self.quantiles[1:])):
            return f"lengths.quantiles {list(self.quantiles)} must be non-negative and non-decreasing"
        if not (self.token_s >= 0 and self.token_s < float("inf")):
            return f"lengths.token_s={self.token_s!r} must be a finite number of seconds >= 0"
        return None

    @classmethod
    def of(cls, tokens: Sequence[int], longest_s: float) -> ResponseLengths:
        """The lengths of a step whose samples have `tokens` response tokens each, the longest
        of them generated in `longest_s` seconds: the tokens at `LENGTH_QUANTILES` (the smallest
        count with at least that share of the samples at or below it), and the longest's seconds
        per token (0 for a step of no token)."""
        counts = sorted(tokens)
        n = len(counts)
        if n == 0:
            return cls(quantiles=(0,) * len(LENGTH_QUANTILES))
        quantiles = tuple(int(counts[min(max(math.ceil(q * n) - 1, 0), n - 1)]) for q in LENGTH_QUANTILES)
        return cls(quantiles=quantiles, token_s=longest_s / counts[-1] if counts[-1] else 0.0)

    @property
    def longest(self) -> int:
        return self.quantiles[-1]

    @property
    def floor_s(self) -> float:
        """Seconds the longest response takes on one engine: the rollout's latency floor."""
        return self.longest * self.token_s


class StepTiming(msgspec.Struct, frozen=True):
    """Observed stage times of one RL step, in seconds (wall clock of the reporting side).

    In a one-step off-policy pipeline, step k's training overlaps step k+1's rollout;
    `rollout_s` and `train_s` are each stage's own busy time for step k.
    """

    step: int
    rollout_s: float
    train_s: float
    weight_sync_s: float = 0.0
    rollout_devices: int = 0
    train_devices: int = 0
    samples: int = 0
    response_tokens: int = 0
    rollout_device_s: float = 0.0
    """Device-seconds that served the rollout: the pool's engines for the step, and a device
    lent to it for part of the step while its engine ran requests (0: not measured,
    `rollout_s × rollout_devices`)."""
    train_device_s: float = 0.0
    """Device-seconds that served the training: the pool's for the step, and a device lent to
    it from the mini-batch it joined at (0: not measured, `train_s × train_devices`)."""
    lengths: ResponseLengths | None = None
    """The step's response-length distribution (None: not reported, an older worker)."""
    loan_home_share: float | None = None
    """Trainers lent to the next step's rollout after this step go home once this share of its
    samples is generated (None: at the step boundary). verl's fully async trainer deactivates
    its hybrid replicas once `deactivate_wait_samples` of the step's samples are queued."""
    next_done_share: float = 0.0
    """The share of the next step's samples already generated when this step was reported
    (verl: the samples queued beyond those its trainer consumed)."""

    @property
    def rollout_devices_served(self) -> float:
        """Devices that served the rollout, on average over its time: more than
        `rollout_devices` when trainers were lent to it."""
        if self.rollout_device_s > 0 and self.rollout_s > 0:
            return self.rollout_device_s / self.rollout_s
        return float(self.rollout_devices)

    @property
    def train_devices_served(self) -> float:
        """Devices that served the training, on average over its time (engines lent included)."""
        if self.train_device_s > 0 and self.train_s > 0:
            return self.train_device_s / self.train_s
        return float(self.train_devices)


class Split(msgspec.Struct, frozen=True, order=True):
    """A Train:Rollout split, counted in devices."""

    train: int
    rollout: int

    @property
    def total(self) -> int:
        return self.train + self.rollout

    def __str__(self) -> str:
        return f"{self.train}:{self.rollout}"

    @staticmethod
    def parse(text: str) -> Split:
        """`"6:2"` -> Split(train=6, rollout=2); a ValueError says what was expected."""
        try:
            train, rollout = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"{text!r} is not a 'train:rollout' split such as '4:4'") from None
        return Split(train=train, rollout=rollout)


class OpKind(str, enum.Enum):
    """The fine-grained operations of a resize (DESIGN.md §5) and their undo operations."""

    DRAIN = "drain"  # source stops admitting work; in-flight work finishes or is handed over
    RELEASE = "release"  # source gives the device up (engine sleeps / trainer leaves its group)
    JOIN = "join"  # destination takes the device (trainer enters group / engine wakes)
    RESTORE = "restore"  # destination state brought up to date (weights, optimizer state)
    COMMIT = "commit"  # the pools switch to the new topology at the next step boundary
    # undo operations, issued in reverse order by a rollback
    RESUME = "resume"  # undo DRAIN: source admits work again
    RECLAIM = "reclaim"  # undo RELEASE: source takes its device back
    EVICT = "evict"  # undo JOIN: destination gives the device back


UNDO: dict[OpKind, OpKind] = {
    OpKind.DRAIN: OpKind.RESUME,
    OpKind.RELEASE: OpKind.RECLAIM,
    OpKind.JOIN: OpKind.EVICT,
}
"""What undoes each op. RESTORE needs no undo (EVICT discards it); COMMIT is the point of
no return: once it starts, a resize is rolled forward, never back."""

FORWARD_ORDER: tuple[OpKind, ...] = (
    OpKind.DRAIN,
    OpKind.RELEASE,
    OpKind.JOIN,
    OpKind.RESTORE,
    OpKind.COMMIT,
)


class PlanKind(str, enum.Enum):
    """What an operation sequence does. A loan is a resize for the rest of one RL step."""

    RESIZE = "resize"  # the split changes from the next step on
    LOAN = "loan"  # idle devices serve the other pool for the rest of the step in progress
    RETURN = "return"  # lent devices go home at the step boundary
    RECONCILE = "reconcile"  # one worker is converged with the log; the pools do not change
    REGROUP = "regroup"  # rollout devices form engines of another size (tensor parallelism); pools unchanged


class OpSpec(msgspec.Struct, frozen=True):
    """One operation of a resize plan, sent to every worker in `targets`."""

    op_id: str  # "<resize_id>/<index>-<kind>", unique for the life of the log
    kind: OpKind
    devices: tuple[DeviceId, ...]
    targets: tuple[WorkerId, ...]
    from_pool: Pool
    to_pool: Pool


class ResizePlan(msgspec.Struct, frozen=True):
    resize_id: str
    devices: tuple[DeviceId, ...]
    from_pool: Pool
    to_pool: Pool
    ops: tuple[OpSpec, ...]
    before: Split
    after: Split
    kind: PlanKind = PlanKind.RESIZE
    engines: tuple[tuple[DeviceId, ...], ...] = ()
    """REGROUP: the engines `devices` form once it commits, each its devices in order (the
    first leads it: its worker runs the engine, the others' hold nothing)."""

    @property
    def direction(self) -> str:
        return f"{self.from_pool.value}->{self.to_pool.value}"


PIPELINES: tuple[str, ...] = ("one-step-off", "fully-async", "synchronous")
"""How a job's rollout and training overlap. `one-step-off`: rollout k beside training k-1, a
whole batch in before a step trains (the simulator's windows, `sim/pipeline.py`; the default).
`fully-async`: verl's fully-async trainer (`sim/asyncpipe.py`): a staleness budget, optional
partial rollout, streaming mini-batches. `synchronous`: the same with staleness 0 (the next
step's samples start only after the sync)."""


class PipelineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which pipeline the job runs: configuration the daemon predicts, never changes."""

    mode: str = "one-step-off"
    staleness: float = 1.0
    """verl's `staleness_threshold`: how many batches beyond the one in training the rollouter
    may start (0: synchronous; 1 with no partial rollout is close to one-step off)."""
    partial_rollout: bool = False
    """verl's `partial_rollout`: a sync aborts running requests, which go on under the new weights."""
    sync_every: int = 1
    """verl's `trigger_parameter_sync_step`: mini-batches per parameter sync (one RL step)."""

    def __post_init__(self) -> None:
        if self.mode not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.mode!r}; pipelines: {', '.join(PIPELINES)}")
        if not (self.staleness >= 0 and math.isfinite(self.staleness)):
            raise ValueError(f"staleness must be a finite number >= 0, got {self.staleness}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every (trigger_parameter_sync_step) must be >= 1, got {self.sync_every}")
        if self.mode == "synchronous" and self.staleness != 0:
            raise ValueError("a synchronous pipeline has staleness 0 (drop --staleness, or use fully-async)")
        if self.mode == "one-step-off" and (self.staleness != 1 or self.partial_rollout or self.sync_every != 1):
            raise ValueError("the one-step-off pipeline has staleness 1, no partial rollout and one sync a "
                             "step: use --pipeline fully-async for verl's other settings")

    @property
    def windowed(self) -> bool:
        """Run by `pipeline.py`'s windows (the one-step-off pipeline) rather than here."""
        return self.mode == "one-step-off"

    def label(self) -> str:
        if self.windowed:
            return "one-step-off"
        return (f"{self.mode} (staleness {self.staleness:g}, partial rollout "
                f"{'on' if self.partial_rollout else 'off'}, sync every {self.sync_every} mini-batches)")
