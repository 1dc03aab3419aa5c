"""The `dynaresized_separate_async` trainer: verl's V1 separate-async trainer
(`PPOTrainerSeparateAsync`, `trainer.v1.trainer_mode=separate_async`) whose hybrid-rollout switch
(`trainer.v1.separate_async.hybrid_rollout.enable_switch`, verl PR #7373) the daemon decides.

verl writes that switch's rule inline. After each training step, in `on_step_end` before the
weight sync, it lends its hybrid replicas to generation while samples are missing for the next
step and their benefit (missing samples x measured seconds per sample, scaled by the GPUs
added) beats the measured switch cost; at the next step's start (`on_step_begin`, then
`prepare_step`) it takes them back once a threshold of samples is sampleable. There is no policy
seam, so this subclass overrides the two helpers the lending rule reads, and only while the
daemon decides:

* `_switch_threshold()` is 0 when the daemon lends nothing: no sample is missing, and verl's rule
  keeps its replicas asleep;
* `_effective_switch_cost()` is None when the daemon's loan came: no cost is left for verl's check
  to weigh (the daemon priced the loan), so verl lends them for its next step.

The rest is verl's own: when and how the replicas go back (its threshold, its wait,
`switch_to_trainer`), the weight sync, its metrics, and its adaptive threshold and switch-cost
windows, which keep learning while the daemon decides so that verl's rule is current whenever
it decides again (the daemon absent, refused or lost: one log line each, `workers.py`). So verl's
contract holds as in verl: the replicas are asleep before every training step and every weight
update. `switch_to_rollout` and `switch_to_trainer` are wrapped only to tell the daemon's op
handlers what verl did, and to time it for the step report.

verl itself is imported here: `dynaresized.integrations.verl.register_v1` imports this module in
verl's processes only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode, PPOTrainerSeparateAsync

from dynaresized.domain import StepTiming
from dynaresized.integrations.verl.layout import V1_TRAINER_NAME, VerlLayout
from dynaresized.integrations.verl.workers import LoanDecisions, cycle_timing

if TYPE_CHECKING:
    from omegaconf import DictConfig

if not hasattr(PPOTrainerSeparateAsync, "_effective_switch_cost"):  # verl 0.9.0
    import verl

    raise ImportError(f"verl {verl.__version__}'s separate_async trainer has no hybrid-rollout switch "
                      "(trainer.v1.separate_async.hybrid_rollout comes with verl 0.9.1)")

log = structlog.get_logger("dynaresized.verl")

FALLBACK = "verl's switch rule"
"""Who decides while the daemon does not, as the log lines name it."""


class SwitchClock:
    """When verl's step began and its hybrid replicas changed mode, for the step report
    (monotonic seconds)."""

    def __init__(self) -> None:
        self.cycle_start: float | None = None  # the previous decision: the rollout period starts
        self.step_start: float | None = None  # on_step_begin
        self.active_since: float | None = None  # the hybrid replicas began generating
        self.lent_s = 0.0  # they generated in this cycle, until the step's switch to trainer
        self.activate_s = 0.0  # switch_to_rollout in this cycle
        self.deactivate_s = 0.0  # this step's switch_to_trainer
        self.backlog = 0  # sampleable groups at the last report


@register_trainer(V1_TRAINER_NAME)
class DynaresizedSeparateAsyncTrainer(PPOTrainerSeparateAsync):
    """verl's separate-async trainer, its hybrid replicas lent to generation when the daemon says
    so. Configured through the Ray runtime_env: DYNARESIZED_ENDPOINT, and for CURVE
    DYNARESIZED_KEY_DIR and DYNARESIZED_SERVER_KEY (docs/verl.md). Replica counts come from verl."""

    _verdict: bool | None = None  # the daemon's, while verl's on_step_end decides (None: verl's rule)

    def __init__(self, config: DictConfig) -> None:
        # This is verl's separate_async mode: verl reads the mode's settings as trainer.v1.<mode>.*
        config.trainer.v1.trainer_mode = "separate_async"
        super().__init__(config)
        self._loans = LoanDecisions(FALLBACK)  # a bad key setting stops the job here, before any step
        self._clock = SwitchClock()
        self._attached = False
        log.info("verl's separate_async trainer; dynaresized decides its hybrid-rollout switch",
                 endpoint=self._loans.endpoint, enable_switch=self.hybrid_rollout_config.enable_switch)

    @property
    def decided_by(self) -> str:
        """Who decided the last activation: "daemon" or "default" (verl's rule)."""
        return self._loans.decided_by

    def on_init_end(self) -> None:
        super().on_init_end()
        self._attach()  # verl's replicas exist now: attach before the first step

    def _attach(self) -> None:
        if self._attached:
            return
        self._attached = True
        if not self._enable_hybrid_replicas:
            log.warning("verl runs without hybrid replicas (actor_rollout_ref.hybrid_engine=False): there is "
                        "nothing to lend, dynaresized stays out of this job")
            return
        try:
            layout = VerlLayout.from_counts(len(self.llm_server_manager.get_replicas()),
                                            len(self.standalone_server_manager.get_replicas()))
        except ValueError as exc:  # what the operator said is not this job: verl's rule decides
            log.error(f"the verl job is not the one dynaresized was set up for; {FALLBACK} decides for the rest "
                      "of it", error=str(exc))
            return
        observe_only = not self.hybrid_rollout_config.enable_switch
        if observe_only:
            log.warning("verl's hybrid-rollout switch is off (trainer.v1.separate_async.hybrid_rollout."
                        "enable_switch=False): verl never lends its hybrid replicas; dynaresized observes its steps")
        if self.current_mode is HybridEngineMode.ROLLOUT:  # verl starts with them generating
            self._clock.active_since = time.monotonic()
            self._loans.cycle.observe(True, self.global_steps)
        self._loans.attach(layout, observe_only=observe_only)

    # -- the decision: verl's on_step_end, the daemon's verdict read by the two helpers
    def on_step_begin(self) -> None:
        self._attach()
        clock, now = self._clock, time.monotonic()
        clock.step_start, clock.deactivate_s = now, 0.0
        if clock.cycle_start is None:
            clock.cycle_start, clock.backlog = now, self._sampleable(self.global_steps)
        self._loans.training_begins(self.global_steps)
        super().on_step_begin()

    def on_step_end(self) -> None:
        step = self.global_steps
        backlog = self._sampleable(step + 1)
        # A loan serves verl's next step until its threshold of groups is sampleable: with no next
        # step, or the threshold already met, it would end as it begins, so the daemon is not asked.
        can_lend = (self.hybrid_rollout_config.enable_switch and step < self.total_training_steps
                    and backlog < self._switch_threshold())
        verdict = self._loans.decide(step, self.current_mode is HybridEngineMode.ROLLOUT,
                                     lambda: self._step_timing(backlog), can_lend=can_lend)
        self._verdict = verdict
        try:
            super().on_step_end()
        finally:
            self._verdict = None
        if verdict and self.current_mode is not HybridEngineMode.ROLLOUT:
            # Rare: the loan came, but when verl counted (its threshold adapted, groups arrived while
            # the daemon decided) its next step had them. Lend as verl does for validation, so that
            # verl makes the loan the daemon recorded; verl's next step takes the replicas back.
            log.info("verl's next step had its samples when the loan came; lending as the daemon decided", step=step)
            self.switch_to_rollout()
            self.clear_sticky_cache()
        if self.hybrid_rollout_config.enable_switch and isinstance(getattr(self, "_pending_sync_metrics", None), dict):
            self._pending_sync_metrics["separate_async/decision/by_dynaresized"] = float(verdict is not None)

    def _switch_threshold(self) -> int:
        if self._verdict is False:
            return 0  # the daemon lends nothing: no sample is missing for verl's rule to lend for
        return super()._switch_threshold()

    def _effective_switch_cost(self) -> float | None:
        if self._verdict:
            return None  # the daemon priced the loan: no cost is left for verl's check to weigh
        return super()._effective_switch_cost()

    # -- what verl did, for the daemon's op handlers and the step report
    def switch_to_rollout(self, *, already_registered: bool = False) -> None:
        started = time.monotonic()
        super().switch_to_rollout(already_registered=already_registered)
        now = time.monotonic()
        self._clock.activate_s += now - started
        self._clock.active_since = now
        self._loans.cycle.observe(True, self.global_steps)  # a loan's join is answered

    def switch_to_trainer(self) -> None:
        clock, started = self._clock, time.monotonic()
        if clock.active_since is not None:
            clock.lent_s += max(started - max(clock.active_since, clock.cycle_start or started), 0.0)
            clock.active_since = None
        super().switch_to_trainer()
        clock.deactivate_s += time.monotonic() - started
        self._loans.cycle.observe(False, self.global_steps)  # a return's drain is answered

    def _sampleable(self, step: int) -> int:
        """Groups verl's replay buffer could hand step `step` now (0 for a custom sampler without
        the count, which verl requires only with the switch on)."""
        count = getattr(self.replay_buffer, "get_sampleable_count", None)
        return int(count(step, "train")) if count is not None else 0

    def _step_timing(self, backlog: int) -> StepTiming | None:
        """The cycle that ends now (from the last decision): the trainer's time on its GPUs, less
        its waits for samples and for the lent replicas to come back; the groups generated, from
        the replay buffer's `backlog` for the next step and the batch this one took."""
        layout, clock = self._loans.layout, self._clock
        if layout is None or clock.step_start is None or clock.cycle_start is None:
            return None
        now = time.monotonic()
        waits = self.timing_raw.get("switch_wait", 0.0) + self._step_sample_wait_seconds + clock.deactivate_s
        train_s = max(now - clock.step_start - waits, 0.0)
        required = int(self.config.data.train_batch_size)
        timing = cycle_timing(self.global_steps, layout, period_s=now - clock.cycle_start, train_s=train_s,
                              lent_s=clock.lent_s, required=required,
                              generated=max(backlog - clock.backlog + required, 0),
                              waited=self._step_wait_samples > 0 or self._step_had_idle(),
                              weight_sync_s=clock.activate_s + clock.deactivate_s)
        clock.cycle_start, clock.backlog, clock.lent_s, clock.activate_s = now, backlog, 0.0, 0.0
        return timing
