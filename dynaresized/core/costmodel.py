"""How long a step would take on another split: the one cost model the policies, the guards'
prediction check and the simulator's policy runs share (docs/simulator.md, "The cost model").

Fed with what the daemon measured over the last steps (`measure`):

* the rollout: `T` seconds on `n0` devices (those that served it, lent ones included), and its
  latency floor `F`: the longest response's tokens times the engines' measured seconds per
  token (`StepTiming.lengths`), the time no number of engines of this size can beat. On `n`
  devices the rollout takes

      R(n) = F + (T - F) * n0 / n

  the part above the floor spreading over the pool, the floor staying. It is what the
  request-level `StageModel` of the simulator gives for a pull-routed, long-tailed step: more
  engines shorten the queue, not the longest response (at 256 devices 192 -> 240 rollout
  devices: `R` 104.0 s, `StageModel` 104 s; the linear model 85 s).
* the training: `W` device-seconds (its measured pace, lent engines counted) over `n` devices.
* the weight sync, as measured.

Where no step of the window reported its lengths (an older worker), `F` is 0 and the model is
the linear one the policies used before (`Measure.model` says which; `status` shows it). Where
the job's pipeline lets a step's tail carry over into the next weight version (verl's
fully-async pipeline with partial rollout: `tail_binds`), no floor binds a step, and the model
is the linear one too, whatever the steps report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from dynaresized.domain import PipelineSpec, Split, StepTiming

FLOOR = "floor"
LINEAR = "linear"


class Measure(msgspec.Struct, frozen=True):
    """What the model predicts from: the mean of a window of measured steps."""

    rollout_s: float  # T
    rollout_devices: float  # n0: devices that served the rollout, on average over its time
    floor_s: float  # F: the latency floor (0: unknown, the linear model)
    train_device_s: float  # W: device-seconds of training work
    sync_s: float
    steps: int  # steps the means are over
    model: str = LINEAR  # FLOOR where the floor is measured, else LINEAR

    def rollout_on(self, devices: float) -> float:
        """Seconds of the rollout on `devices` devices (inf on none)."""
        if devices <= 0:
            return math.inf
        floor = min(self.floor_s, self.rollout_s)
        return floor + (self.rollout_s - floor) * self.rollout_devices / devices

    def train_on(self, devices: float) -> float:
        """Seconds of the training on `devices` devices (inf on none)."""
        if devices <= 0:
            return math.inf
        return self.train_device_s / devices

    def rollout_with_loans(self, devices: float, lent: float, from_s: float) -> float:
        """Seconds of the rollout on `devices` devices when `lent` more join it `from_s` seconds
        into the step (trainers lent once their training step is done) for as long as its queue
        holds requests: the part above the floor is device-seconds `A = (T - F) n0`, served by
        the home pool from the start and by the lent devices from `from_s` on; the floor stays."""
        alone = self.rollout_on(devices)
        floor = min(self.floor_s, self.rollout_s)
        above = alone - floor
        if lent <= 0 or from_s >= above or not math.isfinite(alone):
            return alone
        work = above * devices
        return floor + (work + lent * from_s) / (devices + lent)

    def step_on(self, split: Split, *, lend_after_s: float | None = None) -> float:
        """Seconds of a step of the one-step off-policy pipeline on `split`: max(rollout,
        training) + weight sync. With `lend_after_s`, the trainers are lent to the rollout once
        their training is done, the loan serving `lend_after_s` seconds later (its lead)."""
        if split.rollout <= 0 or split.train <= 0:
            return math.inf
        train = self.train_on(split.train)
        if lend_after_s is None:
            rollout = self.rollout_on(split.rollout)
        else:
            rollout = self.rollout_with_loans(split.rollout, split.train, train + lend_after_s)
        return max(rollout, train) + self.sync_s

    def in_flight_s(self, split: Split, target: Split) -> float:
        """Seconds a resize from `split` to `target` adds to the window it is in flight: its
        devices serve neither pool until it commits at the next boundary, so that window runs
        on the donor pool without them beside the receiver as it was (inf where the donor would
        be left with none). Loans are left out both ways."""
        during = Split(train=min(split.train, target.train), rollout=min(split.rollout, target.rollout))
        return max(self.step_on(during) - self.step_on(split), 0.0)

    def describe(self) -> str:
        if self.model == FLOOR:
            return (f"rollout {self.rollout_s:.1f}s on {self.rollout_devices:g} device(s), latency floor "
                    f"{min(self.floor_s, self.rollout_s):.1f}s")
        return f"rollout {self.rollout_s:.1f}s on {self.rollout_devices:g} device(s), linear (no response lengths)"


def floor_of(timing: StepTiming) -> float | None:
    """The latency floor a step reported (None: it reported no lengths or no per-token time)."""
    lengths = timing.lengths
    if lengths is None or lengths.token_s <= 0:
        return None
    return lengths.floor_s


def tail_binds(pipeline: PipelineSpec) -> bool:
    """Whether a step waits for its longest response: in every pipeline but one whose unfinished
    responses carry over into the next weight version (fully-async with partial rollout)."""
    return pipeline.windowed or not pipeline.partial_rollout


def measure(steps: Sequence[StepTiming], split: Split, *, floor: bool = True) -> Measure | None:
    """The model's inputs from `steps` (measured on `split`; a step that does not say how many
    devices served a stage is taken to have run on `split`'s pool): the mean of each figure, the
    floor the mean of those reported (`floor=False`: none, the job's tail does not bind a step,
    `tail_binds`). None for no step."""
    if not steps:
        return None
    n = len(steps)
    rollout = sum(t.rollout_s for t in steps) / n
    # devices weighted by the time they served, so that rollout_s * devices is the mean work
    work = sum(t.rollout_s * (t.rollout_devices_served or max(split.rollout, 1)) for t in steps) / n
    devices = work / rollout if rollout > 0 else float(max(split.rollout, 1))
    train = sum(t.train_s * (t.train_devices_served or max(split.train, 1)) for t in steps) / n
    sync = sum(t.weight_sync_s for t in steps) / n
    floors = [x for t in steps if (x := floor_of(t)) is not None] if floor else []
    if floors:
        return Measure(rollout_s=rollout, rollout_devices=devices, floor_s=sum(floors) / len(floors),
                       train_device_s=train, sync_s=sync, steps=n, model=FLOOR)
    return Measure(rollout_s=rollout, rollout_devices=devices, floor_s=0.0, train_device_s=train, sync_s=sync,
                   steps=n, model=LINEAR)


def predicted_step_s(steps: Sequence[StepTiming], split: Split, target: Split) -> float:
    """How long a step would take on `target`, from `steps` measured on `split` (inf: nothing
    measured). The one function the policies and the prediction check ask."""
    m = measure(steps, split)
    return math.inf if m is None else m.step_on(target)
