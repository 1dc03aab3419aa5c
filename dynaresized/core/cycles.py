"""A verl cycle as the step report the daemon reads: verl's fully-async trainer and its V1
trainer report one `StepTiming` per parameter-sync cycle, and the simulator's fully-async
pipeline (`sim/asyncpipe.py`) reports the same, so the policy predicts from what a real verl job
says (pure: no clock, no IO)."""

from __future__ import annotations

from dynaresized.domain import StepTiming


def cycle_timing(step: int, standalone: int, hybrid: int, *, period_s: float, train_s: float, lent_s: float,
                 required: int, generated: int, waited: bool, weight_sync_s: float, queued: int = 0,
                 home_at: int | None = None) -> StepTiming:
    """One cycle of verl's (from the last decision to this one) as a StepTiming: the trainer's
    own time on its `hybrid` GPUs, and the rollout's on its `standalone` ones, with the
    device-seconds the hybrid replicas served it while active (`lent_s` each). The rollout's time
    for a step's `required` samples is the cycle's at the rate it `generated` them; a trainer that
    never `waited` for samples says the rollout kept up, so it took no longer than the training.
    `queued`: samples of the next step already queued; `home_at`: the queued samples at which
    verl will deactivate hybrid replicas activated now (None: not known), both over the step's
    `required` samples."""
    period_s = max(period_s, 1e-6)
    rollout_s = period_s * max(required, 1) / generated if generated else period_s
    if not waited:
        rollout_s = min(rollout_s, train_s)
    served = standalone * period_s + hybrid * lent_s  # device-seconds generating
    return StepTiming(step=step, rollout_s=rollout_s, train_s=train_s, weight_sync_s=weight_sync_s,
                      rollout_devices=standalone, train_devices=hybrid, samples=generated,
                      rollout_device_s=served * rollout_s / period_s, train_device_s=train_s * hybrid,
                      loan_home_share=None if home_at is None else min(max(home_at, 0) / max(required, 1), 1.0),
                      next_done_share=min(max(queued, 0) / max(required, 1), 1.0))
