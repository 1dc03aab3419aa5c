"""Lending: which idle engines to lend to the training step in progress, from measured
progress only (response lengths are unknown until generated).

An engine whose queue is empty and whose last request finished has nothing to do until the
step boundary. Lent to training, it joins at the first mini-batch boundary after the one
running now and after its release and join (`LoanCosts.lead_s`); from there the remaining
mini-batches run on one more device. Training then ends sooner by the mini-batches the loan
still catches, at the pace the trainer last reported, times the share the extra devices take
over (linear scaling); the step ends when both stages have, so the predicted saving is only
what training would outlast the rollout by (the rollout still ahead: the shortest of the last
steps' rollouts by the cost model, `core.costmodel`, less the time the step has run; none once
every rollout engine has run dry). The cost is what the loan adds to the critical path: the
group change and the joiner's first mini-batch now (`to_training_s`), and its late return: the
lent engines start the next rollout `return_s` late, the router holding their share of the
step for them meanwhile (`backends/vllm/router.py`, `RequestRouter.expect`), so the next
rollout ends up to the way home later, which costs the step where it then outlasts the
training (spread over the rollout pool before anything is measured). Before the router held
that share, the engines on time took every request they had room for (TP-1 engines of 256
sequences, a step of 1,024) and the late ones served nothing of the step: the policy priced a
loan as the next rollout on the engines that stayed, and lent less.
The core's `loan_payback` guard lends only when the saving exceeds the cost.

The other way: trainers with nothing to train (the first window, where the training pool
waits for the first rollout, or after the step's last mini-batch) are lent to the rollout
while its queue still holds requests; as engines they pull the queued requests. The predicted
saving is the rollout still ahead, less the loan's lead, times the share the lent devices
take over. The rollout ahead is the step's own pace from the engines' live sample counts
(elapsed x samples left / samples done) once a sample is done: it sees a workload that turned
before the step report does, and where it says less than the last steps' model it is the
model that is wrong for a loan (its time includes the tail's latency floor, which lent devices
do not shorten: at 1,024 devices every trainer loan the model paid for saved nothing). Before a
sample is done, the cost model's rollout on the home pool (the devices that served the last
steps counted) less the time the step has run (where the view does not say when the step
began, the training just done). The core asks again on progress reports while trainers are free
and requests queued (at the first sample done and every 1/64 after: `core.loans.paced`;
`lends_from_progress`), so a loan starts on the first rollout-heavy step, not one step report
later. Before any step is measured, the live pace, and with no sample done yet the prior
`unmeasured_rollout_s` (a policy option), which the loan's reason names. A lent engine that
finds the queue empty costs only its ways there and back. Where the job takes lent trainers
back before the rollout ends and its last step report says when (`StepTiming.loan_home_share`:
verl deactivates its hybrid replicas once `deactivate_wait_samples` of the step's samples are
queued), the rollout ahead is the cost model's time for that share of the step's samples on the
home pool, less how far the rollout is: the share already generated (`next_done_share`) at the
model's pace, or the training just done (the next batch's rollout began when the trainer took
its batch), whichever is further; a count of whole samples misses the ones in flight.
"""

from __future__ import annotations

import math

from dynaresized.core.costmodel import Measure, measure
from dynaresized.core.policy import LoanProposal, LoanView, ObservedView, TailProposal
from dynaresized.domain import Pool


def checked_prior(seconds: float) -> float:
    """`unmeasured_rollout_s` as a policy option: a finite number of seconds > 0."""
    if not (isinstance(seconds, int | float) and 0 < seconds < math.inf):
        raise ValueError(f"unmeasured_rollout_s must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


RECENT_STEPS = 3
"""Steps of `LoanView.recent` a loan's estimate averages (the hysteresis policy's window)."""


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
    lends_from_progress: bool = True
    """The core asks `propose_loan` again on engine progress reports (the step's first sample
    done, then every 1/64 of its samples) while trainers are free and the rollout's queue holds
    requests (a refusal there is not recorded: the one at the trainer's last mini-batch was), so
    a loan the step's live pace pays for starts then."""
    unmeasured_rollout_s: float = 300.0
    """The rollout ahead, in seconds, before any step is measured and before any sample of the
    first step is done (a first RL rollout of long responses takes minutes; a job of short
    steps sets it lower: the policy option `unmeasured_rollout_s`). A loan decided on it says so."""

    regroups_tails: bool = False
    """Regroup a step's tail into a wider engine (`propose_tail`, `tail_regroup=true`): only where
    the core has tail costs (the simulator's `[resize.tail]`)."""

    def lend_lead_s(self, view: ObservedView, window: int) -> float | None:
        """Seconds from a trainer's last mini-batch until, lent, it serves the rollout, where this
        policy lends trainers and did in the last `window` steps (its split predictions count
        those loans: `Measure.step_on`); None where it does not or did not (a job whose trainers
        report no mini-batch is never lent), or the view does not say what a loan costs."""
        if not (self.lends and self.lends_trainers) or view.rollout_loan_costs is None:
            return None
        if not any(t.rollout_devices_served > t.rollout_devices for t in view.recent[-window:]):
            return None
        return view.rollout_loan_costs.lead_s

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
        # how far the mini-batch running now is (it began at the last report), as far as its pace says
        into = min(max(view.now - view.mini_batch_at, 0.0), view.mini_batch_s) if view.mini_batch_at >= 0 else 0.0
        # the first boundary the loan can make: after the mini-batch now running, and after
        # its release and join are done
        caught = max(left - max(math.ceil((into + view.costs.lead_s) / view.mini_batch_s), 1), 0)
        faster = caught * view.mini_batch_s * k / (n + k)  # training ends this much sooner
        model = measure(view.recent[-RECENT_STEPS:], view.split, floor=view.tail_binds)
        training_left = left * view.mini_batch_s - into
        rollout_left = self._rollout_left(view, model)
        if rollout_left is None:
            saves, bound = faster, ""
        else:
            # the step ends when both stages have: training ending sooner saves only what it
            # outlasts the rollout by
            saves = max(min(faster, training_left - rollout_left), 0.0)
            bound = f"training ~{training_left:.0f} s left, rollout ~{rollout_left:.0f} s, "
        cost = view.costs.to_training_s + self._late_return_s(view, model, k)
        idle = tuple(sorted(view.idle_engines))
        devices = ", ".join(idle)
        why = (f"lent {devices} to training at mini-batch {view.mini_batch_done}/{view.mini_batch_total}: "
               f"rollout queue empty, {k} idle device(s), {bound}saves ~{saves:.0f} s (cost ~{cost:.0f} s)")
        # training with the loan: the mini-batches it catches on more devices, after the group change
        ends_in = training_left - faster + view.costs.to_training_s
        return LoanProposal(devices=idle, to_pool=Pool.TRAINING.value, reason=why, saves_s=saves,
                            cost_s=cost, ends_in_s=ends_in)

    @staticmethod
    def _started(view: LoanView) -> float | None:
        """When the step in progress began (the last step report; in the first window, when the
        trainer said it has nothing to train yet), or None."""
        return view.step_started_at if view.step_started_at >= 0 else None

    def _rollout_left(self, view: LoanView, model: Measure | None) -> float | None:
        """Seconds of the step's rollout still ahead on the home pool, at least: the shortest of
        the last steps' rollouts on it (the cost model's, with its latency floor) less the time
        the step has run; None where nothing is measured. The shortest, because a loan refused
        for a rollout that turns out short loses what it would have saved, one lent for a long
        one only its cost."""
        if len(view.idle_engines) >= view.split.rollout:
            return 0.0  # every engine of the rollout pool has run dry: the rollout is done
        started = self._started(view)
        if model is None or started is None:
            return None
        n = max(view.split.rollout, 1)
        shortest = min(m.rollout_on(n) for t in view.recent[-RECENT_STEPS:]
                       if (m := measure((t,), view.split, floor=view.tail_binds)) is not None)
        return max(shortest - (view.now - started), 0.0)

    @staticmethod
    def _late_return_s(view: LoanView, model: Measure | None, k: int) -> float:
        """What `k` engines lent to training cost the next rollout: they come home `return_s`
        late, the router holding their share of the step for them, so the rollout ends up to
        that much later. It costs the step where the next rollout then ends after its training;
        nothing where training outlasts it. Unmeasured: the way home spread over the rollout pool."""
        late = view.costs.return_s
        if model is None:
            return late / max(view.split.rollout, 1) * k
        n = max(view.split.rollout, 1)
        rollout = model.rollout_on(n)
        training = sum(t.train_s for t in view.recent[-RECENT_STEPS:]) / max(len(view.recent[-RECENT_STEPS:]), 1)
        slower = rollout + late
        return max(slower, training) - max(rollout, training)

    @staticmethod
    def _live_ahead(view: LoanView, elapsed: float | None) -> float | None:
        """Seconds of the step's rollout still ahead at the pace of its own samples so far (the
        engines' live counts, lent devices included): `elapsed` x samples left / samples done;
        None before a sample is done. While requests are queued, the engines finish samples at
        about a steady pace, so this reads the queue's part of the rollout (the loan's share)."""
        if not (elapsed and view.samples_total and 0 < view.samples_done <= view.samples_total):
            return None
        return elapsed * (view.samples_total - view.samples_done) / view.samples_done

    def _lend_trainers(self, view: LoanView) -> LoanProposal | None:
        n = max(view.split.rollout, 1)
        model = measure(view.recent[-RECENT_STEPS:], view.split, floor=view.tail_binds)
        started = self._started(view)
        if started is not None:
            elapsed: float | None = view.now - started
        elif model is not None:
            # no time the step began: the training step just done began with it
            elapsed = model.train_on(max(view.split.train, 1)) if view.mini_batch_total > 0 else 0.0
        else:
            elapsed = None
        free = tuple(sorted(view.free_trainers))
        k = len(free)
        costs = view.costs_to(Pool.ROLLOUT)
        last = view.recent[-1] if view.recent else None
        until_home = False  # the job takes the lent devices back before the rollout ends
        if model is not None and last is not None and last.step == view.rollout_step - 1 and (
                last.loan_home_share is not None):
            until_home = True
            # the job takes the lent devices back once a share of the step's samples is
            # generated: they serve until the home pool's rollout reaches it
            rollout = model.rollout_on(n)
            done = max(last.next_done_share * rollout, last.train_s)
            ahead = max(last.loan_home_share * rollout - done, 0.0)
            source = (f"taken back at {last.loan_home_share:.0%} of the step's samples, {last.next_done_share:.0%} "
                      f"generated: ~{ahead:.1f} s of rollout ({model.model} model)")
        elif (live := self._live_ahead(view, elapsed)) is not None:
            # the step's own pace, where it is known, decides: slower than the last steps (the
            # workload turned), it says so before the step report does; faster, the model's time
            # is the tail's latency floor, which lent devices do not shorten
            ahead = live
            source = f"{view.samples_done}/{view.samples_total} samples done in {elapsed:.1f} s"
            if model is not None:
                source += (f": ~{live:.1f} s ahead at that pace (the {model.model} model of the last steps "
                           f"says ~{max(model.rollout_on(n) - elapsed, 0.0):.1f} s)")
        elif model is not None and elapsed is not None:
            # before a sample is done: the cost model's rollout less the time the step has run
            left = model.rollout_on(n) - elapsed
            ahead = max(left, 0.0)
            source = f"rollout ~{left:.0f} s ahead ({model.model} model)"
        else:
            ahead = self.unmeasured_rollout_s
            source = f"no step measured and no sample done yet: prior unmeasured_rollout_s={ahead:g}"
        saves = max(ahead - costs.lead_s, 0.0) * k / (n + k)
        cost = costs.to_rollout_s + costs.return_s / max(view.training_devices, 1) * k
        what = ("nothing to train yet" if view.mini_batch_total == 0
                else f"training step done ({view.mini_batch_done}/{view.mini_batch_total})")
        why = (f"lent {', '.join(free)} to the rollout: {what}, rollout queue not empty, {source}, "
               f"saves ~{saves:.0f} s (cost ~{cost:.0f} s)")
        # the rollout with the loan ends sooner by the saving; taken back at a share of the
        # samples, `ahead` is until then, not the rollout's end: no prediction of its end
        return LoanProposal(devices=free, to_pool=Pool.ROLLOUT.value, reason=why, saves_s=saves, cost_s=cost,
                            ends_in_s=-1.0 if until_home else ahead - saves)
