"""Our policy against verl's rule in verl's fully-async semantics (issue 44, item 1): every
(scenario, devices) row of `dynaresized simulate --pipeline fully-async --staleness S
--partial-rollout --sync-every K --json` on `qwen3-8b-h20x8`, with the fluid bound of that
pipeline, and one JSON object: the rows, and the worst `gap_to_fluid_bound` and
`speedup_vs_verl_dynamic` over them.

    python benchmarks/pipelines.py [--gpus 8,16,32,64] [--scenarios noisy,longtail-drift]
                                   [--staleness 0.5] [--sync-every 4] [--no-partial-rollout]
                                   [--steps K] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import msgspec

from dynaresized.domain import PipelineSpec
from dynaresized.sim.asyncrun import simulate_async
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.workload import scenario_trace

PROFILE = "qwen3-8b-h20x8"
KEYS = ("start", "best_static", "total_time_s", "loans", "speedup_vs_best_static", "speedup_vs_initial_split",
        "verl_dynamic_total_time_s", "verl_dynamic_loans", "speedup_vs_verl_dynamic", "fluid_bound_s",
        "gap_to_fluid_bound")


def row(job: tuple[str, int, PipelineSpec, int | None]) -> dict:
    scenario, gpus, spec, steps = job
    profile = load_profile(PROFILE).with_gpus(gpus)
    trace = scenario_trace(scenario, scenario_shape(profile), seed=0, steps=steps)
    report = msgspec.to_builtins(simulate_async(trace, profile, "hysteresis", spec))
    ledger = report["ledger"]
    return {"scenario": scenario, "gpus": gpus, **{k: report[k] for k in KEYS},
            "ledger_ok": ledger["generated_once"] and ledger["trained_once"] and ledger["never_future_weights"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="8,16,32,64")
    parser.add_argument("--scenarios", default="noisy,longtail-drift")
    parser.add_argument("--staleness", type=float, default=0.5)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--steps", type=int, default=None, help="first K steps of each scenario")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    spec = PipelineSpec(mode="fully-async", staleness=args.staleness, partial_rollout=args.partial_rollout,
                        sync_every=args.sync_every)
    jobs = [(s, int(g), spec, args.steps) for s in args.scenarios.split(",") for g in args.gpus.split(",")]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(row, jobs))
    else:
        rows = [row(j) for j in jobs]
    out = {"profile": PROFILE, "pipeline": spec.label(), "rows": rows,
           "gap_to_fluid_bound_max": max(r["gap_to_fluid_bound"] for r in rows),
           "speedup_vs_verl_dynamic_min": min(r["speedup_vs_verl_dynamic"] for r in rows),
           "ledger_ok": all(r["ledger_ok"] for r in rows)}
    sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
