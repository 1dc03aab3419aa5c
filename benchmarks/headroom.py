"""How much can dynamic resizing gain over the best static split? Headroom, measured three ways.

1. On every built-in scenario, with the simulator's own model: the hindsight-best static split
   against the per-step oracle (best split every step, free and instant resizes) and against
   the lower bound (no schedule beats it). Also the swing of the rollout:training work ratio
   over the run (95th / 5th percentile of the per-step ratio), which is what moves the best
   split.
2. Two traces with abrupt phases of response length, on the same profile: a context-lengthening
   curriculum (cap 4K -> 8K -> 16K tokens, median 1.2K -> 2.5K -> 5K) and a switch from short
   answers (median 250) to long reasoning (median 5K) halfway through. And a trace with DAPO's
   dynamic sampling, where the share of generated samples that are trained falls as accuracy
   rises (`"trained": false` marks the dropped ones).
3. An idealised pipeline where both stages are perfectly parallel (stage time = work /
   devices) and the rollout:training work ratio drifts geometrically by a factor `swing` over
   the run: the best static split against the per-step oracle, on 8 devices (whole devices)
   and with fractional splits. This says how large a swing a workload needs before any
   policy can be 1.3x faster than the best static split.

Prints one JSON object; asserts nothing. Run: python benchmarks/headroom.py
"""

from __future__ import annotations

import msgspec
import numpy as np

from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import baselines, scenario_shape, tp1_static_s
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import DYNAMIC_SCENARIOS, TAIL_SIGMA, StepBatch, Trace, scenario_trace

PROFILE = "qwen3-8b-h20x8"
SWINGS = (1, 2, 3, 4, 6, 9, 12, 16, 25)
STEPS = 200
GEN_PROMPTS = 32  # prompts per generation batch in the dynamic-sampling trace


# (steps, median response, log-sigma, max response) per phase
PHASES = {
    "context-lengthening": ((70, 1200.0, 0.6, 4096), (70, 2500.0, 0.8, 8192), (60, 5000.0, 0.9, 16384)),
    "short-then-reasoning": ((100, 250.0, 0.5, 16384), (100, 5000.0, 0.5, 16384)),
}


def phased_trace(name: str, phases: tuple[tuple[int, float, float, int], ...]) -> Trace:
    rng = np.random.default_rng(0)
    steps: list[StepBatch] = []
    for count, median, sigma, cap in phases:
        for _ in range(count):
            prompt = np.maximum(rng.lognormal(np.log(180.0), 0.45, 128).repeat(8), 8.0)
            response = np.clip(np.exp(np.log(median) + rng.normal(0.0, sigma, 1024)), 1.0, cap)
            steps.append(StepBatch(len(steps), np.rint(prompt).astype(np.int64), np.rint(response).astype(np.int64)))
    return Trace(name, tuple(steps))


def dynamic_sampling_trace() -> Trace:
    """DAPO-style dynamic sampling on top of longtail-drift's length growth: groups of 8 whose
    rewards are all equal are dropped, and the engines generate batches of 32 prompts until
    128 groups are kept (a fine-grained refill, so the generated share follows the filter).
    Mean accuracy rises 0.3 -> 0.8 (per-prompt pass rate ~ Beta), so more groups are
    all-correct and more samples are generated per trained one."""
    rng = np.random.default_rng(0)
    steps: list[StepBatch] = []
    for k in range(STEPS):
        frac = k / (STEPS - 1)
        accuracy, median = 0.3 + 0.5 * frac, 600.0 * 6.0 ** frac
        prompts: list[np.ndarray] = []
        responses: list[np.ndarray] = []
        trained: list[np.ndarray] = []
        kept = 0
        while kept < 128:
            pass_rate = rng.beta(accuracy * 2.0, (1.0 - accuracy) * 2.0, GEN_PROMPTS)
            correct = (rng.random((GEN_PROMPTS, 8)) < pass_rate[:, None]).sum(axis=1)
            mixed = (correct > 0) & (correct < 8)
            use = mixed & (np.cumsum(mixed) + kept <= 128)
            kept += int(use.sum())
            per_prompt = rng.normal(0.0, TAIL_SIGMA * 0.6, GEN_PROMPTS)[:, None]
            lengths = np.exp(np.log(median) + per_prompt + rng.normal(0.0, TAIL_SIGMA * 0.8, (GEN_PROMPTS, 8)))
            prompts.append(np.maximum(rng.lognormal(np.log(180.0), 0.45, GEN_PROMPTS), 8.0).repeat(8))
            responses.append(np.clip(lengths, 1.0, 16384).ravel())
            trained.append(use.repeat(8))
        steps.append(StepBatch(k, np.rint(np.concatenate(prompts)).astype(np.int64),
                               np.rint(np.concatenate(responses)).astype(np.int64), np.concatenate(trained)))
    return Trace("dynamic-sampling", tuple(steps))


def scenario_headroom(name: str) -> dict:
    profile = load_profile(PROFILE)
    if name in PHASES:
        trace = phased_trace(name, PHASES[name])
    elif name == "dynamic-sampling":
        trace = dynamic_sampling_trace()
    else:
        trace = scenario_trace(name, scenario_shape(profile), seed=0)
    model = StageModel(profile, trace)
    base = baselines(model)
    ratio = np.array([model.rollout_work(k) for k in range(model.steps)]) / model.train_table(1)
    p5, p95 = np.percentile(ratio, [5, 95])
    return {
        "scenario": name,
        "best_static": str(base.best_split),
        "best_static_tp": base.best_tp,
        "generated_per_trained_sample": [round(float(model.samples[k] / max(model.trained_samples[k], 1)), 2)
                                         for k in (0, model.steps // 2, model.steps - 1)],
        # the per-step oracle moves devices between splits of TP-1 engines: its headroom is over the TP-1 split
        "headroom_vs_best_static": round(tp1_static_s(base) / base.oracle_s, 4),
        "bound_vs_best_static": round(base.best_static_s / base.lower_bound_s, 4),
        "work_ratio_swing_p95_p5": round(float(p95 / p5), 3),
    }


def ideal_headroom(swing: float, devices: int = 8) -> dict:
    # Training work 1 per step, rollout work drifting from 1/sqrt(swing) to sqrt(swing).
    rho = np.geomspace(1 / np.sqrt(swing), np.sqrt(swing), STEPS)
    splits = np.arange(1, devices)  # rollout devices
    per = np.maximum(1.0 / (devices - splits)[:, None], rho[None, :] / splits[:, None])  # [split, step]
    whole = per.sum(axis=1).min() / per.min(axis=0).sum()
    frac = np.linspace(0.01, 0.99, 981)
    per_f = np.maximum(1.0 / (1 - frac)[:, None], rho[None, :] / frac[:, None])
    fractional = per_f.sum(axis=1).min() / (1.0 + rho).sum()
    return {"swing": swing, "headroom_whole_devices": round(float(whole), 4),
            "headroom_fractional": round(float(fractional), 4)}


def main() -> None:
    result = {
        "benchmark": "headroom",
        "profile": PROFILE,
        "scenarios": [scenario_headroom(name) for name in (*DYNAMIC_SCENARIOS, *PHASES, "dynamic-sampling")],
        "ideal_drift": [ideal_headroom(s) for s in SWINGS],
    }
    print(msgspec.json.encode(result).decode())


if __name__ == "__main__":
    main()
