"""A lower bound on the total time of a run that no schedule of the simulator can beat.

The derivation is in docs/simulator.md ("Lower bound"); in short, for N devices:

* Rollout of step k on n devices takes at least `max(W_k / n, L_k)`: `W_k` is its work in
  device-seconds at full utilisation (every decode iteration runs a full batch, no engine
  waits for another; `StageModel.rollout_work`), `L_k` is the time of its longest request
  decoded alone (no placement splits one request), each over every engine size the profile
  allows (`rollout.tp_sizes`) that fits: the least work, and each request on its fastest
  engine (a wider engine decodes a lone request faster).
* Training of step k on n devices takes `T_k(n)` (the training model has no slack to remove:
  it is already work over devices times the data-parallel efficiency, plus fixed overhead).
* Disaggregated (static or dynamic, any policy, free and instant resizes): window w holds
  rollout w and training w-1 and cannot start before both predecessors end, so it lasts at
  least `min over splits (t + r = N) of max(R_w(r), T_{w-1}(t)) + sync`, each device in one
  pool for the window (pools only change at step boundaries).
* Colocated: step k lasts at least `max(W_k / N, L_k) + switch + T_k(N)`.

The bound is the smaller of the two sums, so it holds for every mode the simulator runs.
"""

from __future__ import annotations

import msgspec
import numpy as np

from dynaresized.sim.stages import StageModel


class LowerBound(msgspec.Struct, frozen=True):
    total_s: float
    disaggregated_s: float
    colocated_s: float


def longest_alone(models: list[StageModel]) -> np.ndarray:
    """Per step, its longest request decoded alone on the fastest of `models`' engines for it
    (the latency floor no placement on those engine sizes beats)."""
    if len(models) == 1:
        return models[0].longest_request_s
    tables = [m.alone_s() for m in models]
    return np.array([float(np.min([t[i] for t in tables], axis=0).max()) for i in range(models[0].steps)])


def rollout_floor(model: StageModel, devices: int) -> np.ndarray:
    """Per step, the least time any placement needs for the rollout on `devices` devices, on
    engines of any size the profile allows that fits in them (`StageModel.variants`)."""
    fits = [m for m in model.variants(devices) if m.engines(devices) >= 1]
    if not fits:
        return np.full(model.steps, np.inf)
    work = np.min([m.rollout_work_table() / (m.engines(devices) * m.profile.rollout.gpus_per_engine)
                   for m in fits], axis=0)
    return np.maximum(work, longest_alone(fits))


def lower_bound(model: StageModel, gpus: int) -> LowerBound:
    k = model.steps
    sync = model.weight_sync_s
    # Disaggregated: window 0 only generates, window k only trains; the training pool keeps
    # at least one device, so neither stage ever has all N.
    floors = np.stack([rollout_floor(model, gpus - t) for t in range(1, gpus)])  # [t-1, step]
    trains = np.stack([model.train_table(t) for t in range(1, gpus)])  # [t-1, step]
    windows = float(floors[0, 0])  # every split but the smallest training pool is slower
    if k > 1:
        # Window w (1..k-1): rollout w next to training w-1, best split per window.
        both = np.maximum(floors[:, 1:], trains[:, :-1])
        windows += float((both.min(axis=0) + sync).sum())
    windows += float(trains[-1, k - 1] + sync)
    colocated = float((rollout_floor(model, gpus) + model.colocated_switch_s + model.train_table(gpus)).sum())
    return LowerBound(total_s=min(windows, colocated), disaggregated_s=windows, colocated_s=colocated)



def fluid_windows(model: StageModel, gpus: int) -> np.ndarray:
    """Per window (K+1 of them), the least time any schedule needs, loans inside a step
    included: the window's device-work spread over all N devices at full utilisation, or its
    critical chain (the step's longest request decoded alone; the training step's fixed
    overhead), whichever is longer, plus the weight sync."""
    k = model.steps
    # Any engine size the cluster allows: the least device-work per step, and the longest
    # request decoded alone on the widest (fastest) engine for it.
    models = model.variants(gpus)
    work = np.min([m.rollout_work_table() for m in models], axis=0)
    longest = longest_alone(models)
    train = np.array([model.train_work(i) for i in range(k)])
    overhead = model.profile.training.step_overhead_s
    out = np.empty(k + 1)
    out[0] = max(work[0] / gpus, longest[0])
    if k > 1:
        out[1:k] = np.maximum((work[1:] + train[:-1]) / gpus,
                              np.maximum(longest[1:], overhead)) + model.weight_sync_s
    out[k] = max(train[k - 1] / gpus, overhead) + model.weight_sync_s
    return out


def fluid_bound(model: StageModel, gpus: int) -> float:
    """A time no schedule beats, loans inside a step included (docs/simulator.md, "Fluid
    bound"): the sum of `fluid_windows`. Windows follow one another (rollout w needs the
    weights of step w-2, training w needs rollout w), so no work moves across a boundary."""
    return float(fluid_windows(model, gpus).sum())
