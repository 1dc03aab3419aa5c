"""Simulator identity: `dynaresized simulate --json` on the six built-in scenarios (and three
variants: --gpus 64, --layout profile, and one that replans, so regroups), written to a
directory or compared with one written before, so that a refactoring of the core can show that
it changed no decision.

    python benchmarks/sim_identity.py --write /tmp/sim-baseline     # before the change
    python benchmarks/sim_identity.py --compare /tmp/sim-baseline   # after it

Without --write or --compare it runs each case twice and compares the two (the simulator is
seeded: the same case gives the same bytes). Prints one JSON object:
{"scenarios": 6, "identical": true, "differences": []}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import msgspec

from dynaresized.sim.workload import SCENARIOS

VARIANTS: dict[str, list[str]] = {
    "longtail-drift--gpus-64": ["--scenario", "longtail-drift", "--gpus", "64"],
    "longtail-drift--layout-profile": ["--scenario", "longtail-drift", "--layout", "profile"],
    # regroups (the rollout pool's engine size changes) happen only where the run replans
    "bimodal--replan-every-5": ["--scenario", "bimodal", "--layout", "profile", "--replan-every", "5"],
}
"""Runs beyond each scenario's defaults, by the name of their file."""


def cases() -> dict[str, list[str]]:
    """Every run, by the name of its output file (without .json): its arguments to simulate."""
    runs = {name: ["--scenario", name] for name in SCENARIOS}
    runs.update(VARIANTS)
    return runs


def simulate(args: list[str]) -> bytes:
    """One `dynaresized simulate --json` run in a fresh interpreter: its stdout."""
    command = [sys.executable, "-c", "import sys; from dynaresized.cli import main; sys.exit(main())"]
    done = subprocess.run([*command, "simulate", *args, "--json"], capture_output=True, check=True)
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="DIR", type=Path, help="write each run's JSON to DIR")
    mode.add_argument("--compare", metavar="DIR", type=Path, help="compare each run with DIR")
    args = parser.parse_args(argv)

    runs = cases()
    differences: list[str] = []
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
    for name, run_args in runs.items():
        output = simulate(run_args)
        if args.write is not None:
            (args.write / f"{name}.json").write_bytes(output)
            continue
        expected_file = None if args.compare is None else args.compare / f"{name}.json"
        if expected_file is not None and not expected_file.exists():
            differences.append(f"{name}: no {expected_file}")
            continue
        expected = simulate(run_args) if expected_file is None else expected_file.read_bytes()
        if output != expected:
            differences.append(name)

    result: dict[str, object] = {"scenarios": len(SCENARIOS), "runs": len(runs)}
    if args.write is not None:
        result["written"] = str(args.write)
    else:
        result["identical"] = not differences
        result["differences"] = differences
    print(msgspec.json.encode(result).decode())
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
