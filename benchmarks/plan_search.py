"""ReaL's plan search on the simulator (issue 22, item 3): the plan of every built-in scenario,
and the search at 1,024 devices.

Prints one JSON object; asserts nothing. Keys:
* `scenarios`: per built-in scenario on `qwen3-8b-h20x8`, the plan (`dynaresized plan
  --scenario S`): its phases' configurations, `predicted_total_s` (each phase predicted from
  its first 10 steps) against `simulated_total_s`, `prediction_error`, `search_s`, and the plan's
  simulated total against the best static configuration (`plan_vs_best_static`: above 1 the
  plan's uncharged changes of configuration pay);
* `max_abs_prediction_error` (target <= 0.05);
* `search_1024`: one search of a 10-step pilot at 1,024 devices (engine sizes 1, 2, 4, 8: 1,916
  configurations), by the exact branch and bound and by MCMC, at 1,024 and 16,384 samples per
  step: `search_s`, configurations simulated, the best found; `search_s_1024` is the default
  search's (MCMC) at 16,384 samples (target <= 10);
* `mcmc_agreement`: over `--seeds` traces of each built-in scenario at 256 devices and 4,096
  samples, how often MCMC's best is the bound's (exact) best, and its worst excess time.

Run: python benchmarks/plan_search.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import msgspec

from dynaresized.sim.pipeline import best_static_config
from dynaresized.sim.plan import plan, search
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import DYNAMIC_SCENARIOS, scenario_trace

PROFILE = "qwen3-8b-h20x8"
SCENARIOS = (*DYNAMIC_SCENARIOS, "verl-dapo")


def scenario_plans() -> dict[str, dict]:
    profile = load_profile(PROFILE)
    out = {}
    for name in SCENARIOS:
        trace = scenario_trace(name, scenario_shape(profile), seed=0)
        p = plan(profile, trace)
        best, _ = best_static_config(StageModel(profile, trace), profile.cluster.gpus)
        out[name] = {
            "phases": len(p.phases),
            "configs": [f"{ph.start}: {ph.config}" for ph in p.phases],
            "changes": p.changes,
            "predicted_total_s": p.predicted_total_s,
            "simulated_total_s": p.simulated_total_s,
            "prediction_error": p.prediction_error,
            "search_s": p.search_s,
            "best_static": f"{best.split}/TP-{best.tp}",
            "best_static_s": round(best.total_s, 1),
            "plan_vs_best_static": round(best.total_s / p.simulated_total_s, 4),
        }
    return out


def pilot(gpus: int, samples: int, scenario: str = "longtail-stationary", seed: int = 0) -> StageModel:
    profile = load_profile(PROFILE).with_gpus(gpus).with_samples(samples)
    return StageModel(profile, scenario_trace(scenario, scenario_shape(profile), seed=seed, steps=10))


def search_1024() -> dict[str, dict]:
    out = {}
    for samples in (1024, 16384):
        row = {}
        for method in ("bound", "mcmc"):
            s = search(pilot(1024, samples), 1024, method=method)  # a fresh model: no tables cached
            row[method] = {"search_s": round(s.search_s, 2), "simulated": s.simulated, "space": s.space,
                           "best": str(s.best), "best_s": round(s.predicted_s, 1)}
        row["mcmc_found_best"] = row["mcmc"]["best"] == row["bound"]["best"]
        out[f"samples_{samples}"] = row
    return out


def mcmc_agreement(seeds: int) -> dict[str, object]:
    same, worst, runs = 0, 0.0, 0
    t_bound = t_mcmc = 0.0
    for name in SCENARIOS:
        for seed in range(seeds):
            exact = search(pilot(256, 4096, name, seed), 256, method="bound")
            chain = search(pilot(256, 4096, name, seed), 256, method="mcmc", seed=seed)
            runs += 1
            same += chain.best == exact.best
            worst = max(worst, chain.predicted_s / exact.predicted_s - 1.0)
            t_bound += exact.search_s
            t_mcmc += chain.search_s
    return {"searches": runs, "same_best": same, "worst_excess": round(worst, 4),
            "bound_search_s_mean": round(t_bound / runs, 3), "mcmc_search_s_mean": round(t_mcmc / runs, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="traces per scenario in mcmc_agreement")
    args = parser.parse_args()
    t0 = time.perf_counter()
    plans = scenario_plans()
    big = search_1024()
    result = {
        "benchmark": "plan_search",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "profile": PROFILE,
        "scenarios": plans,
        "max_abs_prediction_error": max(abs(p["prediction_error"]) for p in plans.values()),
        "search_1024": big,
        "search_s_1024": big["samples_16384"]["mcmc"]["search_s"],
        "mcmc_agreement": mcmc_agreement(args.seeds),
        "targets": {"max_abs_prediction_error": "<= 0.05", "search_s_1024": "<= 10"},
        "wall_s": 0.0,
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(msgspec.json.encode(result).decode())


if __name__ == "__main__":
    main()
