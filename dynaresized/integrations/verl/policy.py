"""The `dynaresized` verl dynamic-schedule policy: verl asks it when to activate and deactivate
its hybrid rollout replicas, and it answers from the daemon's resizes.

Inside verl's trainer actor it attaches two workers to the daemon (`BlockingWorkerClient`s):
`verl-trainer` (trainer rank on `verl:trainer` and the hybrid slots; it reports every step) and
`verl-rollout` (rollout engine on the hybrid and standalone slots). A resize's ops set the
hybrid state the daemon wants (`layout.hybrid_wanted`); verl applies it at its next step
boundary, and the op is acknowledged once verl says (through `is_hybrid_active` or the
activation it just ran) that its replicas are in that state. The daemon's guards, event log
and metrics therefore see every verl transition as a resize that started, ran op by op and
committed, or rolled back.

verl never waits on the daemon: reports leave through a queue, attachment retries in a
background thread, and while the daemon is away the last decision stands.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time

import ray
import structlog
from verl.experimental.fully_async_policy.dynamic_schedule import (
    DynamicScheduleContext,
    DynamicSchedulePolicyBase,
    register_policy,
)

from dynaresized.client import BlockingWorkerClient, DaemonRejected, DaemonUnavailable, OpRequest
from dynaresized.domain import OpKind, StepTiming, WorkerKind
from dynaresized.integrations.verl.layout import (
    POLICY_NAME,
    ROLLOUT_WORKER,
    TRAINER_WORKER,
    VerlLayout,
    hybrid_wanted,
)

log = structlog.get_logger("dynaresized.verl")

_OP_MARGIN_S = 0.5  # answer a little before the daemon's deadline, with our own reason


class HybridState:
    """What the daemon wants of verl's hybrid replicas and what verl last said they are.
    Op handlers (client threads) wait on it; the policy (verl's thread) updates it."""

    def __init__(self) -> None:
        self.wanted = False  # verl starts with its hybrid replicas asleep
        self.active = False
        self.step = 0
        self._changed = threading.Condition()

    def want(self, active: bool) -> None:
        with self._changed:
            if self.wanted != active:
                log.info("daemon wants hybrid replicas " + ("active" if active else "asleep"), step=self.step)
            self.wanted = active

    def observe(self, active: bool, step: int) -> None:
        with self._changed:
            self.active, self.step = active, step
            self._changed.notify_all()

    def wait(self, active: bool, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.active == active, timeout=timeout_s)


class VerlWorkers:
    """The verl job's two dynaresized workers, attached in the background and kept attached."""

    def __init__(self, endpoint: str, layout: VerlLayout, hybrid: HybridState, *,
                 retry_s: float = 2.0) -> None:
        self.endpoint = endpoint
        self.layout = layout
        self.hybrid = hybrid
        self.retry_s = retry_s
        self.trainer: BlockingWorkerClient | None = None
        self.rollout: BlockingWorkerClient | None = None
        self._reports: queue.Queue[StepTiming] = queue.Queue(maxsize=10_000)
        self._stop = threading.Event()
        threading.Thread(target=self._attach, name="dynaresized-verl-attach", daemon=True).start()
        threading.Thread(target=self._report, name="dynaresized-verl-report", daemon=True).start()
        atexit.register(self.close)  # verl has no teardown for policies: say goodbye at exit

    def report(self, timing: StepTiming) -> None:
        """Queue one step's timings; never blocks verl (a full queue drops the oldest)."""
        while True:
            try:
                self._reports.put_nowait(timing)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._reports.get_nowait()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for client in (self.trainer, self.rollout):
            if client is not None:
                try:
                    client.close(reason="verl job ended")
                except Exception as exc:  # the job is ending; the daemon may be gone
                    log.warning("closing the dynaresized client failed", error=str(exc))

    # -- background threads ----------------------------------------------------------
    def _attach(self) -> None:
        """Register both workers, retrying until the daemon answers. Once registered, the
        client re-registers by itself after a daemon restart."""
        while not self._stop.is_set():
            try:  # a worker that registered stays registered while the other one retries
                if self.trainer is None:
                    self.trainer = self._start(TRAINER_WORKER, WorkerKind.TRAINER_RANK,
                                               self.layout.trainer_worker_devices, self._trainer_op)
                if self.rollout is None and self.layout.standalone > 0:
                    self.rollout = self._start(ROLLOUT_WORKER, WorkerKind.ROLLOUT_ENGINE,
                                               self.layout.rollout_worker_devices, self._rollout_op)
                log.info("verl job attached to dynaresized", endpoint=self.endpoint,
                         devices=list(self.layout.devices))
                return
            except DaemonRejected as exc:
                log.error("dynaresized refused the verl job; verl keeps its current schedule", error=str(exc))
                return
            except DaemonUnavailable as exc:
                log.warning("dynaresized is unreachable; verl keeps running on its last decision",
                            error=str(exc), retry_in_s=self.retry_s)
                self._stop.wait(self.retry_s)
            except Exception as exc:  # a bug or a broken endpoint: say so, keep verl going, retry
                log.error("attaching to dynaresized failed; verl keeps running on its last decision",
                          error=f"{type(exc).__name__}: {exc}", retry_in_s=self.retry_s)
                self._stop.wait(self.retry_s)

    def _start(self, worker_id: str, kind: WorkerKind, devices: tuple[str, ...],
               handler: object) -> BlockingWorkerClient:
        client = BlockingWorkerClient(self.endpoint, worker_id, kind, devices)
        for op in OpKind:
            client.on(op, handler)  # type: ignore[arg-type]
        try:
            client.start()
        except BaseException:
            client.close()
            raise
        return client

    def _report(self) -> None:
        while not self._stop.is_set():
            try:
                timing = self._reports.get(timeout=1.0)
            except queue.Empty:
                continue
            while self.trainer is None and not self._stop.wait(0.1):
                pass  # not attached yet: hold the step until it can be reported
            client = self.trainer
            if client is None:
                return
            try:
                client.report_step(timing)
            except Exception as exc:  # verl must not die of it; the next step reports again
                log.warning("step report to dynaresized failed", step=timing.step, error=str(exc))

    # -- op handlers (client threads) ------------------------------------------------
    def _trainer_op(self, op: OpRequest) -> str:
        # verl's FSDP group keeps every trainer GPU whatever the hybrid replicas do: the trainer
        # side of a move needs no action, only the rollout side's answer below.
        return f"{op.kind.value}: verl's trainer keeps its FSDP group on all trainer GPUs"

    def _rollout_op(self, op: OpRequest) -> str:
        fixed = [d for d in op.devices if d not in self.layout.hybrid_devices]
        if fixed:
            raise ValueError(f"verl cannot move {', '.join(fixed)}: only hybrid replicas change roles")
        want = hybrid_wanted(op.kind, op.from_pool, op.to_pool)
        if want is None:
            return f"{op.kind.value}: nothing to do in verl"
        state = "active" if want else "asleep"
        if set(op.devices) != set(self.layout.hybrid_devices):
            raise ValueError(f"verl moves all {self.layout.hybrid} hybrid replicas together, "
                             f"not {len(op.devices)}: allow only splits {self.layout.asleep} and {self.layout.active}")
        self.hybrid.want(want)
        started = time.monotonic()
        if not self.hybrid.wait(want, max(op.timeout_s - _OP_MARGIN_S, 0.1)):
            raise TimeoutError(f"verl did not make its hybrid replicas {state} within {op.timeout_s:.1f}s "
                               "(verl applies a change at its next step boundary; raise core.op_timeout_s "
                               "above one verl step)")
        return (f"verl hybrid replicas {state} at step {self.hybrid.step} "
                f"(waited {time.monotonic() - started:.2f}s)")


@register_policy(POLICY_NAME)
class DynaresizedSchedulePolicy(DynamicSchedulePolicyBase):
    """verl's hybrid replicas follow the daemon's resizes. Configured through the Ray
    runtime_env: DYNARESIZED_ENDPOINT (the daemon's worker endpoint), DYNARESIZED_VERL_HYBRID
    and DYNARESIZED_VERL_STANDALONE (the replica counts the daemon's [cluster] section lists)."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, *,
                 endpoint: str | None = None, layout: VerlLayout | None = None) -> None:
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid
        self.layout = layout or VerlLayout.from_env()
        self.hybrid = HybridState()
        self.endpoint = endpoint or os.environ.get("DYNARESIZED_ENDPOINT", "tcp://127.0.0.1:5555")
        if only_hybrid:
            # No standalone replica: asleep, the hybrid replicas would leave verl no rollout at all.
            # verl's own only-hybrid cycle stays (wake after each weight sync, sleep once the cycle's
            # samples are in) and the daemon only observes: no rollout worker attaches, so it can
            # plan no move of the hybrid slots.
            log.warning("verl runs without standalone replicas (only_hybrid): dynaresized observes its "
                        "steps but does not move its hybrid replicas")
        self.workers = VerlWorkers(self.endpoint, self.layout, self.hybrid)
        self._step_started: float | None = None
        self._generated = 0
        self._activating = False
        self._waking = False  # this step's activation wakes replicas that were asleep

    # verl's call order per step: should_deactivate (before training), deactivate_wait_samples,
    # should_activate_after_step (after weight sync), request_rebalance, update_after_step.
    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        if self._step_started is None:
            self._step_started = time.monotonic()
        self.hybrid.observe(is_hybrid_active, global_steps)
        if self.only_hybrid:
            return is_hybrid_active
        return is_hybrid_active and not self.hybrid.wanted

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        # As verl's own policies: let the replicas buffer part of the cycle before they sleep.
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        self.hybrid.observe(is_hybrid_active, global_steps)
        # An active replica gets every new version of the weights (verl syncs hybrid replicas only
        # when this says True), even when it is to sleep at the next step's start.
        self._activating = self.only_hybrid or self.hybrid.wanted or is_hybrid_active
        self._waking = self._activating and not is_hybrid_active
        return self._activating

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """As verl's default policy, spread in-flight requests over the replicas just woken;
        not on the steps where active replicas only receive new weights."""
        rollouter = getattr(self, "_rollouter", None)  # verl's controller sets it after construction
        if not self._waking or rollouter is None:
            return
        try:
            ray.get(rollouter.rebalance_requests.remote())
        except Exception as exc:  # a failed rebalance costs balance, not correctness
            log.warning("request rebalance after activation failed", step=global_steps, error=str(exc))

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        if self._activating and ctx.last_activate_duration_s > 0:
            self.hybrid.observe(True, global_steps)
        self._activating = False
        started, self._step_started = self._step_started, None
        if started is None:
            return
        wall = time.monotonic() - started
        wait = sum(ctx.step_wait_times)
        switch = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        train_s = max(wall - wait - switch, 0.0)
        generated = max(ctx.total_generated_samples - self._generated, 0)
        self._generated = ctx.total_generated_samples
        if wait > 0 or generated <= ctx.step_required_samples:
            rollout_s = train_s + wait  # the trainer waited: rollout took the whole step
        else:  # rollout ran ahead: the time it needed for one cycle's samples
            rollout_s = train_s * ctx.step_required_samples / generated
        self.workers.report(StepTiming(step=global_steps, rollout_s=rollout_s, train_s=train_s, weight_sync_s=switch,
                                       samples=generated))
