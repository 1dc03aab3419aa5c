"""One optimizer step of a member of the training group: its share of the mini-batch, the
gradient reduction (deterministic: per-micro-batch gradients summed in micro-batch order),
the lazy optimizer restore of a new epoch, the update and the step's record.

An RL step's global batch is `micro_batches` micro-batches cut into `mini_batches`
consecutive mini-batches, one optimizer step each (one mini-batch: the whole batch, one
step). A group of k ranks splits a mini-batch round-robin: its i-th micro-batch goes to the
member at position i mod k. Which micro-batches a mini-batch holds, and the order they are
summed in, never depend on k: that is what keeps a resized or lent run bitwise equal.

A part of `TrainerRank` (a mixin): it reads the rank's group, membership and state, and hands
a failed collective to the recovery part (`_recover`).
"""

from __future__ import annotations

import math
import time

import msgspec
import torch

from dynaresized.backends.torch.communicators import CollectiveFailed
from dynaresized.backends.torch.liveness import PeerDied, WaitTimeout
from dynaresized.backends.torch.rank_types import RankState, StepRecord
from dynaresized.backends.torch.state import StateMismatch, digest


def share(micro_batches: range, members: int, position: int) -> tuple[int, ...]:
    """The micro-batches of a mini-batch that the member at `position` of `members` computes."""
    return tuple(mb for i, mb in enumerate(micro_batches) if i % members == position)


def ordered_sum(out: torch.Tensor, gathered: list[torch.Tensor], count: int) -> torch.Tensor:
    """Sum `count` per-micro-batch gradients in micro-batch order into `out`: `gathered[r][j]`
    is the j-th gradient the member at position r computed (`share`), so micro-batch i is
    `gathered[i % k][i // k]`. The additions happen in the same order whatever k is."""
    k = len(gathered)
    out.copy_(gathered[0][0])
    for i in range(1, count):
        out.add_(gathered[i % k][i // k])
    return out


class StepLoop:
    """The training part of a `TrainerRank`: `_train_step` and the gradient buffer helpers."""

    def _train_step(self) -> None:
        assert self.group is not None
        started = time.perf_counter()
        rl_step, mini_batch = self.config.position(self.step)
        batch = self.config.micro_batches_of(mini_batch)
        n, k = len(batch), len(self.members)
        mine = share(batch, k, self.members.index(self.rank))
        model, loss_sum = self.state.model, 0.0
        model.train()
        try:
            if self.config.deterministic:
                rows = torch.zeros(math.ceil(n / k), self._flat.numel(), dtype=self._flat.dtype, device=self.device)
                for j, mb in enumerate(mine):
                    model.zero_grad(set_to_none=False)
                    loss = self.job.micro_batch_loss(model, rl_step, mb)
                    loss.backward()
                    loss_sum += float(loss.detach())
                    self._flatten_grads(rows[j])
                self._delay(started)
                ordered_sum(self._flat, self.group.all_gather(rows), n)
            else:
                model.zero_grad(set_to_none=False)
                for mb in mine:
                    loss = self.job.micro_batch_loss(model, rl_step, mb)
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
                            seconds=time.perf_counter() - started, rl_step=rl_step, mini_batch=mini_batch,
                            mini_batches=self.config.mini_batches)
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
