"""A trainer lent to the rollout: between two RL steps, while the rank waits for the next
step's samples, its device serves the rollout (what verl's hybrid replicas do), and the rank
comes home before it trains that step. A mixin of `TrainerRank`.

The rank stays a member of its group: the group does not change, so the step it comes home to
is the step it would have trained without the loan, bitwise. What a loan changes is when the
group starts that step. Every member waits at the *gate*, the start of an RL step (before its
first mini-batch), until the step's samples are there (`TrainingJob.ready`, optional: a job
without it is always ready) and no member is lent out (one store key per rank). A group whose
member is lent therefore waits at the gate, never in a collective that could time out.

The trainer side of the core's `plan_loan` (ops to the rollout: drain, release; home: join):

| op (plan)       | what the rank does                                                                 |
|-----------------|------------------------------------------------------------------------------------|
| drain (LOAN)    | park at the gate: at once if the loop waits there, after the RL step's boundary if  |
|                 | it is on its way; refused inside a step (the rank has work of its own)              |
| release (LOAN)  | as for a resize: the state parked in host memory if configured; holds nothing       |
| join (RETURN)   | the state back in place, unparked; the group starts the step once all are home      |
| reclaim (LOAN)  | undo release: the state back in place, still parked                                 |
| resume (LOAN)   | undo drain: unparked                                                                |
| evict (RETURN)  | undo join: parked and released again if the step has not begun (the device is lent) |
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

from dynaresized.backends.torch.rank_types import NotReady, RankState


class LentToRollout:
    """The loop's gate and the handlers' side of a loan of this rank to the rollout."""

    def _init_lending(self) -> None:
        self._park_lock = threading.Lock()
        self._at_gate = False  # the loop waits at the gate (between RL steps, not computing)
        self._parked = False  # lent to the rollout: the loop stays at the gate
        self._passed = -1  # the optimizer step the loop last left the gate at (to compute it)

    # -- the loop's side -------------------------------------------------------------------
    def _gate(self) -> bool:
        """At the start of an RL step: wait until its samples are there, this rank is home and
        no member is lent out; run the handlers' intents meanwhile. False when closing."""
        rl_step = self.step // self.config.mini_batches
        ready = getattr(self.job, "ready", None)
        others = [r for r in self.members if r != self.rank]
        with self._park_lock:
            self._at_gate = True
        try:
            while not self._closing.is_set():
                if not self._parked and (ready is None or ready(rl_step)) and not self.registry.lent_out(others):
                    with self._park_lock:
                        if not self._parked:
                            self._at_gate = False
                            self._passed = self.step
                            return True
                try:
                    intent = self._intents.get(timeout=0.01)
                except queue.Empty:
                    continue
                self._run_intent(intent)
            return False
        finally:
            with self._park_lock:
                self._at_gate = False

    def _come_home(self) -> str:
        """The intent of a loan's way home (or its undo): the state back, unparked."""
        restored = self._reclaim_storage() if self.state.released is not None else "state was in place"
        self.registry.set_lent_out(self.rank, False)
        with self._park_lock:
            self._parked = False
        self._set_view(RankState.TRAINING)
        return (f"home from the rollout before RL step {self.step // self.config.mini_batches}, a member of "
                f"epoch {self.epoch} {self._fmt(self.members)}; {restored}")

    # -- the handlers' side ----------------------------------------------------------------
    async def _park(self, op: Any) -> str:
        """DRAIN with plan LOAN: the rank's device goes to the rollout until the step boundary."""
        self._movers(op)
        mb = self.config.mini_batches
        deadline = time.monotonic() + op.timeout_s
        while True:
            with self._park_lock:
                v = self._view
                if self._parked:
                    return f"already lent to the rollout (parked before RL step {self.step // mb})"
                if v.state is not RankState.TRAINING:
                    raise NotReady(f"drain {op.op_id}: rank {self.rank} is {v.state.value}, not a member waiting "
                                   "between RL steps: only such a rank is lent to the rollout")
                if self._at_gate:
                    self._parked = True
                    self._set_view(RankState.DRAINED)
                    parked = self.step // mb
                    break
                if self.step % mb or self._passed == self.step:
                    raise NotReady(
                        f"drain {op.op_id}: rank {self.rank} is training RL step {self.step // mb} (mini-batch "
                        f"{self.step % mb + 1} of {mb}); a trainer is lent to the rollout only between RL steps")
            if time.monotonic() > deadline:  # on its way to the gate all this time: a boundary that hangs
                raise NotReady(f"drain {op.op_id}: rank {self.rank} did not reach the start of RL step "
                               f"{self.step // mb} within {op.timeout_s:g}s")
            await asyncio.sleep(0.01)
        await self._call(lambda: self._handler_registry.set_lent_out(self.rank, True))
        ready = getattr(self.job, "ready", None)
        waits = "waits for its samples" if ready is not None and not ready(parked) else "has its samples"
        return (f"lent to the rollout: parked before RL step {parked} (it {waits}), still a member of epoch "
                f"{self.epoch} {self._fmt(self.members)}")

    async def _unpark(self, op: Any) -> str:
        """JOIN with plan RETURN, or RESUME (undo drain): the rank comes home."""
        self._movers(op)
        return str(await asyncio.wrap_future(self._submit("home")))

    async def _park_again(self, op: Any) -> str:
        """EVICT with plan RETURN (its way home failed later on): lent again, if its step has not
        begun; otherwise it leaves the group at the next boundary as any evicted rank does."""
        with self._park_lock:
            if self._parked:
                return "still lent to the rollout; nothing to evict"
            if not self._at_gate:
                return ""
            self._parked = True
            self._set_view(RankState.DRAINED)
        await self._call(lambda: self._handler_registry.set_lent_out(self.rank, True))
        released = await asyncio.wrap_future(self._submit("release"))
        return f"lent to the rollout again (parked before RL step {self.step // self.config.mini_batches}); {released}"

    @property
    def parked(self) -> bool:
        return self._parked
