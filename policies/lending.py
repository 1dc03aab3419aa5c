"""Lending: which idle engines to lend to the training step in progress, from measured
progress only (response lengths are unknown until generated).

An engine whose queue is empty and whose last request finished has nothing to do until the
step boundary. Lent to training, it joins at the first mini-batch boundary after the one
running now and after its release and join (`LoanCosts.lead_s`); from there the remaining
mini-batches run on one more device. The predicted saving is the mini-batches the loan will
still catch, at the pace the trainer last reported, times the share the extra devices take
over (linear scaling). It does not ask whether training or the rollout will end the step last:
an idle engine lent while the rollout is the longer stage costs only its way home. The cost is
what the loan adds to the critical path: the group change and the joiner's first mini-batch
now (`to_training_s`), and the way home at the boundary (`return_s`, spread over the rollout
pool). The core's `loan_payback` guard lends only when the saving exceeds the cost.

The other way: trainers with nothing to train (the first window, where the training pool
waits for the first rollout, or after the step's last mini-batch) are lent to the rollout
while its queue still holds requests; as engines they pull the queued requests. The predicted
saving is the rollout still ahead, less the loan's lead, times the share the lent devices
take over. The rollout ahead is the last measured step's rollout time on the home pool (the
devices that served it counted) less its training time (the training step just done started
with the rollout); with nothing to train yet, the whole rollout (`unmeasured_rollout_s`
before any step is measured). A lent engine that finds the queue empty costs only its ways
there and back.
"""

from __future__ import annotations

import math

from dynaresized.core.policy import LoanProposal, LoanView, TailProposal, stage_split_estimate
from dynaresized.domain import Pool


class Lending:
    """Mixed into a resize policy: `propose_loan` is what the core asks after every engine
    and mini-batch report. `lending=False` turns it off."""

    lends: bool = True
    lends_trainers: bool = True
    """Trainers to the rollout (`lend_trainers=false` turns that way off alone). The sim workers,
    and the torch trainer with the vLLM engine on its device, take such loans."""
    lends_engines: bool = True
    """Idle engines to the training step (`lend_engines=false` turns that way off alone: a job
    with one mini-batch per RL step has no boundary inside the step for a lent engine to join)."""
    unmeasured_rollout_s: float = 300.0
    """The rollout ahead, in seconds, before any step is measured (a first RL rollout of long
    responses takes minutes)."""

    regroups_tails: bool = False
    """Regroup a step's tail into a wider engine (`propose_tail`, `tail_regroup=true`): only where
    the core has tail costs (the simulator's `[resize.tail]`)."""

    def _tail_plan(self, view: LoanView, free: list[str], extra_cost: float) -> tuple[tuple[str, ...], float, float,
                                                                                  str] | None:
        """The widest engine the busiest tail and `free` devices can form, and what it saves and
        costs (`propose_tail`), or None. `extra_cost`: seconds beyond the switch and the way back."""
        costs = view.tail_costs
        if costs is None or not view.tails or not free:
            return None
        tail = max(view.tails, key=lambda t: (t.tokens_left, t.devices))
        k = len(tail.devices)
        free = [d for d in free if d not in tail.devices]
        width = max((w for w in costs.widths if k < w <= k + len(free)), default=None)
        narrow = costs.iteration_s(k, tail.running)
        if width is None or narrow is None or narrow <= 0:
            return None
        wide = costs.iteration_s(width, tail.running) or narrow
        left = max(tail.tokens_left - (view.now - tail.at) / narrow, 0.0)
        now_s = left * narrow
        after_s = costs.switch_s + extra_cost + left * wide
        training_left = max(view.mini_batch_total - view.mini_batch_done, 0) * view.mini_batch_s
        saves = max(now_s - max(after_s, training_left), 0.0)
        cost = costs.switch_s + costs.back_s + extra_cost
        devices = tail.devices + tuple(free[:width - k])
        why = (f"tail of rollout step {view.rollout_step}: {tail.running} request(s) on [{', '.join(tail.devices)}], "
               f"~{left:.0f} tokens left, decode on one engine of {width} device(s) with "
               f"{', '.join(devices[k:])}: ~{now_s:.0f} s -> ~{after_s:.0f} s, saves ~{saves:.0f} s "
               f"(cost ~{cost:.0f} s)")
        return devices, saves, cost, why

    def propose_tail(self, view: LoanView) -> TailProposal | None:
        """When engines have run dry (or trainers were lent for it) while another still decodes
        the step's last requests: that engine and idle ones as one wider engine for the rest of
        the step, the widest they allow. The tail's time is its tokens left (the longest running
        request's, as the engine said) times an iteration of its running requests (`TailCosts`),
        on the engine now and on the wider one after the switch; the saving counts only as far
        as the rollout ends the step (the training still ahead, at its measured mini-batch pace,
        bounds it). The cost is the switch and the way back at the boundary. Response lengths
        stay unknown: the tokens left are the engine's own upper bound."""
        if not self.regroups_tails:
            return None
        plan = self._tail_plan(view, sorted(view.idle_engines) + sorted(view.lent_to_rollout), 0.0)
        if plan is None:
            return None
        devices, saves, cost, why = plan
        return TailProposal(devices=devices, reason=why, saves_s=saves, cost_s=cost)

    def _lend_for_tail(self, view: LoanView) -> LoanProposal | None:
        """Trainers whose step is done, lent to the rollout once its queue is empty, to join the
        tail's engine (`propose_tail` takes them once they land): what the tail regroup would
        save, against its cost and the loan's there and back."""
        costs = view.costs_to(Pool.ROLLOUT)
        extra = costs.to_rollout_s + costs.return_s
        plan = self._tail_plan(view, sorted(view.free_trainers), extra)
        if plan is None:
            return None
        devices, saves, cost, why = plan
        tail_devices = max(view.tails, key=lambda t: (t.tokens_left, t.devices)).devices
        lent = tuple(d for d in devices if d not in tail_devices)
        return LoanProposal(devices=lent, to_pool=Pool.ROLLOUT.value, reason=f"lent to the rollout for the {why}",
                            saves_s=saves, cost_s=cost)

    def propose_loan(self, view: LoanView) -> LoanProposal | None:
        if not self.lends:
            return None
        if (self.regroups_tails and self.lends_trainers and view.free_trainers and view.queue_empty
                and view.tails and view.tail_costs is not None and not view.tail_open):
            return self._lend_for_tail(view)
        if self.lends_trainers and view.free_trainers and not view.queue_empty:
            return self._lend_trainers(view)
        if not self.lends_engines or not view.idle_engines or view.mini_batch_total == 0:
            return None
        left = view.mini_batch_total - view.mini_batch_done
        if left <= 0 or view.mini_batch_s <= 0:
            return None  # training done, or its pace not measured yet
        k = len(view.idle_engines)
        n = view.training_devices
        # the first boundary the loan can make: after the mini-batch now running, and after
        # its release and join are done
        caught = max(left - 1 - math.floor(view.costs.lead_s / view.mini_batch_s), 0)
        saves = caught * view.mini_batch_s * k / (n + k)
        cost = view.costs.to_training_s + view.costs.return_s / max(view.split.rollout, 1) * k
        idle = tuple(sorted(view.idle_engines))
        devices = ", ".join(idle)
        why = (f"lent {devices} to training at mini-batch {view.mini_batch_done}/{view.mini_batch_total}: "
               f"rollout queue empty, {k} engine(s) idle, saves ~{saves:.0f} s (cost ~{cost:.0f} s)")
        return LoanProposal(devices=idle, to_pool=Pool.TRAINING.value, reason=why, saves_s=saves,
                            cost_s=cost)

    def _lend_trainers(self, view: LoanView) -> LoanProposal | None:
        n = max(view.split.rollout, 1)
        ahead = self.unmeasured_rollout_s
        if view.recent:
            rollout_work, train_work = stage_split_estimate(view.recent[-1], view.split)
            trained = train_work / max(view.split.train, 1) if view.mini_batch_total > 0 else 0.0
            ahead = rollout_work / n - trained
        free = tuple(sorted(view.free_trainers))
        k = len(free)
        costs = view.costs_to(Pool.ROLLOUT)
        saves = max(ahead - costs.lead_s, 0.0) * k / (n + k)
        cost = costs.to_rollout_s + costs.return_s / max(view.training_devices, 1) * k
        what = ("nothing to train yet" if view.mini_batch_total == 0
                else f"training step done ({view.mini_batch_done}/{view.mini_batch_total})")
        why = (f"lent {', '.join(free)} to the rollout: {what}, rollout queue not empty, "
               f"saves ~{saves:.0f} s (cost ~{cost:.0f} s)")
        return LoanProposal(devices=free, to_pool=Pool.ROLLOUT.value, reason=why, saves_s=saves, cost_s=cost)
