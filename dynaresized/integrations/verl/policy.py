"""The `dynaresized` verl dynamic-schedule policy: verl asks it, after every training step,
whether to activate its hybrid rollout replicas until the next one, and the daemon answers
with a loan.

verl's cycle is kept as verl's own policies keep it: the hybrid replicas sleep before every
training step (`should_deactivate` is True whenever they are active) and are activated, or not,
after it, before the weight sync (`should_activate_after_step`). So they are never awake through
a training step or a weight update ("Rollout must be in sleep mode", verl's naive weight sync).
The daemon sees that cycle as what it is: after each training step the hybrid slots may be lent
to the rollout (a loan, `PlanKind.LOAN`); when the next training step begins they go home (its
return). The trainer group is never resized.

Inside verl's trainer actor the job's two workers attach (`workers.py`); the layout comes from
verl's rollouter at run time.

While the daemon does not answer (not yet reached, refused, or lost mid-job) verl's own
`default` policy object, built with the same arguments and fed every step, decides; one log line
says so, and one more when the daemon answers again and decides from the next step on.
"""

from __future__ import annotations

import contextlib
import io
import time

import ray
import structlog
from verl.experimental.fully_async_policy.dynamic_schedule import (
    DefaultDynamicSchedulePolicy,
    DynamicScheduleContext,
    DynamicSchedulePolicyBase,
    register_policy,
)

from dynaresized.domain import StepTiming
from dynaresized.integrations.verl.layout import POLICY_NAME, VerlLayout
from dynaresized.integrations.verl.workers import LoanDecisions, cycle_timing

log = structlog.get_logger("dynaresized.verl")


@register_policy(POLICY_NAME)
class DynaresizedSchedulePolicy(DynamicSchedulePolicyBase):
    """verl's hybrid replicas are lent to the rollout when the daemon says so. Configured through
    the Ray runtime_env: DYNARESIZED_ENDPOINT, and for CURVE DYNARESIZED_KEY_DIR and
    DYNARESIZED_SERVER_KEY (docs/verl.md). The replica counts come from verl."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, *,
                 endpoint: str | None = None) -> None:
        # verl's own policy, built with the same arguments: it decides while the daemon is away,
        # and its adaptive deactivate_ratio sets how long active replicas generate into the next step.
        self.fallback = DefaultDynamicSchedulePolicy(deactivate_ratio=deactivate_ratio, only_hybrid=only_hybrid)
        self.only_hybrid = only_hybrid
        self.loans = LoanDecisions("verl's default policy", endpoint=endpoint)
        self._attached = False
        self._activating = False
        # timings of the cycle in progress (monotonic seconds)
        self._cycle_start: float | None = None  # the previous decision: the rollout period starts
        self._step_start: float | None = None  # should_deactivate: the training step begins
        self._window_end: float | None = None  # verl's wait for deactivate_wait_samples ended
        self._active_since: float | None = None  # the hybrid replicas became active
        self._last_activate_s = 0.0
        self._generated = 0

    @property
    def decided_by(self) -> str:
        """Who decided the last activation: "daemon" or "default"."""
        return self.loans.decided_by

    # -- attaching, with what verl's controller says the job is
    def _attach(self) -> None:
        if self._attached:
            return
        rollouter = getattr(self, "_rollouter", None)  # DynamicResourceController sets it after __init__
        if rollouter is None:
            return
        self._attached = True
        hybrid, standalone = ray.get([rollouter.get_all_hybrid_replicas.remote(),
                                      rollouter.get_standalone_replicas.remote()])
        try:
            layout = VerlLayout.from_verl(list(hybrid), len(standalone))
        except ValueError as exc:  # what the operator said is not this job: verl's default decides
            log.error("the verl job is not the one dynaresized was set up for; verl's default policy decides "
                      "for the rest of it", error=str(exc))
            return
        if self.only_hybrid:
            # No standalone replica: the hybrid replicas are verl's only rollout, and verl's own cycle
            # (wake after every weight sync, sleep before every step) stays. The daemon observes.
            log.warning("verl runs without standalone replicas (only_hybrid): dynaresized observes its steps "
                        "and verl's default policy decides")
        self.loans.attach(layout, observe_only=self.only_hybrid)

    # verl's call order per step: should_deactivate (before training), deactivate_wait_samples,
    # should_activate_after_step (after training, before the weight sync), request_rebalance,
    # update_after_step.
    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        self._attach()
        now = time.monotonic()
        if self._step_start is None:  # the first local step of a weight-sync cycle
            self._step_start = now
        if self._cycle_start is None:
            self._cycle_start = now
        self.loans.training_begins(global_steps + 1)
        return is_hybrid_active  # verl's contract: never train, nor sync weights, with replicas awake

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        threshold = self.fallback.deactivate_wait_samples(ctx)
        rollouter = getattr(self, "_rollouter", None)
        if rollouter is not None:
            # When verl's own wait for these samples ends, the lent replicas stop serving the
            # rollout: time it alongside (verl's wait polls the same queue).
            def ended(_: object) -> None:
                if self._window_end is None:
                    self._window_end = time.monotonic()

            try:
                rollouter.wait_for_enough_samples.remote(threshold).future().add_done_callback(ended)
            except Exception as exc:  # timing only
                log.warning("cannot time verl's wait for samples", error=str(exc))
        return threshold

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        self._attach()
        decision = self.loans.decide(global_steps, is_hybrid_active, lambda: self._step_timing(global_steps, ctx))
        if decision is None:
            decision = self.fallback.should_activate_after_step(global_steps, is_hybrid_active, ctx)
        self._activating = decision
        return decision

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """As verl's default policy: spread in-flight requests over the replicas just activated."""
        self.fallback._rollouter = getattr(self, "_rollouter", None)
        self.fallback.request_rebalance(global_steps, ctx)

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        now = time.monotonic()
        activated = self._activating and ctx.last_activate_duration_s > 0
        if activated:
            self._active_since = now
            self.loans.cycle.observe(True, global_steps)  # the loan's join is answered
        self._activating = False
        self._last_activate_s = ctx.last_activate_duration_s
        self.fallback.update_after_step(global_steps, ctx)  # verl's own state stays current for a fallback

    def _next_deactivate_samples(self, step: int, ctx: DynamicScheduleContext) -> int | None:
        """`deactivate_wait_samples` at the next step: the queued samples at which verl takes
        back hybrid replicas activated now, once verl's default has adapted its ratio to this
        step as its `update_after_step` will (run on a copy of the ratio; its lines not printed
        twice). None without standalone replicas (verl's own cycle; nothing is lent)."""
        if self.only_hybrid:
            return None
        probe = DefaultDynamicSchedulePolicy(deactivate_ratio=self.fallback.deactivate_ratio)
        with contextlib.redirect_stdout(io.StringIO()):
            probe.update_after_step(step, ctx)
        return probe.deactivate_wait_samples(ctx)

    def _step_timing(self, step: int, ctx: DynamicScheduleContext) -> StepTiming | None:
        """The cycle that ends now: the hybrid replicas served the rollout from their activation to
        the end of verl's wait for deactivate_wait_samples (or to this step's start, if verl did
        not wait)."""
        layout = self.loans.layout
        if layout is None or self._step_start is None or self._cycle_start is None:
            self._step_start = self._window_end = None
            return None
        now = time.monotonic()
        lent_s = 0.0
        if self._active_since is not None:
            until = self._window_end or self._step_start
            lent_s = max(until - max(self._active_since, self._cycle_start), 0.0)
            self._active_since = None
        tail = max((self._window_end or self._step_start) - self._step_start, 0.0)
        deactivate = ctx.last_deactivate_duration_s
        train_s = max(now - self._step_start - tail - deactivate - sum(ctx.step_wait_times), 0.0)
        generated = max(ctx.total_generated_samples - self._generated, 0)
        self._generated = ctx.total_generated_samples
        timing = cycle_timing(step, layout, period_s=now - self._cycle_start, train_s=train_s, lent_s=lent_s,
                              required=ctx.step_required_samples, generated=generated,
                              waited=sum(ctx.step_wait_samples) > 0,
                              weight_sync_s=self._last_activate_s + deactivate,
                              queued=ctx.total_generated_samples - ctx.expected_samples,
                              home_at=self._next_deactivate_samples(step, ctx))
        self._cycle_start = now
        self._step_start = self._window_end = None
        return timing
