"""Issue 43's simulator targets for the default policy: every row `dynaresized simulate --json`
gives, and whether it meets its target. Prints one JSON object.

    python benchmarks/policy_targets.py                       # every row (256/1024 take minutes)
    python benchmarks/policy_targets.py --most 64             # rows of at most 64 devices
    python benchmarks/policy_targets.py --jobs 2              # two simulations at a time
    python benchmarks/policy_targets.py --table BEFORE.json AFTER.json   # a markdown before/after table

Rows (profile qwen3-8b-h20x8, default policy):

* `planned-8`: planned start (the default layout), 8 devices, the six built-in scenarios:
  `speedup_vs_best_static` at least the figure recorded before issue 43 (`BEFORE_8`), and
  at least 1.13 on `noisy`;
* `planned-N`: planned start, `--gpus` 16, 32, 64, 256, 1024 on longtail-stationary,
  longtail-drift and noisy: `speedup_vs_initial_split` >= 1.0 and `speedup_vs_best_static`
  >= 0.99 (>= 1.05 on noisy at 16 and 32);
* `profile-N`: `--layout profile` at 8, 16 and 64 devices on the same three scenarios:
  `speedup_vs_initial_split` >= 1.0 and `speedup_vs_best_static_tp1` >= 0.98.

The output: {"rows": [{"row", "scenario", "gpus", "layout", the speedups, "resizes", "loans",
"met", "misses"}], "met": N, "rows_total": M, "missed": [...]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SCENARIOS_8 = ("longtail-stationary", "longtail-drift", "shrinking", "bimodal", "noisy", "verl-dapo")
SCENARIOS_N = ("longtail-stationary", "longtail-drift", "noisy")
GPUS_PLANNED = (16, 32, 64, 256, 1024)
GPUS_PROFILE = (8, 16, 64)

BEFORE_8 = {"longtail-stationary": 1.0629, "longtail-drift": 1.0555, "shrinking": 1.078, "bimodal": 1.0595,
            "noisy": 1.1369, "verl-dapo": 1.0662}
"""`speedup_vs_best_static` of the default policy at 8 devices, planned start, before issue 43
(main at c3cd2ff, this script's first run)."""

FIELDS = ("speedup_vs_best_static", "speedup_vs_initial_split", "speedup_vs_best_static_tp1",
          "speedup_vs_verl_dynamic", "resizes", "loans", "total_time_s", "planned_start", "final_split")


def cases(most: int) -> list[dict]:
    out = []
    for s in SCENARIOS_8:
        out.append({"row": "planned-8", "scenario": s, "gpus": 8, "layout": "plan"})
    for g in GPUS_PLANNED:
        if g <= most:
            for s in SCENARIOS_N:
                out.append({"row": f"planned-{g}", "scenario": s, "gpus": g, "layout": "plan"})
    for g in GPUS_PROFILE:
        if g <= most:
            for s in SCENARIOS_N:
                out.append({"row": f"profile-{g}", "scenario": s, "gpus": g, "layout": "profile"})
    return out


def run(case: dict, extra: list[str]) -> dict:
    command = [sys.executable, "-c", "import sys; from dynaresized.cli import main; sys.exit(main())",
               "simulate", "--scenario", case["scenario"], "--gpus", str(case["gpus"]), "--layout", case["layout"],
               "--jobs", "1", "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {**case, "error": done.stderr.strip()[-400:]}
    report = json.loads(done.stdout)
    return {**case, **{k: report.get(k) for k in FIELDS}}


def misses(r: dict) -> list[str]:
    """The targets row `r` misses (an empty list: it meets every one)."""
    if "error" in r:
        return ["error"]
    out = []
    if r["row"] == "planned-8":
        before = BEFORE_8.get(r["scenario"])
        if before is not None and r["speedup_vs_best_static"] < before:
            out.append(f"speedup_vs_best_static {r['speedup_vs_best_static']} < {before} (before)")
        if r["scenario"] == "noisy" and r["speedup_vs_best_static"] < 1.13:
            out.append(f"speedup_vs_best_static {r['speedup_vs_best_static']} < 1.13")
    elif r["layout"] == "plan":
        if r["speedup_vs_initial_split"] < 1.0:
            out.append(f"speedup_vs_initial_split {r['speedup_vs_initial_split']} < 1.0")
        least = 1.05 if r["scenario"] == "noisy" and r["gpus"] in (16, 32) else 0.99
        if r["speedup_vs_best_static"] < least:
            out.append(f"speedup_vs_best_static {r['speedup_vs_best_static']} < {least}")
    else:
        if r["speedup_vs_initial_split"] < 1.0:
            out.append(f"speedup_vs_initial_split {r['speedup_vs_initial_split']} < 1.0")
        if r["speedup_vs_best_static_tp1"] < 0.98:
            out.append(f"speedup_vs_best_static_tp1 {r['speedup_vs_best_static_tp1']} < 0.98")
    return out


def targets(r: dict) -> list[tuple[str, float]]:
    """(metric, least value) of row `r`'s targets."""
    if r["row"] == "planned-8":
        least = BEFORE_8.get(r["scenario"]) or 0.0
        return [("speedup_vs_best_static", max(least, 1.13) if r["scenario"] == "noisy" else least)]
    if r["layout"] == "plan":
        return [("speedup_vs_initial_split", 1.0),
                ("speedup_vs_best_static", 1.05 if r["scenario"] == "noisy" and r["gpus"] in (16, 32) else 0.99)]
    return [("speedup_vs_initial_split", 1.0), ("speedup_vs_best_static_tp1", 0.98)]


def table(before: dict, after: dict) -> str:
    """A markdown table of every target metric of `after`'s rows beside `before`'s."""
    old = {(r["row"], r["scenario"]): r for r in before["rows"]}
    lines = ["| row | scenario | metric | before | after | target |", "|---|---|---|---|---|---|"]
    for r in after["rows"]:
        o = old.get((r["row"], r["scenario"]), {})
        for metric, least in targets(r):
            value = r.get(metric)
            miss = "" if value is not None and value >= least else " **missed**"
            lines.append(f"| {r['row']} | {r['scenario']} | {metric.removeprefix('speedup_')} | {o.get(metric, '')} "
                         f"| {value} | >= {least:g}{miss} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=1024, help="skip rows of more devices than this")
    parser.add_argument("--jobs", type=int, default=1, help="simulations at a time (default 1)")
    parser.add_argument("--only", default="", help="comma-separated row names (planned-8, planned-16, profile-8...)")
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every simulate run")
    parser.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print a markdown table of two outputs of this script, and run nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table[0]) as b, open(args.table[1]) as a:
            print(table(json.load(b), json.load(a)), end="")
        return 0
    if args.jobs < 1 or args.most < 1:
        parser.error("--jobs and --most must be >= 1")
    todo = cases(args.most)
    if args.only:
        wanted = set(args.only.split(","))
        todo = [c for c in todo if c["row"] in wanted]
    extra = [x for o in args.policy_option for x in ("--policy-option", o)]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: run(c, extra), todo))
    for r in rows:
        r["misses"] = misses(r)
        r["met"] = not r["misses"]
    missed = [f"{r['row']} {r['scenario']}: {'; '.join(r['misses'])}" for r in rows if r["misses"]]
    print(json.dumps({"rows": rows, "met": sum(r["met"] for r in rows), "rows_total": len(rows), "missed": missed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
