"""A trainer rank whose data-parallel group grows and shrinks at optimizer-step boundaries.

The process lives for the whole job; only its role changes (DESIGN.md §2). One thread, the
*loop*, owns torch.distributed: it trains while the rank is a member and, while it is not,
waits for work. The op handlers (`join`, `drain`, ... one per `OpKind`, for the worker
client) never touch a process group: they post membership changes to the store, hand the
loop an intent, and await the outcome.

`TrainerRank` is assembled from parts, one module each, that share the rank's fields:

| part | module | what it does |
|---|---|---|
| `StepLoop` | `step_loop` | one optimizer step: the rank's micro-batches, the (deterministic) reduction, the update |
| `StepBoundary` | `boundary` | the leader's scan and broadcast at a boundary; applying a change; barriers, digests |
| `StateTransfer` | `transfer` | donor and joiner sides of a join, the lazy optimizer restore |
| `GroupRecovery` | `recovery` | survivors agree, re-synchronise and carry on after a failed collective |
| `DaemonOps` | `op_handlers` | the daemon's ops (join, drain, release, ..., evict) and the intents they hand the loop |
| `LentToRollout` | `lending` | the gate before each RL step, where a rank lent to the rollout waits to come home |

This module holds what ties them together: start-up (`prepare`), the loop (`_run`), the
rank's view for the daemon (`actual`), and the public names the rest of the package uses.
"""

from __future__ import annotations

import concurrent.futures
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from dynaresized.backends.torch.boundary import StepBoundary
from dynaresized.backends.torch.communicators import Communicators, Group, members_of
from dynaresized.backends.torch.jobs import TrainingJob
from dynaresized.backends.torch.lending import LentToRollout
from dynaresized.backends.torch.liveness import Heartbeat, LivenessWatch
from dynaresized.backends.torch.membership import Members, Registry, Topology
from dynaresized.backends.torch.op_handlers import DaemonOps, OpHandler, _Intent, _resolve
from dynaresized.backends.torch.rank_types import (
    _HOLDING,
    JoinFailed,
    NotReady,
    RankState,
    RankView,
    RestoreMode,
    StepRecord,
    SwitchRecord,
    TrainerConfig,
    TrainingLost,
    TransferPath,
)
from dynaresized.backends.torch.recovery import GroupRecovery
from dynaresized.backends.torch.staging import StagingBuffer
from dynaresized.backends.torch.state import TrainingState
from dynaresized.backends.torch.step_loop import StepLoop
from dynaresized.backends.torch.store import StoreAddress, connect_store
from dynaresized.backends.torch.transfer import StateTransfer, assign_donors
from dynaresized.domain import ActualState

__all__ = ["JoinFailed", "NotReady", "OpHandler", "RankState", "RankView", "RestoreMode", "StepRecord",
           "SwitchRecord", "TrainerConfig", "TrainerRank", "TrainingLost", "TransferPath", "assign_donors",
           "default_offload_dir"]

log = structlog.get_logger("dynaresized.backends.torch")


class TrainerRank(StepLoop, StepBoundary, StateTransfer, GroupRecovery, DaemonOps, LentToRollout):
    def __init__(self, config: TrainerConfig, job: TrainingJob, store: StoreAddress, *,
                 on_step: Callable[[StepRecord], None] | None = None) -> None:
        config.validate()
        self.config = config
        self.job = job
        self.address = store
        self.rank = config.rank
        self.on_step = on_step
        self.history: list[StepRecord] = []
        self.switches: list[SwitchRecord] = []
        self.fatal: BaseException | None = None
        self._view = RankView(RankState.IDLE, -1, (), 0)
        self._intents: queue.Queue[_Intent] = queue.Queue()
        self._waiters: dict[str, list[concurrent.futures.Future]] = {}  # type: ignore[type-arg]
        self._waiters_lock = threading.Lock()
        self._handler_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.group: Group | None = None
        self.epoch = -1
        self.members: Members = ()
        self.step = 0
        self.cursor = 0  # change requests up to this index are settled
        self.lent: Members = ()  # members on loan: they leave at the next RL-step boundary
        self._restoring: tuple[tuple[int, int], ...] = ()  # (joiner, donor) pending lazy restore
        self._restore_note = ""
        self._recovered = False
        self._joined_at_boundary = False
        self._joined_by: dict[str, str] = {}  # change id -> outcome detail, for evict/restore
        self._init_lending()

    # -- start-up (blocking; off the critical path) -----------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Connect, heartbeat, build model and optimizer, pre-warm the candidate groups and,
        for initial members, establish epoch 0 with identical states."""
        started = time.perf_counter()
        cfg = self.config
        if cfg.torch_device == "cuda":
            self.device = torch.device("cuda", self.rank % max(torch.cuda.device_count(), 1))
        else:
            self.device = torch.device(cfg.torch_device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(1)  # deterministic kernels, and ranks share the cores
        store = connect_store(self.address, cfg.start_timeout_s)
        self.store = store
        self.registry = Registry(store, self.address.prefix)
        self._handler_registry = Registry(store.clone(), self.address.prefix)
        self.heartbeat = Heartbeat(store.clone(), self.address.prefix, self.rank, cfg.heartbeat_interval_s)
        self.heartbeat.start()
        self.watch = LivenessWatch(store, self.address.prefix, cfg.peer_timeout_s)
        t_connect = time.perf_counter() - started
        model = self.job.build_model().to(self.device)
        self.state = TrainingState(model, self.job.build_optimizer(model))
        self._params = list(model.parameters())
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise ValueError(f"the trainer needs parameters of one dtype for its flat gradient buffer; got {dtypes}")
        self._flat = torch.zeros(sum(p.numel() for p in self._params), dtype=self._params[0].dtype,
                                 device=self.device)
        self.staging = StagingBuffer(cfg.staging_bytes, pin=self.device.type == "cuda")
        self._offload_dir = Path(cfg.offload_dir) if cfg.offload_dir else None
        self.comms = Communicators(store, self.address.prefix, self.rank, backend=cfg.backend,
                                   timeout_s=cfg.start_timeout_s, device=self.device)
        initial = members_of(cfg.rank_of(d) for d in cfg.initial)
        candidates = [members_of(cfg.rank_of(d) for d in c) for c in cfg.candidates] + [initial]
        t_build = time.perf_counter() - started
        built = self.comms.prewarm(candidates)
        self.comms.set_timeout(cfg.collective_timeout_s)
        if self.rank in initial:
            self._establish_initial(initial)
        else:
            self._set_view(RankState.IDLE)
        return {"rank": self.rank, "groups_prewarmed": built, "prewarm_s": self.comms.stats.prewarm_s,
                "connect_s": t_connect, "build_s": t_build - t_connect,
                "prepare_s": time.perf_counter() - started, "member": self.rank in initial}

    def _establish_initial(self, initial: Members) -> None:
        self._barrier(initial, "start", "start-up rendezvous", self.config.start_timeout_s)
        group = self.comms.group(initial)
        self._verify(group, self.state.all_tensors(), "initial states (same seed on every rank?)")
        self.group, self.members, self.epoch, self.step = group, initial, 0, 0
        if self.rank == initial[0]:
            self.registry.establish(None, Topology(epoch=0, members=initial, step=0))
        self._set_view(RankState.TRAINING)

    # -- running ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the trainer loop is already running")
        self._thread = threading.Thread(target=self._run, name=f"trainer-loop-{self.rank}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> RankView:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.view

    def close(self) -> None:
        self._closing.set()
        if not hasattr(self, "heartbeat"):  # never prepared
            return
        if self._thread is not None:
            self._thread.join(timeout=self.config.collective_timeout_s + 5)
        self.heartbeat.stop()
        self.comms.close()
        if self.state.released is not None:  # parked state lives in tmpfs: it would outlive us
            self.state.released.unlink(missing_ok=True)

    def request_stop(self, step: int) -> None:
        """Every member stops after finishing `step` steps (the leader broadcasts it).
        Callable from any thread: it uses the handlers' store connection, not the loop's."""
        with self._handler_lock:
            self._handler_registry.request_stop(step)

    @property
    def view(self) -> RankView:
        return self._view

    def actual(self) -> ActualState:
        """What this rank really does, for the daemon's reconciliation."""
        v = self._view
        detail = f"rank {self.rank} {v.state.value} at step {v.step}"
        if v.state is RankState.FAILED and self.fatal is not None:
            detail += f": {self.fatal}"
        return ActualState(holding=_HOLDING[v.state], epoch=v.epoch, detail=detail,
                           members=tuple(self._names(r) for r in v.members))

    def _set_view(self, state: RankState) -> None:
        self._view = RankView(state, self.epoch, self.members, self.step)

    def _names(self, rank: int) -> str:
        return self.config.devices[rank] if 0 <= rank < len(self.config.devices) else "?"

    def _fmt(self, ranks: Members) -> str:
        return "{" + ", ".join(f"{r} ({self._names(r)})" for r in ranks) + "}"

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                state = self._view.state
                if state is RankState.TRAINING:
                    self._recovered = False
                    if self._joined_at_boundary:
                        # A joiner entered at the members' boundary: its next act is their step.
                        self._joined_at_boundary = False
                    elif not self._boundary():
                        break
                    # After a recovery every survivor starts over with a boundary, whichever
                    # collective it was in when the group failed.
                    if self._view.state is RankState.TRAINING and not self._recovered:
                        if self.step % self.config.mini_batches == 0 and not self._gate():
                            break  # closing while it waited for the step's samples or a lent member
                        self._train_step()
                else:
                    try:
                        intent = self._intents.get(timeout=0.05)
                    except queue.Empty:
                        if self.registry.finished() is not None:
                            break
                        continue
                    self._run_intent(intent)
            self._set_view(RankState.FINISHED)
        except BaseException as exc:  # the loop is dead: every waiting op learns why
            log.exception("trainer loop died", rank=self.rank)
            self.fatal = exc
            self._set_view(RankState.FAILED)
            self._fail_all(exc)
        finally:
            self._drain_intents()

    def _drain_intents(self) -> None:
        while True:
            try:
                intent = self._intents.get_nowait()
            except queue.Empty:
                return
            _resolve(intent.future, exc=RuntimeError(f"trainer rank {self.rank} stopped ({self._view.state.value})"))


def default_offload_dir() -> str:
    """Host memory outside the trainer process: tmpfs when the machine has it."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else tempfile.gettempdir()
