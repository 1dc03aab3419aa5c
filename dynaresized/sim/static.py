"""The static and colocated modes in virtual time, and the hindsight searches over them: a fixed
split's windows, the colocated mode's steps, the best fixed split and engine size, the per-step
oracle, and the floors that make those searches exact without simulating every split."""

from __future__ import annotations

import msgspec
import numpy as np

from dynaresized.domain import Split
from dynaresized.sim.stages import StageModel


def static_windows(model: StageModel, split: Split) -> np.ndarray:
    """Durations of the K+1 windows of a fixed split."""
    return _windows(model, model.rollout_table(split.rollout), model.train_table(split.train))


def _windows(model: StageModel, rollout: np.ndarray, train: np.ndarray) -> np.ndarray:
    """The K+1 windows of the one-step-off pipeline from per-step rollout and training seconds:
    the first rollout alone, then each rollout beside the previous step's training, then the
    last training, each after the first with a weight sync."""
    k = model.steps
    sync = model.weight_sync_s
    out = np.empty(k + 1)
    out[0] = rollout[0]
    if k > 1:
        out[1:k] = np.maximum(rollout[1:], train[:-1]) + sync
    out[k] = train[k - 1] + sync
    return out


def static_total(model: StageModel, split: Split) -> float:
    return float(static_windows(model, split).sum())


def splits_of(model: StageModel, gpus: int) -> list[Split]:
    """Every split of `gpus` devices whose rollout pool holds at least one engine."""
    return [Split(train=t, rollout=gpus - t) for t in range(1, gpus) if model.engines(gpus - t) >= 1]


def best_static(model: StageModel, gpus: int) -> tuple[Split, float]:
    """The fixed split with the least total time (hindsight), the smallest training pool among
    equals. Exact without simulating every split: splits are simulated in increasing order of
    `static_floor` (a total no run of the split beats) until the floor exceeds the best total
    found, so on a cluster of hundreds of devices a few dozen are (docs/simulator.md)."""
    splits = splits_of(model, gpus)
    if not splits:
        raise ValueError(f"no split of {gpus} devices leaves room for one rollout engine")
    best: tuple[float, int] | None = None
    for floor, train in sorted((static_floor(model, s), s.train) for s in splits):
        if best is not None and floor > best[0]:
            break
        total = static_total(model, Split(train, gpus - train))
        if best is None or (total, train) < best:
            best = (total, train)
    assert best is not None
    return Split(best[1], gpus - best[1]), best[0]


def oracle_total(model: StageModel, gpus: int) -> float:
    """The per-step oracle: every window on its own best split (hindsight, free resizes), the
    sum over windows of the least window time over splits. Exact without simulating every
    split: a split is simulated only where its window floors (`static_floor_windows`) are
    below the best window times found so far somewhere, lowest total floor first."""
    splits = splits_of(model, gpus)
    floors = [(static_floor_windows(model, s), s) for s in splits]
    floors.sort(key=lambda fs: (float(fs[0].sum()), fs[1].train))
    best = np.full(model.steps + 1, np.inf)
    for floor, split in floors:
        if bool(np.all(floor >= best)):
            continue
        best = np.minimum(best, static_windows(model, split))
    return float(best.sum())


def static_floor_windows(model: StageModel, split: Split) -> np.ndarray:
    """Per window, a time no run of `split` on `model`'s engines beats: `static_windows` with
    each step's rollout at its floor (its work over the devices, and at least its longest
    request decoded alone); training is exact already."""
    return _windows(model, _own_floor(model, split.rollout), model.train_table(split.train))


def static_floor(model: StageModel, split: Split) -> float:
    """A total no run of `split` on `model`'s engines beats: what the static searches prune
    with before simulating a split."""
    return float(static_floor_windows(model, split).sum())


def _own_floor(model: StageModel, devices: int) -> np.ndarray:
    """Per step, the least rollout seconds on `devices` devices of this model's engine size."""
    engines = model.engines(devices)
    if engines < 1:
        return np.full(model.steps, np.inf)
    return np.maximum(model.rollout_work_table() / (engines * model.profile.rollout.gpus_per_engine),
                      model.longest_request_s)


class StaticConfig(msgspec.Struct, frozen=True):
    """A fixed configuration: the split and the devices of each rollout engine."""

    split: Split
    tp: int
    total_s: float


def best_static_config(model: StageModel, gpus: int) -> tuple[StaticConfig, StaticConfig]:
    """The best fixed (split x engine size) with hindsight, and the best split on the profile's
    own engine size (`best_static`). Engine sizes come from `RolloutSpec.engine_sizes`, each
    only where it divides the rollout pool. Every split of the profile's own size is simulated;
    another size's split is simulated only while its `static_floor` is below the best total so
    far (in increasing order of floor), so the search is exact and simulates few of them."""
    split, total = best_static(model, gpus)
    own = StaticConfig(split, model.profile.rollout.gpus_per_engine, total)
    best = own
    pending: list[tuple[float, int, int]] = []
    for m in model.variants(gpus - 1):
        k = m.profile.rollout.gpus_per_engine
        if m is model:
            continue
        for rollout in range(k, gpus, k):
            pending.append((static_floor(m, Split(gpus - rollout, rollout)), k, rollout))
    for floor, k, rollout in sorted(pending):
        if floor >= best.total_s:
            break
        candidate = Split(gpus - rollout, rollout)
        total = static_total(model.at_tp(k), candidate)
        if total < best.total_s:
            best = StaticConfig(candidate, k, total)
    return best, own


def colocated_steps(model: StageModel, gpus: int) -> np.ndarray:
    """Per-step seconds of the colocated (verl default) mode: generate, switch, train."""
    return model.rollout_table(gpus) + model.colocated_switch_s + model.train_table(gpus)


def colocated_total(model: StageModel, gpus: int) -> float:
    return float(colocated_steps(model, gpus).sum())
