"""Cluster profiles: the hardware, model and cost parameters of a simulated cluster.

A profile is a TOML file decoded with msgspec into `Profile`; unknown keys are errors, so a
typo never silently falls back to a default. Built-in profiles ship as package data under
`dynaresized/sim/profiles/`; `load_profile` takes a built-in name or a path. Every field is
documented here; docs/simulator.md explains where the built-in numbers come from.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import msgspec

from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import LoanCosts
from dynaresized.domain import FORWARD_ORDER, OpKind, PipelineSpec, Pool, Split


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gpus: int
    """Devices in the cluster (each is one GPU)."""
    initial_train: int
    """Devices in the training pool at the start; the rest start in the rollout pool."""
    gpus_per_node: int = 8
    """Only used to name devices ("node1:gpu3")."""
    candidates: tuple[str, ...] = ()
    """Allowed Train:Rollout splits, e.g. ["6:2", "4:4"]; empty means every split."""


class RolloutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode cost model of one inference engine (continuous batching, memory-bound decode).

    One decode iteration advances every running request by one token and costs
    `iter_base_s + iter_per_seq_s * running + iter_per_ctx_token_s * sum(context of running)`.
    """

    gpus_per_engine: int = 1
    """Tensor-parallel size: devices per engine."""
    max_num_seqs: int = 256
    """Most requests an engine runs at once (vLLM `max_num_seqs`)."""
    kv_cache_tokens: int = 400_000
    """KV-cache capacity of one engine, in tokens; long contexts shrink the running batch."""
    iter_base_s: float = 0.006
    """Per iteration, whatever the batch: reading the weights once, kernel launches."""
    iter_per_seq_s: float = 0.00018
    """Per running request per iteration: the matmul compute of one token."""
    iter_per_ctx_token_s: float = 4.0e-8
    """Per context token of a running request per iteration: reading its KV cache."""
    prefill_per_token_s: float = 0.00018
    """Per prompt token, once (prefill is compute-bound)."""
    tp_sizes: tuple[int, ...] = ()
    """Engine sizes (tensor-parallel degrees) the best static configuration may use, e.g.
    [1, 2, 4, 8] (each must divide the model's attention heads); empty means only
    `gpus_per_engine`. The costs above are those of an engine of `gpus_per_engine` devices;
    `at_tp` derives an engine of k devices from them (docs/simulator.md, "Tensor parallelism")."""
    iter_fixed_s: float = 0.0
    """Of `iter_base_s`, what does not split across an engine's devices (kernel launches,
    scheduling); the rest of it (reading the weights) splits k ways."""
    layers: int = 0
    """Transformer layers (each pays its tensor-parallel all-reduces once per iteration)."""
    allreduce_s: float = 0.0
    """Seconds one layer's all-reduces take per iteration at TP-2; at TP-k, `log2(k)` times
    that (a latency-bound, tree-shaped all-reduce of a decode batch's activations)."""
    weights_kv_tokens: int = 0
    """The weights' size in tokens of KV cache: what an engine of k devices holds once, so its
    KV capacity is k x (one device's) minus this."""

    def comm_s(self, devices: int) -> float:
        """Seconds of all-reduces per decode iteration of an engine of `devices` devices."""
        return self.layers * self.allreduce_s * math.log2(devices) if devices > 1 else 0.0

    def at_tp(self, devices: int) -> RolloutSpec:
        """The same model on engines of `devices` devices: the weights' read, the per-sequence
        compute, the KV reads and the prefill split `devices` ways; `iter_fixed_s` does not
        split; the all-reduces grow with `comm_s`; the KV capacity is `devices` devices' memory
        less one copy of the weights."""
        g = self.gpus_per_engine
        if devices == g:
            return self
        if devices < 1:
            raise ProfileError(f"an engine needs at least one device, got {devices}")
        scale = g / devices
        split_base = max(self.iter_base_s - self.iter_fixed_s - self.comm_s(g), 0.0)
        kv = int((self.kv_cache_tokens + self.weights_kv_tokens) * devices / g) - self.weights_kv_tokens
        if kv < 1:
            raise ProfileError(f"an engine of {devices} device(s) has no room for KV cache "
                               f"({self.weights_kv_tokens} tokens of weights)")
        return msgspec.structs.replace(
            self, gpus_per_engine=devices, kv_cache_tokens=kv,
            iter_base_s=split_base * scale + self.iter_fixed_s + self.comm_s(devices),
            iter_per_seq_s=self.iter_per_seq_s * scale, iter_per_ctx_token_s=self.iter_per_ctx_token_s * scale,
            prefill_per_token_s=self.prefill_per_token_s * scale)

    def engine_sizes(self) -> tuple[int, ...]:
        """The engine sizes a configuration may use (`tp_sizes`, or `gpus_per_engine`)."""
        return tuple(sorted(set(self.tp_sizes))) if self.tp_sizes else (self.gpus_per_engine,)


class TrainingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Trainer cost model: old-log-prob forward plus the policy update, data parallel."""

    update_tokens_per_s: float
    """Tokens per second per device for the update (forward + backward + optimizer)."""
    logprob_tokens_per_s: float
    """Tokens per second per device for the old (and reference) log-prob forward passes."""
    attention_tokens: float = 0.0
    """A sequence of S tokens costs S * (1 + S / attention_tokens) token-equivalents (the
    quadratic attention term); 0 turns the term off."""
    dp_efficiency_per_doubling: float = 1.0
    """Data-parallel efficiency lost per doubling of the training pool (1.0 = perfect)."""
    step_overhead_s: float = 0.0
    """Fixed seconds per step that do not shrink with more devices (optimizer, barriers)."""
    mini_batches_per_step: int = 16
    """Optimizer steps (mini-batches) per RL step: the boundaries where a lent device joins."""


class SyncSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    weight_sync_s: float = 2.0
    """Disaggregated: seconds per step to push new weights from trainers to engines."""
    colocated_switch_s: float = 10.0
    """Colocated: seconds per step to switch every device between training and generation
    (resharding, offload/onload, KV-cache wake-up), both ways together."""


class OpCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds of each resize operation for one direction (DESIGN.md §5).

    drain, release, join and restore run one after the other while the moving devices serve
    neither pool; commit happens at the next step boundary and, with `first_step_s`, delays
    the destination pool's first step on the new topology."""

    drain_s: float
    release_s: float
    join_s: float
    restore_s: float
    commit_s: float
    first_step_s: float = 0.0
    """Extra seconds of the destination's first step (lazy optimizer restore, graph capture)."""

    def op_s(self, kind: OpKind) -> float:
        """Seconds of op `kind` (an undo costs what the op it undoes cost)."""
        kind = _FORWARD_OF_UNDO.get(kind, kind)
        return {OpKind.DRAIN: self.drain_s, OpKind.RELEASE: self.release_s, OpKind.JOIN: self.join_s,
                OpKind.RESTORE: self.restore_s, OpKind.COMMIT: self.commit_s}[kind]

    def ready_s(self) -> float:
        """Drain, release, join and restore one after the other, and the first step: how long
        the moving devices serve nothing before they serve again (the commit aside)."""
        return self.drain_s + self.release_s + self.join_s + self.restore_s + self.first_step_s

    def sequence_s(self) -> float:
        """Every op of the sequence and the first step after it."""
        return self.ready_s() + self.commit_s


REGROUP_COSTS = OpCosts(drain_s=1.0, release_s=5.0, join_s=30.0, restore_s=5.0, commit_s=0.0, first_step_s=3.0)
"""A regroup's seconds where a profile does not say (`[resize.regroup]`): at a step boundary
nothing is in flight (drain); the old engines shut down (release: a vLLM engine cannot change
its ranks while it runs); the new ones start over their devices, a process per rank, with a
fresh communicator and the base weights from disk (join); the current weights come from host
memory, each rank its slice, and the KV cache and CUDA graphs are made (restore). An
assumption for GPUs (on CPU slots a regroup measured 16-21 s: `benchmarks/vllm_regroup.py`)."""


class NaiveCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The naive baseline: stop the pipeline, destroy and recreate actors with fresh
    communicators, reload state; nothing is pre-warmed and nothing overlaps."""

    drain_s: float
    teardown_s: float
    """Destroy actors, clear device state (release)."""
    init_process_group_s: float
    """Fresh communicators for the new topology, every rank (join)."""
    load_state_s: float
    """Reload weights and optimizer state onto the new topology (restore)."""
    restart_s: float
    """Restart the pipeline on the new topology (commit)."""


class TailSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tail regroup inside a step (`[resize.tail]`, `--policy-option tail_regroup=true`): an
    engine still decoding the step's last requests and idle engines become one wider engine
    for the rest of the step, and the engines they were at the step boundary. An assumption for
    GPUs: the wider group's communicators are made before the run (as a pipelined resize's
    are), every engine keeps its process and weights, and the running requests' KV cache moves
    over NVLink (8 requests of 16K tokens of an 8B model: ~2 GB, well under a second)."""

    switch_s: float = 2.0
    """Pause the engines, move the running requests' KV cache onto the wider group, resume."""
    back_s: float = 1.0
    """At the step boundary: the wider engine becomes the engines it was made of (their
    communicators kept); the next rollout starts that late on its devices."""
    kv_moved: bool = True
    """False: the wider engine prefills each running request's prompt and tokens again."""


class ResizeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    to_training: OpCosts
    to_rollout: OpCosts
    naive: NaiveCosts
    regroup: OpCosts = REGROUP_COSTS
    """Seconds of each op of a regroup (rollout devices forming engines of another size), on
    each of its devices at once (`[resize.regroup]`)."""
    tail: TailSpec = TailSpec()
    op_timeout_s: float = 86_400.0
    """The core's op timeout in the simulator: COMMIT waits for a step boundary, so it must
    exceed the longest step."""


class LoanSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds of a loan (an idle engine lent to the training step in progress, DESIGN.md §5).
    Communicators are pre-warmed and the engine process is kept, as for a pipelined resize."""

    engine_release_s: float = 1.0
    """The idle engine sleeps: KV cache freed, weights offloaded (drain costs nothing: idle)."""
    trainer_join_s: float = 5.0
    """The device's trainer enters the pre-warmed group; parameters stream in from its peers."""
    group_change_s: float = 1.0
    """Paid by the training step at every mini-batch boundary where its group changes."""
    trainer_first_step_s: float = 2.0
    """Extra seconds of the joiner's first mini-batch (its optimizer shard restored lazily)."""
    trainer_leave_s: float = 1.0
    """At the step boundary the trainer leaves; its optimizer shard goes back through host memory."""
    engine_wake_s: float = 3.0
    """The engine wakes with the new weights; the device's first rollout request starts this late."""


class WorkloadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one RL step looks like on this cluster (used by the built-in scenarios)."""

    samples_per_step: int
    samples_per_prompt: int
    max_response_tokens: int
    prompt_median_tokens: float = 180.0


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    cluster: ClusterSpec
    rollout: RolloutSpec
    training: TrainingSpec
    sync: SyncSpec
    resize: ResizeSpec
    workload: WorkloadSpec
    guards: GuardConfig = GuardConfig()
    """The hysteresis guards the core applies (see dynaresized.core.guards.GuardConfig)."""
    loan: LoanSpec = LoanSpec()
    """Loan costs (`[loan]`); defaults apply when the section is absent."""
    pipeline: PipelineSpec = PipelineSpec()
    """The job's pipeline (`[pipeline]`: mode, staleness, partial_rollout, sync_every); absent:
    one-step off."""

    @property
    def initial_split(self) -> Split:
        return Split(train=self.cluster.initial_train, rollout=self.cluster.gpus - self.cluster.initial_train)

    def candidate_splits(self) -> tuple[Split, ...]:
        return tuple(parse_split(c) for c in self.cluster.candidates)

    def op_seconds(self, kind: OpKind, to_pool: Pool, *, naive: bool = False) -> float:
        """Seconds one resize operation takes. Undo ops cost what the op they undo cost."""
        kind = _FORWARD_OF_UNDO.get(kind, kind)
        if naive:
            n = self.resize.naive
            return {
                OpKind.DRAIN: n.drain_s,
                OpKind.RELEASE: n.teardown_s,
                OpKind.JOIN: n.init_process_group_s,
                OpKind.RESTORE: n.load_state_s,
                OpKind.COMMIT: n.restart_s,
            }[kind]
        c = self.resize.to_training if to_pool is Pool.TRAINING else self.resize.to_rollout
        return c.op_s(kind)

    def loan_op_seconds(self, kind: OpKind, to_pool: Pool, *, naive: bool = False) -> float:
        """Seconds of one op of a loan (to_pool TRAINING) or of its return (to_pool ROLLOUT).
        Naive: every loan tears down, builds fresh communicators and reloads state."""
        kind = _FORWARD_OF_UNDO.get(kind, kind)
        if naive:
            n = self.resize.naive
            return {OpKind.DRAIN: 0.0, OpKind.RELEASE: n.teardown_s,
                    OpKind.JOIN: n.init_process_group_s + n.load_state_s}.get(kind, 0.0)
        c = self.loan
        if to_pool is Pool.TRAINING:
            return {OpKind.RELEASE: c.engine_release_s, OpKind.JOIN: c.trainer_join_s}.get(kind, 0.0)
        return {OpKind.RELEASE: c.trainer_leave_s, OpKind.JOIN: c.engine_wake_s}.get(kind, 0.0)

    def loan_costs(self, *, naive: bool = False) -> LoanCosts:
        """What a loan on this cluster costs, as the core's `LoanCosts` (the simulator's core,
        and the demo's daemon, `[loan_costs]`): to training, the group change and the joiner's
        first mini-batch; the way home, the trainer leaving and the engine waking; the lead,
        the loan's ops. Naive: every op tears down and builds afresh."""
        loan = self.loan
        to_training = (loan.group_change_s + loan.trainer_first_step_s if not naive
                       else sum(self.loan_op_seconds(k, Pool.TRAINING, naive=True) for k in FORWARD_ORDER))
        back = (loan.trainer_leave_s + loan.engine_wake_s if not naive
                else sum(self.loan_op_seconds(k, Pool.ROLLOUT, naive=True) for k in FORWARD_ORDER))
        lead = sum(self.loan_op_seconds(k, Pool.TRAINING, naive=naive) for k in FORWARD_ORDER)
        return LoanCosts(to_training_s=to_training, to_rollout_s=to_training, return_s=back, lead_s=lead)

    def with_tp(self, devices: int) -> Profile:
        """The same profile with rollout engines of `devices` devices (`RolloutSpec.at_tp`)."""
        if devices == self.rollout.gpus_per_engine:
            return self
        return msgspec.structs.replace(self, rollout=self.rollout.at_tp(devices))

    def with_layout(self, tp: int | None = None, initial: Split | None = None) -> Profile:
        """The same profile with engines of `tp` devices (one of `rollout.tp_sizes`) and/or
        starting at the split `initial` (its devices must add up to the cluster's)."""
        out = self
        if tp is not None:
            sizes = self.rollout.engine_sizes()
            if tp not in sizes:
                raise ProfileError(f"profile {self.name}: engines of {tp} device(s) are not allowed "
                                   f"(rollout.tp_sizes: {list(sizes)})")
            out = out.with_tp(tp)
        if initial is not None:
            if initial.train + initial.rollout != self.cluster.gpus or initial.train < 1 or initial.rollout < 1:
                raise ProfileError(f"profile {self.name}: initial split {initial} must cover the cluster's "
                                   f"{self.cluster.gpus} devices with at least one in each pool")
            out = msgspec.structs.replace(out, cluster=msgspec.structs.replace(out.cluster, initial_train=initial.train))
        return out

    def widest_engine(self) -> int:
        """The most devices one engine may have on this cluster (for the fluid bound)."""
        fits = [k for k in self.rollout.engine_sizes() if k <= self.cluster.gpus]
        return max(fits, default=self.rollout.gpus_per_engine)

    def with_gpus(self, gpus: int) -> Profile:
        """The same profile on `gpus` devices, keeping the initial training share."""
        if gpus < 2:
            raise ProfileError(f"a disaggregated cluster needs at least 2 devices, got gpus={gpus}")
        if gpus == self.cluster.gpus:
            return self
        train = min(max(round(self.cluster.initial_train * gpus / self.cluster.gpus), 1), gpus - 1)
        cluster = msgspec.structs.replace(self.cluster, gpus=gpus, initial_train=train, candidates=())
        return msgspec.structs.replace(self, cluster=cluster)

    def with_samples(self, samples: int) -> Profile:
        if samples < 1:
            raise ProfileError(f"samples per step must be >= 1, got {samples}")
        return msgspec.structs.replace(self, workload=msgspec.structs.replace(self.workload, samples_per_step=samples))


_FORWARD_OF_UNDO = {OpKind.RESUME: OpKind.DRAIN, OpKind.RECLAIM: OpKind.RELEASE, OpKind.EVICT: OpKind.JOIN}


class ProfileError(ValueError):
    pass


def parse_split(text: str) -> Split:
    """`Split.parse`, with a profile's error."""
    try:
        return Split.parse(text)
    except ValueError:
        raise ProfileError(f"split {text!r} must look like TRAIN:ROLLOUT, e.g. 6:2") from None


def builtin_profiles() -> list[str]:
    folder = resources.files("dynaresized.sim") / "profiles"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or a TOML file by path."""
    text = str(name_or_path)
    if text in builtin_profiles():
        data = (resources.files("dynaresized.sim") / "profiles" / f"{text}.toml").read_bytes()
        source = f"built-in profile {text}"
    else:
        path = Path(text)
        if not path.is_file():
            raise ProfileError(
                f"no profile {text!r}: not a built-in ({', '.join(builtin_profiles())}) and no such file"
            )
        data = path.read_bytes()
        source = str(path)
    try:
        profile = msgspec.toml.decode(data, type=Profile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProfileError(f"{source}: {exc}") from None
    validate(profile, source)
    return profile


def validate(p: Profile, source: str = "profile") -> None:
    c = p.cluster
    if c.gpus < 2:
        raise ProfileError(f"{source}: cluster.gpus must be >= 2, got {c.gpus}")
    if not 1 <= c.initial_train <= c.gpus - 1:
        raise ProfileError(f"{source}: cluster.initial_train must be in 1..{c.gpus - 1}, got {c.initial_train}")
    for split in p.candidate_splits():
        if split.total != c.gpus or split.train < 1 or split.rollout < 1:
            raise ProfileError(f"{source}: candidate {split} must split all {c.gpus} devices, both pools >= 1")
    if p.candidate_splits() and p.initial_split not in p.candidate_splits():
        raise ProfileError(f"{source}: the initial split {p.initial_split} is not among the candidates")
    r = p.rollout
    if r.gpus_per_engine < 1 or r.max_num_seqs < 1 or r.kv_cache_tokens < 1:
        raise ProfileError(f"{source}: rollout.gpus_per_engine, max_num_seqs and kv_cache_tokens must be >= 1")
    rollouts = [p.initial_split.rollout, *(s.rollout for s in p.candidate_splits())]
    if min(rollouts) < r.gpus_per_engine:
        raise ProfileError(f"{source}: a rollout pool of {min(rollouts)} device(s) (the initial split or a "
                           f"candidate) is smaller than one engine (rollout.gpus_per_engine = {r.gpus_per_engine})")
    if any(k < 1 for k in r.tp_sizes) or r.layers < 0 or r.weights_kv_tokens < 0:
        raise ProfileError(f"{source}: rollout.tp_sizes must be >= 1; layers, weights_kv_tokens >= 0")
    if r.iter_fixed_s < 0 or r.allreduce_s < 0:
        raise ProfileError(f"{source}: rollout.iter_fixed_s and allreduce_s must be >= 0")
    if r.iter_fixed_s + r.comm_s(r.gpus_per_engine) > r.iter_base_s:
        raise ProfileError(f"{source}: rollout.iter_fixed_s plus the all-reduces of an engine of "
                           f"{r.gpus_per_engine} exceed iter_base_s")
    for k in r.engine_sizes():
        try:
            r.at_tp(k)
        except ProfileError as exc:
            raise ProfileError(f"{source}: rollout.tp_sizes: {exc}") from None
    for name in ("iter_base_s", "iter_per_seq_s", "iter_per_ctx_token_s", "prefill_per_token_s"):
        if getattr(r, name) < 0:
            raise ProfileError(f"{source}: rollout.{name} must be >= 0")
    t = p.training
    if t.update_tokens_per_s <= 0 or t.logprob_tokens_per_s <= 0:
        raise ProfileError(f"{source}: training token rates must be > 0")
    if not 0.5 < t.dp_efficiency_per_doubling <= 1.0:
        raise ProfileError(f"{source}: training.dp_efficiency_per_doubling must be in (0.5, 1]")
    if t.mini_batches_per_step < 1:
        raise ProfileError(f"{source}: training.mini_batches_per_step must be >= 1")
    if any(v < 0 for v in msgspec.structs.astuple(p.loan)):
        raise ProfileError(f"{source}: loan costs must be >= 0")
    if p.resize.tail.switch_s < 0 or p.resize.tail.back_s < 0:
        raise ProfileError(f"{source}: resize.tail.switch_s and back_s must be >= 0")
    w = p.workload
    if w.samples_per_step < 1 or w.samples_per_prompt < 1 or w.max_response_tokens < 1:
        raise ProfileError(f"{source}: workload sizes must be >= 1")
