"""Idle accounting: how much of each RL step each pool, and each device, spent waiting.

Pure functions of the step timings workers report (`StepTiming`) and of where the devices
were; docs/idle.md gives the definition an operator reads. In short, for one step with
rollout time r, training time t and weight sync s (one-step off-policy pipeline):

    period          = max(r, t) + s
    busy(pool)      = stage(pool) + s           (weight sync occupies both pools)
    idle(pool)      = period - busy(pool)       = max(r, t) - stage(pool)
    idle ratio      = idle(pool) / period       (the same for every device in the pool)

A stage reported as 0 s was not measured (a trainer-only worker sends no rollout time), and
`period` needs both stages, so such a step has no figure at all: it is counted as unknown,
never as 0 % idle. Time outside the reported stages (data loading, a resize's stall) and idle
time *inside* a stage (an engine that ran dry before the stage's last sample) are not seen,
so the idle figures are a lower bound.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from dynaresized.domain import DeviceId, Placement, Pool, StepTiming


def step_period_s(timing: StepTiming) -> float | None:
    """The step's pipeline period, max(rollout, training) + weight sync; None when a stage
    was not measured. Policies predict this same figure (`policy.predicted_step_s`)."""
    if timing.rollout_s <= 0 or timing.train_s <= 0:
        return None
    return max(timing.rollout_s, timing.train_s) + timing.weight_sync_s


class PoolIdle(msgspec.Struct, frozen=True):
    """One pool's share of one step, in device-seconds."""

    devices: int
    busy_s: float
    idle_s: float

    @property
    def ratio(self) -> float:
        return self.idle_s / (self.busy_s + self.idle_s)


class StepIdle(msgspec.Struct, frozen=True):
    """Idle figures of one step; a pool is None where the inputs cannot support a figure."""

    step: int
    period_s: float | None
    rollout: PoolIdle | None
    training: PoolIdle | None

    def pool(self, pool: Pool) -> PoolIdle | None:
        return self.rollout if pool is Pool.ROLLOUT else self.training


def step_idle(timing: StepTiming, *, rollout_devices: int, train_devices: int) -> StepIdle:
    """Idle figures of one step run with these pool sizes (devices placed in each pool)."""
    period = step_period_s(timing)
    if period is None or period <= 0:
        return StepIdle(step=timing.step, period_s=None, rollout=None, training=None)

    def share(stage_s: float, devices: int) -> PoolIdle | None:
        if devices <= 0:
            return None
        busy = stage_s + timing.weight_sync_s
        return PoolIdle(devices=devices, busy_s=busy * devices, idle_s=(period - busy) * devices)

    return StepIdle(step=timing.step, period_s=period, rollout=share(timing.rollout_s, rollout_devices),
                    training=share(timing.train_s, train_devices))


def idle_ratio(timing: StepTiming, pool: Pool) -> float | None:
    """The share of the step's period that `pool` (each of its devices) spent idle; None
    when the step has no figure. Needs no pool size: every device of a pool shares it."""
    share = step_idle(timing, rollout_devices=1, train_devices=1).pool(pool)
    return None if share is None else share.ratio


class IdleTotals(msgspec.Struct, frozen=True, array_like=True):
    """Busy and idle seconds summed over the steps that had a figure, and how many did not."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    steps: int = 0
    unknown_steps: int = 0

    @property
    def ratio(self) -> float | None:
        """Idle share of the accounted time; None ("unknown") when no step had a figure."""
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else None

    def summary(self) -> dict[str, float | int | None]:
        """Plain data for status output; `ratio` None means unknown."""
        return {"busy_s": self.busy_s, "idle_s": self.idle_s, "ratio": self.ratio, "steps": self.steps,
                "unknown_steps": self.unknown_steps}

    def plus(self, busy_s: float, idle_s: float) -> IdleTotals:
        return IdleTotals(self.busy_s + busy_s, self.idle_s + idle_s, self.steps + 1, self.unknown_steps)

    def plus_unknown(self) -> IdleTotals:
        return IdleTotals(self.busy_s, self.idle_s, self.steps, self.unknown_steps + 1)


class IdleLedger(msgspec.Struct, frozen=True):
    """Running idle totals per pool (device-seconds) and per device (seconds), and the last step."""

    pools: dict[Pool, IdleTotals] = {}
    devices: dict[DeviceId, IdleTotals] = {}
    last: StepIdle | None = None

    def pool(self, pool: Pool) -> IdleTotals:
        return self.pools.get(pool, IdleTotals())

    def add(self, timing: StepTiming, placements: Mapping[DeviceId, Placement]) -> IdleLedger:
        """Account one step to the devices where they are placed when it is observed. A device
        moving between pools belongs to neither and gets an unknown step."""
        counts = {p: sum(1 for x in placements.values() if x.pool is p) for p in Pool}
        figures = step_idle(timing, rollout_devices=counts[Pool.ROLLOUT], train_devices=counts[Pool.TRAINING])
        pools = dict(self.pools)
        for p in Pool:
            share, old = figures.pool(p), pools.get(p, IdleTotals())
            pools[p] = old.plus_unknown() if share is None else old.plus(share.busy_s, share.idle_s)
        devices = dict(self.devices)
        for d, placement in placements.items():
            old = devices.get(d, IdleTotals())
            share = figures.pool(placement.pool) if placement.pool is not None else None
            devices[d] = (old.plus_unknown() if share is None
                          else old.plus(share.busy_s / share.devices, share.idle_s / share.devices))
        return IdleLedger(pools=pools, devices=devices, last=figures)


def percent(ratio: float | None) -> str:
    """An idle ratio for people: "37.5%", or "unknown" (never "0%") when there is no figure."""
    return "unknown" if ratio is None else f"{ratio:.1%}"
