"""A trainer rank whose data-parallel group grows and shrinks at optimizer-step boundaries.

The process lives for the whole job; only its role changes (DESIGN.md §2). One thread, the
*loop*, owns torch.distributed: it trains while the rank is a member and, while it is not,
waits for work. The op handlers (`join`, `drain`, ... one per `OpKind`, for the worker
client) never touch a process group: they post membership changes to the store, hand the
loop an intent, and await the outcome.

At every step boundary the group's leader looks for a posted change and broadcasts its
decision, so all members switch at the same step: they meet joiners in a store barrier, take
the pre-warmed group of the new membership, a donor streams parameters (and optimizer state,
or later, lazily) to each joiner after an outline, and every member compares state digests
before the new epoch counts. Leavers simply stop at the boundary (replicated state: nothing
to hand over). The global batch, a fixed number of micro-batches, is re-split over the new
group; in `deterministic` mode per-micro-batch gradients are summed in micro-batch order, so
a run that resizes is bitwise equal to one that never does.

A failure (a collective error or timeout, a peer that stopped heartbeating) makes the loop
discard the group, agree with the other survivors on who is left (first proposal in the
store wins), re-synchronise their states and carry on. A join that fails raises from the
`join` handler, which the worker client reports to the daemon.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import math
import queue
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from dynaresized.backends.torch.communicators import CollectiveFailed, Communicators, Group, members_of
from dynaresized.backends.torch.jobs import TrainingJob
from dynaresized.backends.torch.liveness import Cancelled, Heartbeat, LivenessWatch, PeerDied, WaitTimeout
from dynaresized.backends.torch.membership import (
    Change,
    ChangeState,
    ChangeStatus,
    Members,
    Recovery,
    Registry,
    Topology,
)
from dynaresized.backends.torch.staging import StagingBuffer
from dynaresized.backends.torch.state import (
    Digest,
    Outline,
    StateMismatch,
    TrainingState,
    digest,
    recv_outline,
    recv_tensors,
    send_outline,
    send_tensors,
)
from dynaresized.backends.torch.store import StoreAddress, connect_store
from dynaresized.client import op_handlers
from dynaresized.domain import ActualState, Holding, OpKind

log = structlog.get_logger("dynaresized.backends.torch")

OpHandler = Callable[[Any], Awaitable[str]]

_TAG_OUTLINE = 1000
_TAG_PARAMS = 1100
_TAG_OPTIMIZER = 1200


class RestoreMode(str, enum.Enum):
    LAZY = "lazy"  # optimizer state follows at the first step on the new topology
    EAGER = "eager"  # optimizer state is sent with the parameters, during the join


class TransferPath(str, enum.Enum):
    AUTO = "auto"  # direct for CPU tensors or NCCL, staged for GPU tensors over gloo
    DIRECT = "direct"  # one message per tensor, from the tensor's own memory
    STAGED = "staged"  # through the host staging buffer, one message per chunk


class RankState(str, enum.Enum):
    IDLE = "idle"  # not in the training group; the device serves rollout (or nothing yet)
    JOINING = "joining"
    TRAINING = "training"
    DRAINED = "drained"  # left the group at a step boundary; still holds the device and its state
    FINISHED = "finished"
    FAILED = "failed"  # the loop died; see `fatal`


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    devices: tuple[str, ...]  # every trainer device of the job; a device's rank is its index
    device: str  # this process's device
    initial: tuple[str, ...]  # the devices that train from step 0
    candidates: tuple[tuple[str, ...], ...] = ()  # memberships to pre-warm groups for
    micro_batches: int = 8  # the global batch, in micro-batches; fixed for the whole job
    deterministic: bool = False
    restore: RestoreMode = RestoreMode.LAZY
    transfer: TransferPath = TransferPath.AUTO
    backend: str = "gloo"
    torch_device: str = "cpu"  # "cpu", "cuda:N", or "cuda": GPU (rank mod GPU count)
    staging_bytes: int = 64 << 20
    collective_timeout_s: float = 30.0
    peer_timeout_s: float = 3.0
    heartbeat_interval_s: float = 0.1
    start_timeout_s: float = 120.0
    offload_dir: str | None = None  # release() parks the state here (tmpfs) and frees it; None keeps it
    steps_total: int | None = None
    record_digests: bool = False  # sha256 of parameters and optimizer state after every step (tests)
    step_delay_s: float = 0.0  # a floor on a step's duration (examples and tests)

    def validate(self) -> None:
        problems = []
        if not self.devices:
            problems.append("devices is empty")
        if len(set(self.devices)) != len(self.devices):
            problems.append(f"devices has duplicates: {list(self.devices)}")
        if self.device not in self.devices:
            problems.append(f"device {self.device!r} is not one of devices {list(self.devices)}")
        if not self.initial:
            problems.append("initial is empty: at least one device must train from step 0")
        named = [("initial", self.initial), *((f"candidates[{i}]", c) for i, c in enumerate(self.candidates))]
        for name, devs in named:
            unknown = [d for d in devs if d not in self.devices]
            if unknown:
                problems.append(f"{name} names unknown devices {unknown}")
            if not devs:
                problems.append(f"{name} is empty")
        if self.micro_batches < max(1, len(self.initial)):
            problems.append(f"micro_batches={self.micro_batches} cannot be split over {len(self.initial)} "
                            "initial ranks")
        if self.backend not in ("gloo", "nccl"):
            problems.append(f"backend {self.backend!r} is not 'gloo' or 'nccl'")
        for key in ("collective_timeout_s", "peer_timeout_s", "heartbeat_interval_s", "start_timeout_s"):
            if getattr(self, key) <= 0:
                problems.append(f"{key} must be positive")
        if self.heartbeat_interval_s * 3 > self.peer_timeout_s:
            problems.append("peer_timeout_s must be at least 3 heartbeat intervals")
        if self.staging_bytes < 1:
            problems.append("staging_bytes must be positive")
        if self.backend == "nccl" and self.transfer is TransferPath.STAGED:
            problems.append("transfer='staged' sends host buffers, which NCCL cannot; use 'direct' or 'auto'")
        if self.backend == "nccl" and not self.torch_device.startswith("cuda"):
            problems.append(f"backend 'nccl' needs torch_device 'cuda' or 'cuda:N', not {self.torch_device!r}")
        if problems:
            raise ValueError("bad trainer config: " + "; ".join(problems))

    @property
    def rank(self) -> int:
        return self.devices.index(self.device)

    def rank_of(self, device: str) -> int:
        try:
            return self.devices.index(device)
        except ValueError:
            raise ValueError(f"device {device!r} has no trainer in this job (trainer devices: "
                             f"{', '.join(self.devices)})") from None

    def node_of(self, rank: int) -> str:
        return self.devices[rank].partition(":")[0]


class StepRecord(msgspec.Struct, frozen=True):
    step: int  # the step just finished (the optimizer has applied it)
    epoch: int
    members: Members
    micro_batches: tuple[int, ...]  # the micro-batches this rank computed
    loss: float  # sum of this rank's micro-batch losses
    seconds: float
    params_sha: str = ""
    optimizer_sha: str = ""


class SwitchRecord(msgspec.Struct, frozen=True):
    """Where the time of one membership switch went, on one rank (the critical path of a resize)."""

    epoch: int
    members: Members
    joiners: Members
    role: str  # "member", "donor", "joiner" or "restore" (a lazy optimizer restore)
    barrier_s: float
    group_s: float
    transfer_s: float
    verify_s: float
    bytes: int
    group_built: bool  # False: a pre-warmed (cached) group was used


_HOLDING: dict[RankState, Holding] = {
    RankState.IDLE: Holding.RELEASED,
    RankState.JOINING: Holding.SERVING,  # on its way in: the join op is answered once it is in
    RankState.TRAINING: Holding.SERVING,
    RankState.DRAINED: Holding.DRAINED,
    RankState.FINISHED: Holding.DONE,
    RankState.FAILED: Holding.FAILED,
}


class RankView(msgspec.Struct, frozen=True):
    state: RankState
    epoch: int
    members: Members
    step: int


class JoinFailed(RuntimeError):
    pass


class NotReady(RuntimeError):
    """The op does not apply to the rank's current state (e.g. DRAIN on a rank not training)."""


class TrainingLost(RuntimeError):
    """No surviving rank holds a complete state: training cannot continue."""


class _Intent(msgspec.Struct):
    kind: str  # "join" | "release" | "reclaim"
    future: concurrent.futures.Future  # type: ignore[type-arg]
    change: Change | None = None
    deadline: float = 0.0


def assign_donors(sources: Members, joiners: Members, node_of: Callable[[int], str]) -> dict[int, int]:
    """A donor for each joiner: a source on the joiner's node if any, the least loaded first,
    then the lowest rank. Deterministic, so every member computes the same map."""
    if not sources:
        raise ValueError("no member holds the state a joiner needs")
    load = dict.fromkeys(sources, 0)
    donors = {}
    for j in sorted(joiners):
        local = [s for s in sources if node_of(s) == node_of(j)]
        donor = min(local or sources, key=lambda s: (load[s], s))
        donors[j] = donor
        load[donor] += 1
    return donors


class TrainerRank:
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
        self._restoring: tuple[tuple[int, int], ...] = ()  # (joiner, donor) pending lazy restore
        self._restore_note = ""
        self._recovered = False
        self._joined_at_boundary = False
        self._joined_by: dict[str, str] = {}  # change id -> outcome detail, for evict/restore

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

    # -- the step boundary -----------------------------------------------------------------
    def _boundary(self) -> bool:
        """Agree on what happens before the next step. False when training is over."""
        assert self.group is not None
        claimed = 0
        try:
            decision = torch.zeros(2, dtype=torch.int64)
            if self.rank == self.members[0]:
                stop = self._stop_step()
                if stop < 0 or self.step < stop:  # no change is claimed at the last boundary
                    claimed = self._leader_scan()
                decision = torch.tensor([claimed, stop], dtype=torch.int64)
            self.group.broadcast(decision, self.members[0])
        except (CollectiveFailed, PeerDied, WaitTimeout) as exc:
            if claimed:
                cid = self.registry.indexed(claimed)
                assert cid is not None
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail=f"the group failed: {exc}"))
            self._recover(exc)
            return True
        index, stop = int(decision[0]), int(decision[1])
        if stop >= 0 and self.step >= stop:
            if self.rank == self.members[0]:
                self.registry.finish(self.step)
            log.info("training finished", rank=self.rank, step=self.step)
            return False
        if index > 0:
            self._apply(index)
        return True

    def _stop_step(self) -> int:
        stop = self.registry.stop_step()
        if self.config.steps_total is not None:
            stop = self.config.steps_total if stop < 0 else min(stop, self.config.steps_total)
        return stop

    def _leader_scan(self) -> int:
        """The index of the next change to apply (claimed), or 0. Changes are taken in the
        order posted; one that is not ready yet (movers missing) holds back those after it."""
        seq = self.registry.seq()
        i = self.cursor + 1
        while i <= seq:
            cid = self.registry.indexed(i)
            if cid is None:
                return 0  # posted but not published yet: next boundary
            st = self.registry.state(cid)
            if st is not None and st.status is ChangeStatus.PENDING:
                change = self.registry.change(cid)
                if not self.registry.ready(change):
                    return 0
                members, problem = self._validate(change)
                if problem:
                    self.registry.transition(cid, st, ChangeState(ChangeStatus.REJECTED, detail=problem))
                elif members == self.members:
                    self.registry.transition(cid, st, ChangeState(ChangeStatus.DONE, self.epoch, members,
                                                                  "no change needed"))
                else:
                    epoch = self.registry.new_epoch()
                    claim = ChangeState(ChangeStatus.APPLYING, epoch, members, before=self.members)
                    if self.registry.transition(cid, st, claim):
                        return i
                    continue  # cancelled meanwhile: look again
            elif st is not None and st.status is ChangeStatus.APPLYING:
                # claimed by a leader whose group then failed; recovery settles it as failed
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail="the group failed while applying it"))
            self.cursor = i
            i += 1
        return 0

    def _validate(self, change: Change) -> tuple[Members, str]:
        after = change.result(self.members)
        if not after:
            return after, "the training pool would have no trainer left"
        if len(after) > self.config.micro_batches:
            return after, (f"the global batch of {self.config.micro_batches} micro-batches cannot be split over "
                           f"{len(after)} ranks")
        if change.expect is not None and after != change.expect:
            missing = tuple(sorted(set(change.expect) - set(after)))
            extra = tuple(sorted(set(after) - set(change.expect)))
            return after, (f"the daemon expects training on {self._fmt(change.expect)} but the trainers would be "
                           f"on {self._fmt(after)}" + (f"; not training: {self._fmt(missing)}" if missing else "")
                           + (f"; unexpected: {self._fmt(extra)}" if extra else ""))
        return after, ""

    def _apply(self, index: int) -> None:
        cid = self.registry.indexed(index)
        assert cid is not None
        change = self.registry.change(cid)
        st = self.registry.state(cid)
        self.cursor = index
        # The others may already have finished (DONE) or failed (FAILED) it: a leaver does
        # not meet them, and a failure is settled by whoever sees it first.
        if st is None or st.epoch < 0:
            raise RuntimeError(f"change {cid} was broadcast for applying but its state is {st}")
        before = self.members
        if self.rank in change.remove:
            self._leave(change, st)
            return
        if st.status is ChangeStatus.FAILED:
            self._recover(RuntimeError(f"{cid} failed: {st.detail}"),
                          Topology(epoch=self.epoch, members=tuple(r for r in before if r in st.members),
                                   step=self.step))
            return
        joiners = tuple(r for r in st.members if r not in before)
        sources = tuple(r for r in before if r in st.members)
        try:
            report = self._switch(st.members, st.epoch, joiners, sources, cid)
        except Cancelled as exc:
            # A mover gave up before everyone met (its join failed): no group of the new
            # membership was touched, so the old one goes on as it was, unless the change
            # also took ranks out (they have left already) or the failure was a member's.
            log.warning("membership change abandoned before the switch", rank=self.rank, change=cid, error=str(exc))
            if set(before) - set(st.members):
                self._recover(exc, Topology(epoch=self.epoch, members=sources, step=self.step))
            else:
                self._set_view(RankState.TRAINING)
            return
        except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch) as exc:
            established = self.registry.arrived(f"est{st.epoch}", st.members)
            if not established:
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail=str(exc)))
                base = Topology(epoch=self.epoch, members=sources, step=self.step)
            else:  # everyone had confirmed it: the new epoch stands, the failure came after
                self._adopt_epoch(st.members, st.epoch, joiners, sources)
                base = None
            self._recover(exc, base)
            return
        self.registry.settle(cid, ChangeState(ChangeStatus.DONE, st.epoch, st.members, report, before=before))
        log.info("membership changed", rank=self.rank, change=cid, epoch=st.epoch, before=list(before),
                 after=list(st.members), step=self.step, detail=report)

    def _leave(self, change: Change, st: ChangeState) -> None:
        detail = (f"left the training group at the step-{self.step} boundary; {self._fmt(st.members)} continue "
                  f"at epoch {st.epoch}")
        self.group, self.members, self.epoch = None, (), -1
        # A drained rank keeps its device and state (a rollback may resume it); an evicted
        # one gives the device back at once.
        evicted = change.cid.endswith("/evict")
        if evicted:
            detail += "; " + self._release_state()
        self._set_view(RankState.IDLE if evicted else RankState.DRAINED)
        log.info("left training group", rank=self.rank, change=change.cid, step=self.step)
        self._notify(change.cid, detail)

    # -- joining ------------------------------------------------------------------------------
    def _switch(self, members: Members, epoch: int, joiners: Members, sources: Members, cid: str) -> str:
        """Members' side of a change: meet, take the group, feed joiners, check, move on."""
        t0 = time.perf_counter()
        self._barrier(members, f"e{epoch}", f"the switch to epoch {epoch} ({cid})", self.config.collective_timeout_s,
                      cid=cid)
        t1 = time.perf_counter()
        builds = self.comms.stats.builds
        group = self.comms.group(members)
        t2 = time.perf_counter()
        donors = assign_donors(sources, joiners, self.config.node_of) if joiners else {}
        eager = self.config.restore is RestoreMode.EAGER
        sent = 0
        for joiner, donor in donors.items():
            if donor == self.rank:
                sent += self._feed(group, joiner, epoch, members, with_optimizer=eager)
        t3 = time.perf_counter()
        if joiners:  # a leave moves nothing: the remaining states were equal and still are
            tensors = self.state.all_tensors() if eager else self.state.param_tensors()
            self._verify(group, tensors, f"states after joining {self._fmt(joiners)}")
        self._confirm(members, epoch)
        t4 = time.perf_counter()
        self._adopt_epoch(members, epoch, joiners, sources, group)
        self.switches.append(SwitchRecord(epoch, members, joiners, "donor" if sent else "member", t1 - t0, t2 - t1,
                                          t3 - t2, t4 - t3, sent, self.comms.stats.builds > builds))
        report = (f"epoch {epoch}: {self._fmt(members)} from step {self.step}; barrier {1e3 * (t1 - t0):.1f} ms, "
                  f"group {1e3 * (t2 - t1):.1f} ms, transfer {1e3 * (t3 - t2):.1f} ms"
                  + (f" ({sent / 1e6:.1f} MB sent)" if sent else "") + f", verify {1e3 * (t4 - t3):.1f} ms")
        return report

    def _confirm(self, members: Members, epoch: int, cid: str | None = None) -> None:
        """The new epoch stands once every member has checked the states and said so in the
        store. Marks are never withdrawn, so a rank that later finds a member dead can still
        tell whether the epoch had been confirmed by all (see `_apply`)."""
        self._barrier(members, f"est{epoch}", f"confirming epoch {epoch}", self.config.collective_timeout_s, cid=cid)

    def _adopt_epoch(self, members: Members, epoch: int, joiners: Members, sources: Members,
                     group: Group | None = None) -> None:
        eager = self.config.restore is RestoreMode.EAGER
        has_state = self.state.has_optimizer_state or bool(self._restoring)
        restoring = () if eager or not joiners or not has_state else tuple(
            sorted(assign_donors(sources, joiners, self.config.node_of).items()))
        old = self.registry.topology()
        self.group, self.members, self.epoch, self._restoring = group, members, epoch, restoring
        if self.rank == members[0]:
            self.registry.establish(old, Topology(epoch=epoch, members=members, step=self.step, restoring=restoring))
        self._set_view(RankState.TRAINING)

    def _transfer_staging(self) -> StagingBuffer | None:
        path = self.config.transfer
        if path is TransferPath.AUTO:
            path = TransferPath.STAGED if (self.device.type == "cuda" and self.config.backend == "gloo") \
                else TransferPath.DIRECT
        return self.staging if path is TransferPath.STAGED else None

    def _feed(self, group: Group, joiner: int, epoch: int, members: Members, *, with_optimizer: bool,
              everything: bool = False) -> int:
        """Donor side: the outline, then parameters (and optimizer state) in the fixed order."""
        staging = self._transfer_staging()
        outline = self.state.outline(epoch=epoch, step=self.step, members=members,
                                     with_optimizer=with_optimizer or everything,
                                     transfer="staged" if staging else "direct", chunk_bytes=self.staging.budget_bytes)
        send_outline(group, joiner, outline, _TAG_OUTLINE)
        sent = send_tensors(group, joiner, self.state.param_tensors(), _TAG_PARAMS, staging)
        if outline.with_optimizer:
            sent += send_tensors(group, joiner, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        return sent

    def _receive(self, group: Group, donor: int) -> Outline:
        """Joiner side: check the outline against our model, then receive in place."""
        outline = recv_outline(group, donor, _TAG_OUTLINE)
        self.state.check_outline(outline)
        if outline.transfer == "staged" and outline.chunk_bytes != self.staging.budget_bytes:
            raise StateMismatch(f"donor stages in chunks of {outline.chunk_bytes} bytes, this rank in "
                                f"{self.staging.budget_bytes}: staging_bytes must be equal on all ranks")
        self._reclaim_storage()
        self.state.adopt_optimizer_layout(outline)
        staging = self.staging if outline.transfer == "staged" else None
        recv_tensors(group, donor, self.state.param_tensors(), _TAG_PARAMS, staging)
        if outline.with_optimizer:
            recv_tensors(group, donor, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        self.step = outline.step
        return outline

    def _join(self, intent: _Intent) -> str:
        """An idle (or drained) rank enters the training group: post, wait for the members
        to reach a boundary and claim the change, then receive and check the state."""
        change = intent.change
        assert change is not None
        self._set_view(RankState.JOINING)
        reg = self.registry
        reg.post(change, self.rank)
        t0 = time.perf_counter()
        st = self._await_claim(change, intent.deadline)
        if st.status is ChangeStatus.DONE:  # nothing to change (already a member)
            self._set_view(RankState.TRAINING)
            return st.detail
        if st.status is not ChangeStatus.APPLYING:
            self._set_view(RankState.IDLE)
            raise JoinFailed(f"join of {self._fmt((self.rank,))} {st.status.value}: {st.detail}")
        members, epoch = st.members, st.epoch
        sources = tuple(r for r in st.before if r in members)
        joiners = tuple(r for r in members if r not in st.before)
        try:
            t1 = time.perf_counter()
            self._barrier(members, f"e{epoch}", f"the join of epoch {epoch} ({change.cid})",
                          max(1.0, intent.deadline - time.time()), cid=change.cid)
            t2 = time.perf_counter()
            builds = self.comms.stats.builds
            group = self.comms.group(members)
            t3 = time.perf_counter()
            donor = assign_donors(sources, joiners, self.config.node_of)[self.rank]
            outline = self._receive(group, donor)
            t4 = time.perf_counter()
            tensors = self.state.all_tensors() if outline.with_optimizer else self.state.param_tensors()
            self._verify(group, tensors, f"states after joining {self._fmt(joiners)}")
            self._confirm(members, epoch, change.cid)
            t5 = time.perf_counter()
        except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch, Cancelled) as exc:
            if not (isinstance(exc, (PeerDied, WaitTimeout)) and self.registry.arrived(f"est{epoch}", members)):
                self.registry.settle(change.cid, ChangeState(ChangeStatus.FAILED, detail=str(exc)))
                self.comms.taint(members, f"join failed: {exc}")
                self.group, self.members, self.epoch = None, (), -1
                self._set_view(RankState.IDLE)
                raise JoinFailed(f"join of {self._fmt((self.rank,))} into epoch {epoch} {self._fmt(members)} "
                                 f"failed: {exc}") from exc
            # every member had confirmed the epoch: this rank is in, and the failure is the
            # group's to recover from, which it does at its next collective
            t5 = time.perf_counter()
            log.warning("a member failed right after the join was confirmed", rank=self.rank, error=str(exc))
        self.step = outline.step
        self._restoring = ()
        self._adopt_epoch(members, epoch, joiners, sources, group)
        self.switches.append(SwitchRecord(epoch, members, joiners, "joiner", t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                          outline.param_bytes + (outline.optimizer_bytes if outline.with_optimizer
                                                                 else 0), self.comms.stats.builds > builds))
        self._joined_at_boundary = True
        self.cursor = max(self.cursor, self._index_of(change.cid))
        opt_mb = outline.optimizer_bytes / 1e6
        self._restore_note = (f"optimizer state ({opt_mb:.1f} MB) restored with the parameters, verified"
                              if outline.with_optimizer else
                              f"optimizer state ({opt_mb:.1f} MB) from rank {donor} at the first step of epoch {epoch}"
                              if outline.optimizer else "no optimizer state yet (no step taken)")
        return (f"joined epoch {epoch} as rank {self.rank} of {self._fmt(members)} at step {self.step}: "
                f"{outline.param_bytes / 1e6:.1f} MB of parameters"
                + (f" + {opt_mb:.1f} MB optimizer state" if outline.with_optimizer else "")
                + f" from rank {donor} ({self._names(donor)}), verified; waited {t1 - t0:.2f} s for a step boundary, "
                f"barrier {1e3 * (t2 - t1):.1f} ms, group {1e3 * (t3 - t2):.1f} ms, transfer {1e3 * (t4 - t3):.1f} ms, "
                f"verify {1e3 * (t5 - t4):.1f} ms")

    def _index_of(self, cid: str) -> int:
        for i in range(self.registry.seq(), 0, -1):
            if self.registry.indexed(i) == cid:
                return i
        return 0

    def _await_claim(self, change: Change, deadline: float) -> ChangeState:
        holder: list[ChangeState] = []

        def settled() -> bool:
            st = self.registry.state(change.cid)
            if st is not None and st.status is not ChangeStatus.PENDING:
                holder.append(st)
                return True
            return False

        def finished() -> str | None:
            return "training has finished" if self.registry.finished() is not None else None

        try:
            self.watch.wait_until(settled, watch=lambda: (), timeout_s=max(0.0, deadline - time.time()),
                                  what=f"waiting for the members to take {change.cid} at a step boundary",
                                  names=self._names, cancelled=finished)
        except (WaitTimeout, Cancelled) as exc:
            why = "training finished" if isinstance(exc, Cancelled) else "the join timed out before a step boundary"
            cancelled = ChangeState(ChangeStatus.CANCELLED, detail=why)
            final = self.registry.settle(change.cid, cancelled)
            if final.status is not ChangeStatus.APPLYING:
                self._set_view(RankState.IDLE)
                raise JoinFailed(str(exc)) from exc
            holder.append(final)
        return holder[-1]

    def _lazy_restore(self) -> None:
        """At the first step of an epoch that took in joiners: donors send their optimizer
        state (which this step's update has not touched yet), then everyone checks it."""
        assert self.group is not None
        restoring, self._restoring = self._restoring, ()
        staging = self._transfer_staging()
        t0 = time.perf_counter()
        moved = 0
        for joiner, donor in restoring:
            if donor == self.rank:
                moved += send_tensors(self.group, joiner, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
            elif joiner == self.rank:
                moved += recv_tensors(self.group, donor, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        t1 = time.perf_counter()
        self._verify(self.group, self.state.optimizer_tensors(), "optimizer states after the lazy restore")
        if moved:
            self.switches.append(SwitchRecord(self.epoch, self.members, tuple(j for j, _ in restoring), "restore",
                                              0.0, 0.0, t1 - t0, time.perf_counter() - t1, moved, False))
        if any(j == self.rank for j, _ in restoring):
            self._restore_note = (f"optimizer state ({moved / 1e6:.1f} MB) restored lazily at step {self.step} "
                                  f"in {1e3 * (time.perf_counter() - t0):.1f} ms, verified")

    # -- checks and barriers ---------------------------------------------------------------------
    def _verify(self, group: Group, tensors: list[torch.Tensor], what: str, *, step_too: bool = True) -> Digest:
        mine = digest(tensors, staging=self.staging)
        rows = group.all_gather(mine.as_tensor(self.step if step_too else 0))
        values = [tuple(int(x) for x in r.tolist()) for r in rows]
        if len(set(values)) != 1:
            desc = "; ".join(f"rank {m}: crc32 {v[0] & 0xffffffff:08x}, {v[1]} bytes, step {v[2]}"
                             for m, v in zip(group.members, values, strict=True))
            raise StateMismatch(f"{what} differ across the group: {desc}")
        return mine

    def _barrier(self, members: Members, tag: str, what: str, timeout_s: float, *, cid: str | None = None) -> None:
        self.registry.arrive(tag, self.rank)

        def cancelled() -> str | None:
            if cid is None:
                return None
            st = self.registry.state(cid)
            return f"the change was {st.status.value}: {st.detail}" if st is not None and st.status in (
                ChangeStatus.FAILED, ChangeStatus.CANCELLED) else None

        self.watch.wait_until(lambda: self.registry.arrived(tag, members),
                              watch=lambda: self.registry.missing(tag, members), timeout_s=timeout_s,
                              what=what, names=self._names, cancelled=cancelled)

    # -- one optimizer step ------------------------------------------------------------------------
    def _train_step(self) -> None:
        assert self.group is not None
        started = time.perf_counter()
        n, k = self.config.micro_batches, len(self.members)
        index = self.members.index(self.rank)
        mine = tuple(mb for mb in range(n) if mb % k == index)
        model, loss_sum = self.state.model, 0.0
        model.train()
        try:
            if self.config.deterministic:
                rows = torch.zeros(math.ceil(n / k), self._flat.numel(), dtype=self._flat.dtype, device=self.device)
                for j, mb in enumerate(mine):
                    model.zero_grad(set_to_none=False)
                    loss = self.job.micro_batch_loss(model, self.step, mb)
                    loss.backward()
                    loss_sum += float(loss.detach())
                    self._flatten_grads(rows[j])
                self._delay(started)
                gathered = self.group.all_gather(rows)
                total = self._flat
                total.copy_(gathered[0][0])
                for mb in range(1, n):  # fixed micro-batch order, whatever the group size
                    total.add_(gathered[mb % k][mb // k])
            else:
                model.zero_grad(set_to_none=False)
                for mb in mine:
                    loss = self.job.micro_batch_loss(model, self.step, mb)
                    loss.backward()
                    loss_sum += float(loss.detach())
                self._flatten_grads(self._flat)
                self._delay(started)
                self.group.all_reduce(self._flat)
            self._flat.div_(n)
            self._unflatten_grads(self._flat)
            if self._restoring:
                self._lazy_restore()
        except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch) as exc:
            self._recover(exc)  # the step is redone on the survivors: its samples are trained on once
            return
        self.state.optimizer.step()
        self.step += 1
        record = StepRecord(step=self.step, epoch=self.epoch, members=self.members, micro_batches=mine, loss=loss_sum,
                            seconds=time.perf_counter() - started)
        if self.config.record_digests:
            record = msgspec.structs.replace(
                record, params_sha=f"{digest(self.state.param_tensors(), staging=self.staging, strong=True).value:x}",
                optimizer_sha=f"{digest(self.state.optimizer_tensors(), staging=self.staging, strong=True).value:x}")
        self.history.append(record)
        self._set_view(RankState.TRAINING)
        if self.on_step is not None:
            self.on_step(record)

    def _delay(self, started: float) -> None:
        left = self.config.step_delay_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    def _flatten_grads(self, out: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                out[offset:offset + n].zero_()
            else:
                out[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n

    def _unflatten_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    # -- failures ------------------------------------------------------------------------------------
    def _recover(self, exc: BaseException, base: Topology | None = None) -> None:
        """Survive a failed collective: agree on the survivors, rebuild, re-synchronise."""
        log.warning("training group failed; recovering", rank=self.rank, epoch=self.epoch, error=str(exc))
        self._recovered = True
        if self.group is not None:
            self.comms.taint(self.group.members, str(exc))
        self.group = None
        for attempt in range(len(self.config.devices) + 1):
            # The epoch this rank was in (not the store's latest): a survivor that notices
            # late must still meet the others at the same recovery record.
            topo = base or Topology(epoch=self.epoch, members=self.members, step=self.step)
            if self.rank not in topo.members:
                self._become_idle(f"not in the established membership after a failure ({exc})")
                return
            decision = self._decide_survivors(topo, exc)
            if decision.dead:
                self.comms.discard_containing(decision.dead, f"rank(s) {list(decision.dead)} died")
            if self.rank not in decision.members:
                self._become_idle(f"the survivors' decision left this rank out: {decision.reason}")
                return
            try:
                self._barrier(decision.members, f"r{decision.epoch}", f"recovery to epoch {decision.epoch}",
                              self.config.collective_timeout_s * 2 + self.config.peer_timeout_s)
                group = self.comms.group(decision.members)
                source = self._resync(group, decision)
            except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch) as again:
                log.warning("recovery failed; trying again", rank=self.rank, attempt=attempt, error=str(again))
                self.comms.taint(decision.members, str(again))
                exc = again
                base = Topology(epoch=decision.epoch, members=decision.members, step=self.step)
                continue
            self.group, self.members, self.epoch, self._restoring = group, decision.members, decision.epoch, ()
            if self.rank == decision.members[0]:
                self.registry.establish(self.registry.topology(),
                                        Topology(epoch=decision.epoch, members=decision.members, step=self.step))
            self._set_view(RankState.TRAINING)
            log.info("recovered", rank=self.rank, epoch=decision.epoch, members=list(decision.members),
                     dead=list(decision.dead), step=self.step, state_from=source)
            return
        raise TrainingLost(f"rank {self.rank} could not recover the training group: {exc}")

    def _decide_survivors(self, topo: Topology, exc: BaseException) -> Recovery:
        """Check in for the recovery of `topo.epoch`; the first rank to see every member
        either checked in or silent (dead, or gone: a drained rank never checks in) for the
        observation window proposes the ones that checked in. First proposal wins."""
        tag = f"rec{topo.epoch}"
        self.registry.arrive(tag, self.rank)
        window = self.config.peer_timeout_s * 2
        deadline = time.monotonic() + window
        self.watch.forget(topo.members)
        while True:
            decided = self.registry.recovery(topo.epoch)
            if decided is not None:
                return decided
            missing = self.registry.missing(tag, topo.members)
            self.watch.sample(missing)
            if not missing or set(self.watch.dead(missing)) == set(missing) or time.monotonic() > deadline:
                checked = tuple(r for r in topo.members if r not in missing)
                return self.registry.decide_recovery(Recovery(
                    from_epoch=topo.epoch, epoch=self.registry.new_epoch(), members=checked,
                    dead=tuple(missing), reason=str(exc)))
            time.sleep(0.02)

    def _resync(self, group: Group, decision: Recovery) -> int:
        """Make every survivor's state equal to the most advanced complete one."""
        complete = not any(j == self.rank for j, _ in self._restoring)
        mine = digest(self.state.all_tensors(), staging=self.staging)
        rows = [tuple(int(x) for x in r.tolist()) for r in group.all_gather(mine.as_tensor(self.step, complete))]
        candidates = [(row[2], -m) for m, row in zip(group.members, rows, strict=True) if row[3]]
        if not candidates:
            raise TrainingLost(f"no survivor of {self._fmt(group.members)} holds a complete state")
        source = -max(candidates)[1]
        src_row = rows[group.members.index(source)]
        behind = tuple(m for m, row in zip(group.members, rows, strict=True) if row[:3] != src_row[:3])
        for m in behind:
            if self.rank == source:
                self._feed(group, m, decision.epoch, decision.members, with_optimizer=True, everything=True)
            elif self.rank == m:
                self._receive(group, source)
        if behind:
            self._verify(group, self.state.all_tensors(), "states after the recovery re-sync")
        return source

    def _become_idle(self, why: str) -> None:
        log.warning("rank leaves training", rank=self.rank, why=why)
        self.group, self.members, self.epoch, self._restoring = None, (), -1, ()
        self._set_view(RankState.IDLE)

    # -- intents (run on the loop while the rank is not training) -----------------------------------
    def _run_intent(self, intent: _Intent) -> None:
        before = self._view.state
        try:
            if intent.kind == "join":
                detail = self._join(intent)
            elif intent.kind == "release":
                detail = self._release_state()
                self._set_view(RankState.IDLE)
            elif intent.kind == "reclaim":
                detail = self._reclaim_storage()
                self._set_view(RankState.DRAINED)
            else:
                raise ValueError(f"unknown intent {intent.kind!r}")
        except Exception as exc:
            if self._view.state is RankState.JOINING:  # whatever failed, this rank is not a member
                self.group, self.members, self.epoch = None, (), -1
                self._set_view(before)
            _resolve(intent.future, exc=exc)
            return
        _resolve(intent.future, detail)

    def _release_state(self) -> str:
        if self._offload_dir is None:
            return "state kept in place (no offload_dir)"
        if self.state.released is not None:
            return f"state already parked in {self.state.released}"
        path = self._offload_dir / f"rank{self.rank}-{time.time_ns()}.state"
        t0 = time.perf_counter()
        written = self.state.release(path, self.staging)
        return (f"state parked in {path} ({written / 1e6:.1f} MB through a {self.staging.budget_bytes >> 20} MiB "
                f"staging buffer in {time.perf_counter() - t0:.2f} s) and freed")

    def _reclaim_storage(self) -> str:
        if self.state.released is None:
            return "state was in place"
        path = self.state.released
        t0 = time.perf_counter()
        read = self.state.reclaim(self.staging)
        return f"state restored in place from {path} ({read / 1e6:.1f} MB in {time.perf_counter() - t0:.2f} s)"

    def _submit(self, kind: str, change: Change | None = None, deadline: float = 0.0) -> concurrent.futures.Future:  # type: ignore[type-arg]
        future: concurrent.futures.Future = concurrent.futures.Future()  # type: ignore[type-arg]
        if self._view.state in (RankState.FINISHED, RankState.FAILED):
            raise NotReady(f"trainer rank {self.rank} has stopped ({self._view.state.value})"
                           + (f": {self.fatal}" if self.fatal else ""))
        self._intents.put(_Intent(kind=kind, future=future, change=change, deadline=deadline))
        return future

    def _waiter(self, cid: str) -> concurrent.futures.Future:  # type: ignore[type-arg]
        future: concurrent.futures.Future = concurrent.futures.Future()  # type: ignore[type-arg]
        with self._waiters_lock:
            self._waiters.setdefault(cid, []).append(future)
        return future

    def _notify(self, cid: str, detail: str) -> None:
        with self._waiters_lock:
            futures = self._waiters.pop(cid, [])
        for f in futures:
            _resolve(f, detail)

    def _fail_all(self, exc: BaseException) -> None:
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for f in futures:
                _resolve(f, exc=exc)

    # -- op handlers (the worker client calls these) --------------------------------------------------
    def _ranks(self, devices: tuple[str, ...]) -> Members:
        return tuple(sorted(self.config.rank_of(d) for d in devices if d in self.config.devices))

    def _expect(self, op: Any) -> Members:
        unknown = [d for d in op.training if d not in self.config.devices]
        if unknown:
            raise ValueError(f"{op.kind.value} {op.op_id}: training pool names devices without a trainer in this "
                             f"job: {unknown}")
        return self._ranks(tuple(op.training))

    def _movers(self, op: Any) -> Members:
        movers = self._ranks(tuple(op.devices))
        if self.rank not in movers:
            raise ValueError(f"{op.kind.value} {op.op_id} names devices {list(op.devices)}, not this rank's "
                             f"{self.config.device}")
        return movers

    async def _call(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._handler_lock:
                return fn()
        return await asyncio.to_thread(locked)

    async def join(self, op: Any) -> str:
        """JOIN: enter the training group at the members' next step boundary."""
        movers = self._movers(op)
        expect = self._expect(op)
        if self._view.state is RankState.TRAINING and self.rank in self._view.members:
            return f"already training in epoch {self._view.epoch} {self._fmt(self._view.members)}"
        if self._view.state not in (RankState.IDLE, RankState.DRAINED):
            raise NotReady(f"join {op.op_id}: rank {self.rank} is {self._view.state.value}")
        change = Change(cid=f"{op.resize_id}/join", add=movers, expect=expect, op_id=op.op_id)
        future = self._submit("join", change, deadline=time.time() + op.timeout_s)
        return await asyncio.wrap_future(future)

    async def restore(self, op: Any) -> str:
        """RESTORE: optimizer state, eagerly with the join or lazily at the first step."""
        self._movers(op)
        if self._view.state is not RankState.TRAINING:
            raise NotReady(f"restore {op.op_id}: rank {self.rank} has not joined (it is {self._view.state.value})")
        return self._restore_note or "optimizer state is this rank's own"

    async def commit(self, op: Any) -> str:
        """COMMIT: confirm the group trains on the membership the daemon committed."""
        expect = self._expect(op)
        if self.rank not in expect:
            raise NotReady(f"commit {op.op_id} was sent to rank {self.rank}, which is not in the committed training "
                           f"pool {self._fmt(expect)}")
        deadline = time.monotonic() + op.timeout_s
        while True:
            v = self._view
            if v.state is RankState.FINISHED and v.members == expect:
                # The last resize of a run may commit after the final step: nothing to switch.
                return f"training finished at step {v.step} on the committed membership (epoch {v.epoch})"
            if v.state is RankState.TRAINING and v.members == expect:
                n = self.config.micro_batches
                split = "/".join(str(len(range(i, n, len(expect)))) for i in range(len(expect)))
                return (f"training on {self._fmt(expect)} in epoch {v.epoch} since step {v.step}: {n} micro-batches "
                        f"split {split}")
            if v.state in (RankState.FAILED, RankState.FINISHED) or time.monotonic() > deadline:
                raise NotReady(f"commit {op.op_id}: the daemon committed {self._fmt(expect)} but this rank is "
                               f"{v.state.value} on {self._fmt(v.members)} (epoch {v.epoch})")
            await asyncio.sleep(0.01)

    async def drain(self, op: Any) -> str:
        """DRAIN: leave the training group at the next optimizer-step boundary."""
        movers = self._movers(op)
        if self._view.state is RankState.DRAINED:
            return f"already drained at step {self._view.step}"
        if self._view.state is not RankState.TRAINING:
            raise NotReady(f"drain {op.op_id}: rank {self.rank} is not training ({self._view.state.value})")
        change = Change(cid=f"{op.resize_id}/drain", remove=movers, expect=self._expect(op), op_id=op.op_id)
        return await self._leave_request(change)

    async def _leave_request(self, change: Change) -> str:
        future = self._waiter(change.cid)
        await self._call(lambda: self._handler_registry.post(change, self.rank))
        while True:
            done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=0.05)
            if done:
                return done.pop().result()
            st = await self._call(lambda: self._handler_registry.state(change.cid))
            if st is not None and st.status in (ChangeStatus.REJECTED, ChangeStatus.FAILED, ChangeStatus.CANCELLED):
                raise NotReady(f"{change.cid} was {st.status.value}: {st.detail}")
            if self._view.state in (RankState.FAILED, RankState.FINISHED):
                raise NotReady(f"rank {self.rank} stopped ({self._view.state.value}) before leaving")

    async def release(self, op: Any) -> str:
        """RELEASE: give the device up; the state is parked in host memory if configured."""
        self._movers(op)
        if self._view.state is RankState.IDLE:
            return "not holding the device (idle)"
        if self._view.state is not RankState.DRAINED:
            raise NotReady(f"release {op.op_id}: rank {self.rank} must be drained first (it is "
                           f"{self._view.state.value})")
        return await asyncio.wrap_future(self._submit("release"))

    async def reclaim(self, op: Any) -> str:
        """RECLAIM (undo RELEASE): take the device back and restore the parked state in place."""
        self._movers(op)
        if self._view.state is RankState.DRAINED:
            return "still holding the device (release never happened)"
        if self._view.state is not RankState.IDLE:
            raise NotReady(f"reclaim {op.op_id}: rank {self.rank} is {self._view.state.value}")
        return await asyncio.wrap_future(self._submit("reclaim"))

    async def _cancel_if_pending(self, cid: str, op: Any) -> bool:
        """Undo ops first try to cancel the change they undo: True if it had not taken effect yet."""
        st = await self._call(lambda: self._handler_registry.state(cid))
        if st is None or st.status is not ChangeStatus.PENDING:
            return False
        final = await self._call(lambda: self._handler_registry.settle(
            cid, ChangeState(ChangeStatus.CANCELLED, detail=f"cancelled by {op.op_id}")))
        return final.status is ChangeStatus.CANCELLED

    async def resume(self, op: Any) -> str:
        """RESUME (undo DRAIN): train again; a pending drain is cancelled, a done one is
        undone by re-joining with a state transfer (the others may have stepped on)."""
        self._movers(op)
        if await self._cancel_if_pending(f"{op.resize_id}/drain", op):
            return "drain cancelled before it took effect; still training"
        if self._view.state is RankState.TRAINING:
            return f"training in epoch {self._view.epoch} {self._fmt(self._view.members)}"
        if self._view.state not in (RankState.DRAINED, RankState.IDLE):
            raise NotReady(f"resume {op.op_id}: rank {self.rank} is {self._view.state.value}")
        change = Change(cid=f"{op.resize_id}/resume", add=(self.rank,), op_id=op.op_id)
        return await asyncio.wrap_future(self._submit("join", change, deadline=time.time() + op.timeout_s))

    async def evict(self, op: Any) -> str:
        """EVICT (undo JOIN): a pending join is cancelled; a done one leaves at the next boundary."""
        self._movers(op)
        if await self._cancel_if_pending(f"{op.resize_id}/join", op):
            return "join cancelled before it took effect"
        deadline = time.monotonic() + op.timeout_s
        while self._view.state is RankState.JOINING and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the join is being applied: let it finish, then leave
        if self._view.state is not RankState.TRAINING:
            return f"not in the training group ({self._view.state.value}); nothing to evict"
        change = Change(cid=f"{op.resize_id}/evict", remove=(self.rank,), op_id=op.op_id)
        return await self._leave_request(change)

    def handlers(self) -> dict[OpKind, OpHandler]:
        return op_handlers(self)


def _resolve(future: concurrent.futures.Future, result: Any = None, *, exc: BaseException | None = None) -> None:  # type: ignore[type-arg]
    if future.done():
        # The handler gave up (its op timed out and was reported as failed); the outcome is
        # in the log line of whoever finished the work.
        log.info("op outcome arrived after its handler gave up", result=str(exc or result)[:200])
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        log.info("op outcome arrived after its handler gave up", result=str(exc or result)[:200])


def default_offload_dir() -> str:
    """Host memory outside the trainer process: tmpfs when the machine has it."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else tempfile.gettempdir()
