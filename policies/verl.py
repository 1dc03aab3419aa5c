"""verl's own rules for lending trainer GPUs to the rollout, as policies of ours: what a verl
user runs today, driven through our core and simulator so that a run compares against them
on the same trace, profile, devices and initial split.

`verl-default` is `DefaultDynamicSchedulePolicy` of verl's fully-async trainer with
`async_training.use_dynamic_resource_scheduling=True`; `verl-v1-switch` is the step switch of
verl's v1 `separate_async` trainer (`trainer.v1.separate_async.hybrid_rollout.enable_switch`).
Written from verl's source at commit 1dda039b9c6311889a9c9a26040677e1254814f9 (verl main,
2026-08-22; the `dynamic_schedule` folder and `fully_async_trainer.py` are the same at v0.9.0):

* `verl/experimental/fully_async_policy/dynamic_schedule/default_policy.py` (the rule: its
  constants, `should_activate_after_step`, `_deactivate_gap`, `_estimate_per_sample_time`,
  `_has_positive_net_benefit`, `update_after_step`, `deactivate_wait_samples`),
  `.../dynamic_schedule/base.py` (`DynamicScheduleContext`: `step_required_samples`,
  `total_generated_samples`, `expected_samples`, `step_wait_times`, `step_wait_samples`),
  `.../fully_async_policy/fully_async_trainer.py` (when it is called: `fit_step` waits for
  `deactivate_wait_samples()` queued samples, deactivates, collects and trains;
  `_fit_update_weights` decides to activate after training, before the weight sync, then
  adapts; `_get_samples_from_queue` measures the wait and the samples waited for);
* `verl/trainer/ppo/v1/trainer_separate_async.py` (`on_step_begin`, `_wait_for_sampleable_and_switch`,
  `_switch_threshold`, `_adapt_switch_threshold`, `_effective_switch_cost`, `on_step_end`:
  PR #7373, commit 890dfc3) and `docs/advance/v1_async_trainer.md` (its defaults).

verl's hybrid replicas are the trainer GPUs serving as rollout engines; here they are loans of
the trainers to the rollout (`LoanProposal` to `rollout`, the mechanism `policies/lending.py`
uses for `lend_trainers`): lent after the training step's last mini-batch (verl: after
training, before the weight sync) when verl's rule activates, home when the rollout step has
the rule's number of samples done (verl: the next step's wait for queued samples, then
deactivate) or at the step boundary. Neither rule ever resizes or lends engines to training.

The mapping (docs/simulator.md, "verl's own rules"): one of our RL steps is one verl
parameter-sync cycle, `required_samples x trigger_parameter_sync_step = S`, the step's samples;
the samples of the rollout step in progress that are done are verl's surplus
`total_generated_samples - expected_samples`; the trainer waits for a batch from the end of its
previous training step (or from when its loan goes home) until the batch's last sample, and the
samples it waits for are those not done when it starts waiting (`step_wait_times`,
`step_wait_samples`, one collection per cycle). Switch durations are the loan seconds of the
core's view for loans to the rollout (`LoanView.costs_to`): becoming an engine `return_s`
(trainer leave + engine wake in the simulator), going home `lead_s` (engine release + trainer
join): the simulator's are the profile's. A daemon with `core.learn_loan_costs` on replaces
`return_s` by its loans' measured ways home (so there the activation this rule reads is the
measured way home) and keeps `lead_s` as configured.

Both rules adapt state across steps, as verl's policy objects do; it is soft state (a daemon
restart starts it afresh, as verl's does).
"""

from __future__ import annotations

import msgspec

from dynaresized.core.policy import LoanProposal, LoanView, ObservedView, Proposal
from dynaresized.domain import Pool

# default_policy.py
DEFAULT_SWITCH_THRESHOLD_S = 10.0
SWITCH_OVERHEAD_WINDOW_SIZE = 3
DEACTIVATE_RATIO_INCREASE_MIN = 0.02
DEACTIVATE_RATIO_INCREASE_MAX = 0.1
DEACTIVATE_RATIO_DECREASE_STEP = 0.02
INITIAL_PER_SAMPLE_TIME_S = 1000.0


class Collection(msgspec.Struct):
    """How the trainer waited for one rollout step's batch (verl measures it per collection)."""

    total: int = 0  # the batch's samples
    start_s: float | None = None  # when the trainer began to wait (its loan, if any, gone home)
    queued: int = 0  # samples already done then
    end_s: float | None = None  # when the batch's last sample was done
    lent: bool = False  # trainers were lent to this rollout step (verl: hybrid active)
    measured: tuple[float, int] | None = None  # the wait as the trainer measured it (`record_wait`)

    def wait(self) -> tuple[float, int]:
        """(seconds waited, samples waited for): verl's `step_wait_times`, `step_wait_samples`."""
        if self.measured is not None:
            return self.measured
        if self.start_s is None:
            return 0.0, 0
        seconds = max((self.end_s if self.end_s is not None else self.start_s) - self.start_s, 0.0)
        return seconds, max(self.total - self.queued, 0)


class VerlRule:
    """What both rules share: no resizes, and the trainer's wait for each batch measured from
    the loan views and progress reports the core passes on."""

    name = "verl"
    guarded = True
    lends = True
    lends_trainers = True
    last_reason = "verl's rules never resize: they lend the trainers to the rollout (hybrid replicas)"

    def __init__(self) -> None:
        self.collections: dict[int, Collection] = {}
        self._decided = -1  # the last training step decided after
        self._started = False  # the first rollout step was considered
        self._home_at: int | None = None  # samples done at which the lent trainers go home
        self._lending_step = -1  # the rollout step they were lent to
        self._seen_lent = False  # a progress report found them lent (the loan was not refused)

    def __call__(self, view: ObservedView) -> Proposal | None:
        return None

    # -- what the trainer measures ---------------------------------------------------------
    def record_wait(self, step: int, seconds: float, samples: int) -> None:
        """The trainer's wait for step `step`'s batch as verl's trainer measures it
        (`_get_samples_from_queue`, summed over the cycle's mini-batches). Where mini-batches
        stream (the simulator's fully-async pipeline, `sim/asyncpipe.py`) progress reports cannot
        tell it, so the pipeline hands it over before asking for a loan."""
        self._collection(step).measured = (float(seconds), int(samples))

    def _collection(self, step: int) -> Collection:
        return self.collections.setdefault(step, Collection())

    def _observe(self, view: LoanView) -> None:
        r = view.rollout_step
        for step, c in self.collections.items():
            if step < r and c.end_s is None:
                c.end_s = view.now  # its last sample was not reported: it was done by now at the latest
        if self._home_at is not None and self._lending_step < r:
            # The lent trainers stayed until the step boundary: the trainer waited for nothing
            # after they came home (verl: the queue held the batch when it deactivated).
            if self._seen_lent:
                c = self._collection(self._lending_step)
                c.start_s, c.queued, c.lent = c.end_s, c.total, True
            self._home_at, self._seen_lent = None, False
        c = self._collection(r)
        if view.samples_total:
            c.total = view.samples_total
        if c.end_s is None and view.samples_total and view.samples_done >= view.samples_total:
            c.end_s = view.now
        if c.start_s is None and view.mini_batch_total == 0 and r == 0:
            c.start_s, c.queued = view.now, view.samples_done  # nothing to train: it waits from the start
        for step in [s for s in self.collections if s < r - 1]:
            del self.collections[step]  # decided on: only the batch in training and the next matter

    def observe_progress(self, view: LoanView) -> str | None:
        """After every progress report: send the lent trainers home once the rollout step has
        the samples the rule waits for (verl's trainer polls its queue, then deactivates)."""
        self._observe(view)
        lent = view.training_devices < view.split.train
        if not lent or self._home_at is None or view.rollout_step != self._lending_step:
            return None
        self._seen_lent = True
        if view.samples_done < self._home_at:
            return None
        c = self._collection(view.rollout_step)
        c.start_s, c.queued, c.lent = view.now, view.samples_done, True
        home_at, self._home_at, self._seen_lent = self._home_at, None, False
        return (f"{self.name}: {view.samples_done} of {view.samples_total} samples of step {view.rollout_step} "
                f"done (home at {home_at})")

    def propose_loan(self, view: LoanView) -> LoanProposal | None:
        self._observe(view)
        if view.mini_batch_total == 0:
            if view.rollout_step != 0 or self._started or not view.free_trainers or not view.samples_total:
                return None
            self._started = True
            return self._first_rollout(view)
        trained = view.rollout_step - 1
        if view.mini_batch_done < view.mini_batch_total or trained <= self._decided or not view.free_trainers:
            return None
        self._decided = trained
        c = self._collection(view.rollout_step)
        c.start_s, c.queued = view.now, view.samples_done  # unless its loan goes home later
        if not view.samples_total:
            return None  # no rollout step left to help (the run's last training step)
        return self._after_training(view, self._collection(trained))

    def _lend(self, view: LoanView, home_at: int, saves_s: float, cost_s: float, why: str) -> LoanProposal:
        self._home_at = home_at
        self._lending_step = view.rollout_step
        free = tuple(sorted(view.free_trainers))
        return LoanProposal(devices=free, to_pool=Pool.ROLLOUT.value, reason=f"{self.name}: {why}",
                            saves_s=saves_s, cost_s=cost_s)

    def _first_rollout(self, view: LoanView) -> LoanProposal | None:
        return None

    def _after_training(self, view: LoanView, cycle: Collection) -> LoanProposal | None:
        raise NotImplementedError


class VerlDefaultPolicy(VerlRule):
    """verl's `default` dynamic-scheduling policy (`DefaultDynamicSchedulePolicy`): activate the
    hybrid replicas after a training step when the samples still missing to the deactivate
    threshold, at the measured wait per sample, cost more than a switch; deactivate once
    `int(deactivate_ratio x S)` samples are done; adapt the ratio to the samples waited for."""

    name = "verl-default"

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False,
                 enable_rebalance: bool = True, switch_cost_s: float = DEFAULT_SWITCH_THRESHOLD_S) -> None:
        super().__init__()
        if switch_cost_s < 0:
            raise ValueError("switch_cost_s must be >= 0")
        self.initial_switch_cost_s = float(switch_cost_s)
        """The switch cost assumed until one is measured: verl's constant (10 s). Its steps are
        minutes; on a workload of seconds-long steps (the CPU example) no saving ever exceeds it
        and the rule never activates. A lower value seeds the rule with a known switch cost, as
        if it had measured one already: a variant of verl's rule, named as such where used."""
        self.rebalances = bool(enable_rebalance)
        """`dynamic_schedule_enable_rebalance` (default True): after activation, every running
        request is aborted and resumed on the least-loaded replica (the simulator does it)."""
        if only_hybrid:
            raise ValueError("only_hybrid (no standalone rollout) is verl's colocated mode; our pipeline "
                             "keeps a rollout pool")
        self.deactivate_ratio = float(deactivate_ratio)
        self.switch_overheads: list[float] = []
        self.per_sample_time_s = INITIAL_PER_SAMPLE_TIME_S

    def switch_cost_s(self) -> float:
        if self.switch_overheads:
            recent = self.switch_overheads[-SWITCH_OVERHEAD_WINDOW_SIZE:]
            return sum(recent) / len(recent)
        return self.initial_switch_cost_s

    def _after_training(self, view: LoanView, cycle: Collection) -> LoanProposal | None:
        S = view.samples_total  # required_samples x trigger_parameter_sync_step
        surplus = view.samples_done  # total_generated_samples - expected_samples
        wait_s, wait_samples = cycle.wait()
        # should_activate_after_step: a gap to the deactivate threshold, and a net benefit
        ratio = self.deactivate_ratio
        gap = ratio * S - surplus
        activate, benefit, cost = False, 0.0, self.switch_cost_s()
        if gap > 0:
            if wait_s > 0 and wait_samples > 0:
                self.per_sample_time_s = wait_s / wait_samples
            benefit = max(0.0, gap) * self.per_sample_time_s
            activate = benefit - cost > 0
        # update_after_step: this cycle's switch durations, then the ratio
        costs = view.costs_to(Pool.ROLLOUT)
        overhead = (costs.return_s if activate else 0.0) + (costs.lead_s if cycle.lent else 0.0)
        if overhead > 0:
            self.switch_overheads.append(overhead)
        if wait_samples > 0:
            delta = min(DEACTIVATE_RATIO_INCREASE_MAX, max(DEACTIVATE_RATIO_INCREASE_MIN, wait_samples / S))
            self.deactivate_ratio = min(1.0, self.deactivate_ratio + delta)
        else:
            self.deactivate_ratio -= DEACTIVATE_RATIO_DECREASE_STEP
        if not activate:
            return None
        home_at = int(S * self.deactivate_ratio)  # deactivate_wait_samples, at the next fit_step
        why = (f"{surplus} of {S} samples of step {view.rollout_step} done, gap {gap:.0f} to ratio {ratio:.2f} "
               f"x {S}; {gap:.0f} x {self.per_sample_time_s:.2f} s/sample = {benefit:.0f} s > switch cost "
               f"{cost:.1f} s; home at {home_at} samples")
        return self._lend(view, home_at, benefit, cost, why)


class VerlV1SwitchPolicy(VerlRule):
    """verl v1 `separate_async` step switching (`hybrid_rollout.enable_switch=True`): the hybrid
    replicas start in rollout mode, go to the trainer once `switch_threshold_ratio` of the batch
    is sampleable (floored at one mini-batch), and are lent again after a step whose next batch
    is short of that, unless the measured benefit does not exceed the measured switch cost; the
    ratio moves up or down after `switch_threshold_release_steps` idle or calm steps."""

    name = "verl-v1-switch"

    def __init__(self, switch_threshold_ratio: float = 0.4, adaptive_switch_threshold: bool = True,
                 switch_threshold_step_up: float = 0.05, switch_threshold_step_down: float = 0.03,
                 switch_threshold_release_steps: int = 2, switch_cost_window_size: int = 3,
                 parameter_sync_step: int = 16, poll_interval_s: float = 2.0) -> None:
        super().__init__()
        if not 0 < switch_threshold_ratio <= 1:
            raise ValueError("switch_threshold_ratio must be in (0, 1]")
        if switch_threshold_release_steps < 1 or switch_cost_window_size < 1 or parameter_sync_step < 1:
            raise ValueError("release steps, cost window and parameter_sync_step must be >= 1")
        self.ratio = float(switch_threshold_ratio)
        self.adaptive = bool(adaptive_switch_threshold)
        self.step_up = float(switch_threshold_step_up)
        self.step_down = float(switch_threshold_step_down)
        self.release_steps = int(switch_threshold_release_steps)
        self.window = int(switch_cost_window_size)
        self.parameter_sync_step = int(parameter_sync_step)
        self.poll_interval_s = float(poll_interval_s)
        self.idle_steps = self.calm_steps = 0
        self.wait_s = 0.0
        self.wait_samples = 0
        self.to_rollout_costs: list[float] = []
        self.to_trainer_costs: list[float] = []

    def threshold(self, S: int) -> int:
        """`_switch_threshold`: round(ratio x batch), floored at one mini-batch, capped at the batch
        (verl counts prompt groups; here samples)."""
        mini_batch = S // self.parameter_sync_step
        return min(max(round(self.ratio * S), mini_batch), S)

    def _first_rollout(self, view: LoanView) -> LoanProposal | None:
        # "hybrid engine is in rollout mode after initialization": it helps the first rollout
        # until on_step_begin finds the threshold sampleable (no switch was paid to get there).
        home_at = self.threshold(view.samples_total)
        if view.samples_done >= home_at:
            return None
        return self._lend(view, home_at, 1.0, 0.0, f"hybrid replicas start in rollout mode; home at {home_at} "
                          "samples (no cost check: nothing measured yet)")

    def observe_progress(self, view: LoanView) -> str | None:
        why = super().observe_progress(view)
        if why:
            self.to_trainer_costs.append(view.costs_to(Pool.ROLLOUT).lead_s)  # switch_to_trainer, timed
        return why

    def _adapt(self, had_idle: bool) -> None:
        if had_idle:
            self.calm_steps = 0
            self.idle_steps = min(self.idle_steps + 1, self.release_steps)
            if self.idle_steps >= self.release_steps:
                self.ratio = min(1.0, self.ratio + self.step_up)
            return
        self.idle_steps = 0
        self.calm_steps = min(self.calm_steps + 1, self.release_steps)
        if self.calm_steps >= self.release_steps:
            self.ratio = max(1.0 / self.parameter_sync_step, self.ratio - self.step_down)

    def _after_training(self, view: LoanView, cycle: Collection) -> LoanProposal | None:
        S = view.samples_total
        wait_s, wait_samples = cycle.wait()
        had_idle = wait_s > self.poll_interval_s
        if wait_samples > 0 and wait_s > 0:
            self.wait_s += wait_s
            self.wait_samples += wait_samples
        if self.adaptive:
            self._adapt(had_idle)
        threshold = self.threshold(S)
        remaining = max(0, threshold - view.samples_done)
        per_sample = self.wait_s / self.wait_samples if self.wait_samples > 0 else None
        cost = None
        if self.to_rollout_costs and self.to_trainer_costs:
            rollout, trainer = self.to_rollout_costs[-self.window:], self.to_trainer_costs[-self.window:]
            cost = sum(rollout) / len(rollout) + sum(trainer) / len(trainer)
        scaling = view.split.total / max(view.split.rollout, 1)
        benefit = remaining * per_sample * (1.0 - 1.0 / scaling) if per_sample is not None else None
        if remaining <= 0 or (benefit is not None and cost is not None and benefit <= cost):
            return None
        self.to_rollout_costs.append(view.costs_to(Pool.ROLLOUT).return_s)
        if benefit is None or cost is None:
            why = (f"{view.samples_done} of {S} samples of step {view.rollout_step} sampleable, {remaining} short of "
                   f"the threshold {threshold} (ratio {self.ratio:.2f}); no {'wait' if benefit is None else 'switch'} "
                   f"measured yet, so no cost check")
            return self._lend(view, threshold, 1.0, 0.0, why)
        why = (f"{view.samples_done} of {S} samples of step {view.rollout_step} sampleable, {remaining} short of "
               f"the threshold {threshold} (ratio {self.ratio:.2f}); benefit {benefit:.0f} s > switch cost {cost:.1f} s")
        return self._lend(view, threshold, benefit, cost, why)
