"""Simulator speed: one 200-step trace with 8,192 samples per step, and the whole bench suite.

Prints one JSON object; asserts nothing (targets: <= 30 s and <= 180 s on a 2-core machine).
Run: python benchmarks/simulator.py
"""

from __future__ import annotations

import os
import platform
import time

import msgspec

from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import bench, scenario_shape, simulate
from dynaresized.sim.workload import scenario_trace


def main() -> None:
    profile = load_profile("qwen3-8b-h20x8")

    big = profile.with_samples(8192)
    start_big = time.perf_counter()
    trace = scenario_trace("longtail-drift", scenario_shape(big), seed=0, steps=200)
    generated = time.perf_counter()
    run = simulate(trace, big, "hysteresis", seed=0)
    big_s = time.perf_counter() - start_big

    start = time.perf_counter()
    rows = bench(profile)
    bench_s = time.perf_counter() - start

    result = {
        "benchmark": "simulator",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "big_trace": {
            "scenario": "longtail-drift",
            "profile": big.name,
            "steps": 200,
            "samples_per_step": 8192,
            "policy": "hysteresis",
            "trace_generation_s": round(generated - start_big, 3),
            "wall_s": round(big_s, 3),
            "target_s": 30.0,
            "simulated_total_time_s": run.report.total_time_s,
        },
        "bench_suite": {
            "rows": len(rows),
            "wall_s": round(bench_s, 3),
            "target_s": 180.0,
        },
    }
    print(msgspec.json.encode(result).decode())


if __name__ == "__main__":
    main()
