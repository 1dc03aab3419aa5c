"""What a trainer rank is configured with, the states it goes through and what it records.

Shared by the parts of `TrainerRank` (the step loop, the step boundary, state transfer,
recovery, the daemon's op handlers), which import these and nothing of each other's but
`assign_donors` and the intent record.
"""

from __future__ import annotations

import enum

import msgspec

from dynaresized.backends.torch.membership import Members
from dynaresized.domain import Holding

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
    micro_batches: int = 8  # the global batch of one RL step, in micro-batches; fixed for the whole job
    # Optimizer steps per RL step (verl's ppo_mini_batch_size): the global batch is cut into this
    # many consecutive mini-batches of micro_batches / mini_batches micro-batches each. The
    # boundaries between them are where a loan joins inside the step.
    mini_batches: int = 1
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
        if self.mini_batches < 1 or self.micro_batches % self.mini_batches:
            problems.append(f"mini_batches={self.mini_batches} must be at least 1 and divide "
                            f"micro_batches={self.micro_batches}")
        elif self.mini_batch_size < max(1, len(self.initial)):
            batch = (f"micro_batches={self.micro_batches}" if self.mini_batches == 1 else
                     f"a mini-batch of {self.mini_batch_size} micro-batches")
            problems.append(f"{batch} cannot be split over {len(self.initial)} initial ranks")
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

    @property
    def mini_batch_size(self) -> int:
        """Micro-batches per mini-batch (per optimizer step): the largest group that can train."""
        return self.micro_batches // self.mini_batches

    def position(self, optimizer_step: int) -> tuple[int, int]:
        """(RL step, mini-batch within it) of the `optimizer_step`-th optimizer step (0-based)."""
        return divmod(optimizer_step, self.mini_batches)

    def micro_batches_of(self, mini_batch: int) -> range:
        """The global batch's micro-batch indices that mini-batch `mini_batch` sums, in order."""
        size = self.mini_batch_size
        return range(mini_batch * size, (mini_batch + 1) * size)


class StepRecord(msgspec.Struct, frozen=True):
    step: int  # optimizer steps done, this one included (= RL steps done when mini_batches is 1)
    epoch: int
    members: Members
    micro_batches: tuple[int, ...]  # the micro-batches this rank computed
    loss: float  # sum of this rank's micro-batch losses
    seconds: float
    params_sha: str = ""
    optimizer_sha: str = ""
    rl_step: int = 0  # the RL step (0-based) this optimizer step belongs to
    mini_batch: int = 0  # its mini-batch within that RL step (0-based)
    mini_batches: int = 1  # mini-batches per RL step

    @property
    def ends_rl_step(self) -> bool:
        return self.mini_batch == self.mini_batches - 1


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
