"""One optimizer step of a member of the training group: its share of the global batch,
the gradient reduction (deterministic: per-micro-batch gradients summed in micro-batch order),
the lazy optimizer restore of a new epoch, the update and the step's record.

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


class StepLoop:
    """The training part of a `TrainerRank`: `_train_step` and the gradient buffer helpers."""

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
