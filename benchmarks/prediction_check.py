"""The daemon's prediction check on the demo (issue 43): `dynaresized demo --json` run `--runs`
times (default 3, one after another: the demo's devices run in accelerated wall-clock time, so
its figures vary a little with the machine's load), and the mean absolute error of its resizes'
and loans' predictions (`PredictionChecked`, `LoanChecked`), the median over the runs and every
run. Prints one JSON object:

    python benchmarks/prediction_check.py [--runs N] [--steps K]

{"runs": N, "prediction_mae_s": {"resize": median, "loan": median},
 "prediction_relative_error": {"resize": median, "loan": median},
 "speedup_vs_best_static": median, "per_run": [{each run's figures}]}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

KEYS = ("prediction_mae_s", "prediction_relative_error", "predictions_checked")


def demo(steps: int) -> dict:
    """One `dynaresized demo --json` run: the figures this benchmark reports."""
    done = subprocess.run([sys.executable, "-m", "dynaresized.cli", "demo", "--json", "--steps", str(steps)],
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: out[k] for k in (*KEYS, "speedup_vs_best_static", "loans", "resizes")}


def median_of(runs: list[dict], key: str) -> dict[str, float | None]:
    """The median of `key`'s resize and loan figures over the runs that have one."""
    out: dict[str, float | None] = {}
    for kind in ("resize", "loan"):
        values = [r[key][kind] for r in runs if r[key][kind] is not None]
        out[kind] = round(statistics.median(values), 4) if values else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="steps of each demo run (the demo's default)")
    args = parser.parse_args(argv)
    runs = [demo(args.steps) for _ in range(args.runs)]
    print(json.dumps({
        "runs": len(runs),
        "prediction_mae_s": median_of(runs, "prediction_mae_s"),
        "prediction_relative_error": median_of(runs, "prediction_relative_error"),
        "speedup_vs_best_static": round(statistics.median(r["speedup_vs_best_static"] for r in runs), 4),
        "per_run": runs,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
