"""A truth check against verl's own published result (issue 24, item 4).

verl's dynamic-scaling README (verl/experimental/fully_async_policy/dynamic_schedule/README.md,
section 5, verl commit 1dda039) runs its `default` rule on Qwen3.5-35B-A3B / DAPO-Math-17k,
32 x H20: 16 training GPUs whose hybrid replicas help the rollout + 16 rollout GPUs, and
reports 17.5% less wall-clock time than the 16 + 16 static split and 15.3% less than 8 + 24.
This script simulates that setup (profile `qwen3.5-35b-a3b-h20x32`, built from public numbers;
the one fitted number makes the two static baselines' ratio the published one), runs the static
splits and `verl-default` (verl's defaults, `deactivate_ratio=0.6` as the README's run sets it),
and prints one JSON object with the simulated and published gains and their difference,
`verl_published_gain_error` (simulated minus published reduction of total time against 16 + 16,
in fractions of it). Also: the same against 8 + 24, our `hysteresis` policy on the setup, and
`tail_share_16_16`: the longest response decoding alone, as a share of the 16 + 16 rollout
(near 1: the step waits for one response, which no extra replica speeds up).

    python benchmarks/verl_published.py [--steps K] [--median N]

The response lengths are not published: a lognormal of median `--median` tokens (default 6000)
with p99 = 10 x median, clipped at the run's 64K maximum (the scan `median_scan` shows how the
check moves with it).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from dynaresized.core.policy import load_policy
from dynaresized.domain import Split
from dynaresized.sim.pipeline import DynamicPipeline, static_total
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import guards_for, scenario_shape, verl_guards
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import lognormal_trace

PROFILE = "qwen3.5-35b-a3b-h20x32"
PUBLISHED_GAIN_VS_16_16 = 0.175  # "~17.5% compared to the 16+16 baseline"
PUBLISHED_GAIN_VS_8_24 = 0.153  # "~15.3% compared to the 8+24 baseline"
README_DEACTIVATE_RATIO = 0.6  # async_training.dynamic_schedule_deactivate_ratio=0.6


def check(steps: int, median: float) -> dict:
    profile = load_profile(PROFILE)
    trace = lognormal_trace("verl-qwen35-dapo", scenario_shape(profile), median=median, steps=steps)
    model = StageModel(profile, trace)
    t16, t8 = static_total(model, Split(16, 16)), static_total(model, Split(8, 24))
    verl = DynamicPipeline(model, load_policy("verl-default", {"deactivate_ratio": README_DEACTIVATE_RATIO}),
                           guards=verl_guards(profile)).run()
    ours = DynamicPipeline(model, load_policy("hysteresis"), guards=guards_for(profile)).run()
    gain16, gain8 = 1.0 - verl.total_time_s / t16, 1.0 - verl.total_time_s / t8
    return {
        "median_response_tokens": median,
        "static_16_16_s": round(t16, 1),
        "static_8_24_s": round(t8, 1),
        "static_ratio_8_24_over_16_16": round(t8 / t16, 4),
        "published_static_ratio": round((1 - PUBLISHED_GAIN_VS_16_16) / (1 - PUBLISHED_GAIN_VS_8_24), 4),
        "tail_share_16_16": round(float((model.longest_request_s / model.rollout_table(16)).mean()), 4),
        "verl_dynamic_s": round(verl.total_time_s, 1),
        "verl_dynamic_windows_lent": sum(1 for w in verl.windows if w.lent),
        "simulated_gain_vs_16_16": round(gain16, 4),
        "published_gain_vs_16_16": PUBLISHED_GAIN_VS_16_16,
        "simulated_gain_vs_8_24": round(gain8, 4),
        "published_gain_vs_8_24": PUBLISHED_GAIN_VS_8_24,
        "verl_published_gain_error": round(gain16 - PUBLISHED_GAIN_VS_16_16, 4),
        "verl_published_gain_error_vs_8_24": round(gain8 - PUBLISHED_GAIN_VS_8_24, 4),
        "hysteresis_s": round(ours.total_time_s, 1),
        "hysteresis_speedup_vs_verl_dynamic": round(verl.total_time_s / ours.total_time_s, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--median", type=float, default=6000.0)
    args = parser.parse_args(argv)
    result = {"profile": PROFILE, "steps": args.steps, **check(args.steps, args.median)}
    result["median_scan"] = [
        {k: row[k] for k in ("median_response_tokens", "static_ratio_8_24_over_16_16", "tail_share_16_16",
                             "simulated_gain_vs_16_16", "verl_published_gain_error")}
        for row in (check(args.steps, m) for m in (2000.0, 4000.0, 12000.0))
    ]
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
