"""The core's configuration (`CoreConfig`): timeouts, guards and the costs a policy starts
from. Decides nothing and emits no fact; transitions read it as `core.config`."""

from __future__ import annotations

import msgspec

from dynaresized.core import guards
from dynaresized.core.policy import LoanCosts, ResizeCosts, TailCosts
from dynaresized.domain import PipelineSpec


class CoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    guards: guards.GuardConfig = guards.GuardConfig()
    heartbeat_timeout_s: float = 10.0
    """A worker silent for longer is declared lost."""
    op_timeout_s: float = 120.0
    """An operation not acknowledged by all its targets in this time fails the resize."""
    steps_total: int | None = None
    """Job length in RL steps, if known: bounds the payback horizon."""
    costs: ResizeCosts = ResizeCosts()
    """Resize cost per device before any resize has been measured."""
    op_resend_s: float | None = None
    """While an op is pending, re-send it to its live targets this often (workers deduplicate by
    op id and answer a repeat from their record), so a lost message never fails a resize.
    None: never (the simulator, where no message is lost)."""
    audit_interval_s: float | None = None
    """Ask every live worker that reports its actual state for it this often. None: never."""
    reconcile_retry_s: float = 30.0
    """A worker that could not be converged is tried again this long after (its devices stay
    out of resize plans meanwhile)."""
    loan_costs: LoanCosts = LoanCosts()
    """What a loan adds to the critical path, for the lending policy's estimate, before any
    loan that way has been measured."""
    learn_loan_costs: bool = False
    """After loans of a direction have landed and come home, their measured seconds (the mean of
    the last `state.LOAN_TIMES_KEPT`) replace the configured way home and landing
    (`LoanCosts.learned`), as the measured resize costs replace `costs`. Only where workers
    acknowledge a loan's ops when they are done (the torch and vLLM backends): verl's
    integration acknowledges a return when verl's own cycle puts the replicas to sleep, so its
    measured way home is verl's schedule, not a cost. False: always the configured ones (and
    the simulator, whose configured costs are the profile's own)."""
    stall_s: float | None = None
    """A tick that comes more than this after the one before means the daemon itself was not
    running (starved of CPU, or waiting on a slow disk): that blind time does not count as the
    workers' silence. None: every gap counts (the simulator and tests, which jump in time)."""
    pipeline: PipelineSpec = PipelineSpec()
    """The job's pipeline (`[pipeline]`): where it runs verl's fully-async pipeline with partial
    rollout, a step's long tail carries over into the next weight version, so the cost model
    predicts the rollout without its latency floor (`costmodel.tail_binds`)."""
    tail_costs: TailCosts | None = None
    """Regroup a step's tail into a wider engine when the policy predicts it pays (`propose_tail`):
    what that costs and how fast each width decodes. None (the daemon): never, as no backend moves
    a running request's KV cache; the simulator sets it from the profile's `[resize.tail]`."""
