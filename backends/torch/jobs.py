"""What a trainer rank trains: the `TrainingJob` interface and a synthetic job.

A job builds the model and optimizer (identically on every rank: same seed) and computes
the loss of one micro-batch of one step. Micro-batches are named by (step, index), not by
rank, so the global batch of a step is the same whichever ranks train it, and re-splitting
it over a new data-parallel group never enlarges, shrinks or reorders it.

A job may also say whether an RL step's data is there yet (`ready(step) -> bool`, optional):
the rank then waits for it between RL steps, at the gate where a rank lent to the rollout
comes home (lending.py), instead of inside the step. A job without it is always ready, and its
ranks can be lent to the rollout only in the moment between two steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TrainingJob(Protocol):
    def build_model(self) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer: ...

    def micro_batch_loss(self, model: nn.Module, step: int, micro_batch: int) -> torch.Tensor: ...


class SyntheticRegression:
    """An MLP regressing a fixed random teacher on Gaussian inputs; data depends only on
    (seed, step, micro-batch). `width=4096, depth=2` is ~34M parameters; tests use ~10K.
    With `ready_dir`, RL step k's data is there once the file `ready_dir/step-<k>` exists (a
    rollout that a test finishes by hand)."""

    def __init__(self, width: int = 64, depth: int = 2, inputs: int = 32, outputs: int = 8,
                 micro_batch_size: int = 4, lr: float = 1e-3, seed: int = 0, ready_dir: str | None = None) -> None:
        if min(width, depth, inputs, outputs, micro_batch_size) < 1:
            raise ValueError("width, depth, inputs, outputs and micro_batch_size must be positive")
        self.width = width
        self.depth = depth
        self.inputs = inputs
        self.outputs = outputs
        self.micro_batch_size = micro_batch_size
        self.lr = lr
        self.seed = seed
        self.ready_dir = Path(ready_dir) if ready_dir is not None else None
        gen = torch.Generator().manual_seed(seed + 1)
        self._teacher = torch.randn(inputs, outputs, generator=gen) / inputs**0.5

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        layers: list[nn.Module] = []
        size = self.inputs
        for _ in range(self.depth):
            layers += [nn.Linear(size, self.width), nn.Tanh()]
            size = self.width
        layers.append(nn.Linear(size, self.outputs))
        return nn.Sequential(*layers)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # foreach=False: the same per-tensor kernels on every rank, whatever the tensor count
        return torch.optim.Adam(model.parameters(), lr=self.lr, foreach=False)

    def ready(self, step: int) -> bool:
        return self.ready_dir is None or (self.ready_dir / f"step-{step}").exists()

    def batch(self, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + micro_batch)
        x = torch.randn(self.micro_batch_size, self.inputs, generator=gen)
        return x, x @ self._teacher

    def micro_batch_loss(self, model: nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        x, y = self.batch(step, micro_batch)
        return nn.functional.mse_loss(model(x), y)

    @staticmethod
    def parameters_for(width: int, depth: int, inputs: int = 32, outputs: int = 8) -> int:
        n = inputs * width + width
        n += (depth - 1) * (width * width + width)
        return n + width * outputs + outputs
