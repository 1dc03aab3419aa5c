"""The GRPO training job the torch trainer ranks run, and the step files that feed it.

The driver writes each rollout step's samples (with their group-relative advantages) to
`<work>/samples/step-<k>.msgpack` with an atomic rename; the trainer ranks' `TrainingJob`
reads step k's file when it trains step k. A step has a FIXED number of micro-batches
(`TrainerConfig.micro_batches`), each a fixed slice of the step's samples, so the global
batch never changes when the data-parallel group grows or shrinks: the group only changes
which rank computes which slice.

Loss (GRPO without the KL term, one update per batch): for sample i with response tokens
y_1..y_T and advantage A_i = (r_i - mean(r_group)) / (std(r_group) + eps),
loss_i = -A_i * sum_t log pi(y_t | prompt, y_<t) / max_tokens_i. One step off-policy: the
samples of step k come from policy version k-1 (DESIGN.md), and with one update per batch
the ratio to the behaviour policy is not clipped (a single stale step; see docs/e2e.md).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch
from torch import nn

from dynaresized.backends.vllm.tiny_model import PAD_ID


class TrainSample(msgspec.Struct, frozen=True):
    sample_id: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    max_tokens: int
    reward: float
    advantage: float
    policy_version: int


class StepSamples(msgspec.Struct, frozen=True):
    step: int
    policy_version: int
    samples: tuple[TrainSample, ...]


def advantages(rewards: Sequence[float], group: int, eps: float = 1e-4) -> list[float]:
    """Group-relative advantages: samples [g*group, (g+1)*group) answer the same prompt."""
    if group < 1 or len(rewards) % group:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group}")
    out: list[float] = []
    for g in range(0, len(rewards), group):
        chunk = list(rewards[g:g + group])
        mean = statistics.fmean(chunk)
        std = statistics.pstdev(chunk)
        out.extend((r - mean) / (std + eps) for r in chunk)
    return out


def step_path(samples_dir: str | Path, step: int) -> Path:
    return Path(samples_dir) / f"step-{step:05d}.msgpack"


def write_step(samples_dir: str | Path, batch: StepSamples) -> Path:
    """Atomically publish a step's samples (write to a hidden file, fsync, rename)."""
    path = step_path(samples_dir, batch.step)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(msgspec.msgpack.encode(batch))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def micro_batch_slice(total: int, micro_batches: int, index: int) -> range:
    if total % micro_batches:
        raise ValueError(f"{total} samples per step do not split into {micro_batches} equal micro-batches")
    size = total // micro_batches
    return range(index * size, (index + 1) * size)


def _token_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def grpo_loss(model: nn.Module, samples: Sequence[TrainSample], reference: nn.Module | None = None,
              kl_coef: float = 0.0) -> torch.Tensor:
    """Mean over `samples` of -A * sum log pi(response) / max_tokens (right-padded batch).

    With `kl_coef` > 0, plus kl_coef times the mean over response tokens of the KL estimate
    exp(q - p) - (q - p) - 1 (p = log pi, q = log pi_ref: GRPO's k3 estimator), which costs one
    forward pass of the `reference` model per micro-batch."""
    rows = [list(s.prompt) + list(s.response) for s in samples]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    logp = _token_logprobs(model, ids, mask)
    take = torch.zeros_like(logp)
    for i, s in enumerate(samples):  # position j predicts token j+1: the response's tokens only
        start = len(s.prompt) - 1
        take[i, start:start + len(s.response)] = 1.0
    per_sample = (logp * take).sum(dim=1)
    adv = torch.tensor([s.advantage for s in samples], dtype=per_sample.dtype, device=device)
    norm = torch.tensor([float(s.max_tokens) for s in samples], dtype=per_sample.dtype, device=device)
    loss = -(adv * per_sample / norm).mean()
    if kl_coef > 0.0:
        if reference is None:
            raise ValueError("a KL term needs the reference model")
        with torch.no_grad():
            ref = _token_logprobs(reference, ids, mask)
        diff = ref - logp
        kl = ((torch.exp(diff) - diff - 1.0) * take).sum() / take.sum().clamp(min=1.0)
        loss = loss + kl_coef * kl
    return loss


class GRPOJob:
    """`TrainingJob` for the trainer ranks: model from the warm-started checkpoint, Adam, and
    the loss of micro-batch j of step k read from the driver's step file (waits for it)."""

    def __init__(self, model_dir: str, samples_dir: str, micro_batches: int, lr: float = 2e-3,
                 wait_timeout_s: float = 900.0, kl_coef: Callable[[int], float] | None = None,
                 reference_dir: str | None = None) -> None:
        self.model_dir = model_dir
        self.reference_dir = reference_dir or model_dir  # the KL term's model (the shift workload's teacher)
        self.kl_coef = kl_coef or (lambda step: 0.0)  # per step: the workload's KL to the reference
        self._reference: nn.Module | None = None
        self.samples_dir = samples_dir
        self.micro_batches = micro_batches
        self.lr = lr
        self.wait_timeout_s = wait_timeout_s
        self._cache: dict[int, StepSamples] = {}
        # seconds this rank waited for each step's file: the step's time minus this is training
        self.waited_s: dict[int, float] = {}
        self._asked: dict[int, float] = {}  # step -> when `ready` was first asked about it

    def build_model(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM.from_pretrained(self.model_dir, torch_dtype=torch.float32)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # foreach=False: the same per-tensor kernels on every rank (deterministic mode)
        return torch.optim.Adam(model.parameters(), lr=self.lr, foreach=False)

    def samples(self, step: int) -> StepSamples:
        if step not in self._cache:
            path = step_path(self.samples_dir, step)
            began = time.monotonic()
            deadline = began + self.wait_timeout_s
            while not path.exists():  # the driver is still generating this step
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no samples for step {step} at {path} after {self.wait_timeout_s}s")
                time.sleep(0.02)
            self.waited_s = {step: time.monotonic() - began}
            self._cache = {step: msgspec.msgpack.decode(path.read_bytes(), type=StepSamples)}
        return self._cache[step]

    def ready(self, step: int) -> bool:
        """The driver wrote step `step`'s samples (the rank waits for them between RL steps, where
        a rank lent to the rollout comes home); raises once it has waited `wait_timeout_s`."""
        if step in self._cache or step_path(self.samples_dir, step).exists():
            self._asked.pop(step, None)
            return True
        began = self._asked.setdefault(step, time.monotonic())
        if time.monotonic() - began > self.wait_timeout_s:
            raise TimeoutError(f"no samples for step {step} at {step_path(self.samples_dir, step)} after "
                               f"{self.wait_timeout_s}s")
        return False

    def micro_batch_ids(self, step: int, micro_batch: int) -> list[str]:
        batch = self.samples(step)
        return [batch.samples[i].sample_id for i in micro_batch_slice(len(batch.samples), self.micro_batches,
                                                                       micro_batch)]

    def micro_batch_loss(self, model: nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        batch = self.samples(step)
        part = [batch.samples[i] for i in micro_batch_slice(len(batch.samples), self.micro_batches, micro_batch)]
        beta = self.kl_coef(step)
        return grpo_loss(model, part, self.reference(model) if beta > 0 else None, beta)

    def reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference model of the KL term, loaded on first use, on the model's device."""
        if self._reference is None:
            from transformers import LlamaForCausalLM

            # not build_model: that reseeds torch's generator, which would differ between ranks
            ref = LlamaForCausalLM.from_pretrained(self.reference_dir, torch_dtype=torch.float32)
            ref.requires_grad_(False)
            ref.eval()
            self._reference = ref.to(next(model.parameters()).device)
        return self._reference
