"""Our policy against verl's own rules, side by side in the simulator (issue 24, item 2).

For every built-in profile and scenario (seed 0): the best static configuration (split x engine
size, hindsight) and the best split of TP-1 engines, our
default policy (`hysteresis`, lending on), verl's `default` dynamic-scheduling rule
(`verl-default`) and verl v1's step switch (`verl-v1-switch`), all from the profile's initial
split on the same trace, devices and cost model; and, for reference, verl-default started from
the best split of TP-1 engines (a verl user who picked the split with hindsight).

    python benchmarks/verl_side_by_side.py [--profiles a,b] [--scenarios x,y] [--steps K]

Prints one JSON object: {"rows": [...]} with one row per (profile, scenario).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from dynaresized.core.policy import load_policy
from dynaresized.sim.pipeline import DynamicPipeline
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import baselines, scenario_shape, simulate, verl_baselines, verl_guards
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import SCENARIOS, scenario_trace


def row(profile_name: str, scenario: str, steps: int | None) -> dict:
    profile = load_profile(profile_name)
    trace = scenario_trace(scenario, scenario_shape(profile), seed=0, steps=steps)
    model = StageModel(profile, trace)
    base = baselines(model)
    verl = verl_baselines(model)
    ours = simulate(trace, profile, "hysteresis", seed=0, model=model, base=base, verl=verl).report
    best = base.best_split
    own = base.best_split_tp1 or best  # verl's rules run the profile's own engines: start them at its best split
    at_best = msgspec.structs.replace(profile, cluster=msgspec.structs.replace(profile.cluster, initial_train=own.train))
    from_best = DynamicPipeline(StageModel(at_best, trace), load_policy("verl-default"),
                                guards=verl_guards(at_best)).run().total_time_s
    return {
        "profile": profile_name,
        "scenario": scenario,
        "steps": model.steps,
        "initial_split": str(profile.initial_split),
        "best_static_split": str(best),
        "best_static_tp": base.best_tp,
        "best_static_s": round(base.best_static_s, 1),
        "best_static_tp1_split": str(own),
        "best_static_tp1_s": round(base.best_static_tp1_s or base.best_static_s, 1),
        "ours_s": ours.total_time_s,
        "ours_resizes": ours.resizes,
        "ours_loans": ours.loans,
        "verl_dynamic_s": ours.verl_dynamic_same_start_total_time_s,
        "verl_v1_switch_s": ours.verl_v1_switch_total_time_s,
        "verl_dynamic_loans": sum(1 for _ in verl.runs["verl-default"].windows if _.lent),
        "verl_dynamic_from_best_static_s": round(from_best, 1),
        "speedup_vs_best_static": ours.speedup_vs_best_static,
        "speedup_vs_best_static_tp1": ours.speedup_vs_best_static_tp1,
        "speedup_vs_verl_dynamic": ours.speedup_vs_verl_dynamic_same_start,
        "speedup_vs_verl_v1_switch": ours.speedup_vs_verl_v1_switch,
        "speedup_vs_verl_dynamic_from_best_static": round(from_best / ours.total_time_s, 4),
        "verl_dynamic_vs_best_static": round(base.best_static_s / ours.verl_dynamic_same_start_total_time_s, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="qwen3-8b-h20x8,qwen2.5-7b-h20")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    rows = [row(p, s, args.steps) for p in args.profiles.split(",") for s in args.scenarios.split(",")]
    sys.stdout.write(msgspec.json.encode({"rows": rows}).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
