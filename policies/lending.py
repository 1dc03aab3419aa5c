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
"""

from __future__ import annotations

import math

from dynaresized.core.policy import LoanProposal, LoanView
from dynaresized.domain import Pool


class Lending:
    """Mixed into a resize policy: `propose_loan` is what the core asks after every engine
    and mini-batch report. `lending=False` turns it off."""

    lends: bool = True

    def propose_loan(self, view: LoanView) -> LoanProposal | None:
        if not self.lends or not view.idle_engines or view.mini_batch_total == 0:
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
