"""How well the daemon predicts what a loan to verl saves: the verl integration's test job
(tests/integrations/verl_job.py: verl's real DynamicResourceController and our policy in a Ray
actor, the GPU-bound rollouter faked) against a real daemon, as
tests/integrations/test_verl.py::test_daemon_lends_hybrid_replicas_between_steps_and_verl_keeps_its_contract
runs it, `--runs` times, each with a fresh daemon.

For each loan that landed: the daemon's predicted saving (`LoanStarted.saves_s`) and the
measured one (how much less the trainer waited for its next batch than with the standalone
replicas alone; the fake rollouter knows both). `loan_saving_predicted_over_measured` is the
mean predicted over the mean measured saving, over every run's loans (`per_run` has each run's);
`..._within_phase` leaves out the loans whose next step runs another phase (the loan at the switch
from the rollout-bound to the training-bound phase: a 15x faster rollout no model of the past
foresees).
Timing-based on a shared machine: read the spread over runs. Asserts nothing.

    python benchmarks/verl_job.py [--runs 3]

Needs the verl environment (`make setup-test`: .venv-verl, or $DYNARESIZED_VERL_PYTHON).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test job's helpers (tests/integrations/verl_run.py)

from tests.daemon.conftest import configured_daemon, read_facts  # noqa: E402
from tests.integrations.verl_run import (  # noqa: E402
    LAYOUT,
    LENDING_PHASES,
    LENDING_SEED,
    VERL_PYTHON,
    lending_job,
    loans,
    predicted_over_measured,
    prediction_errors,
    verl_sections,
)


def one_run(directory: Path) -> dict[str, Any]:
    """The lending job against a fresh daemon in `directory`: its loans, predicted and measured."""
    sections = verl_sections()
    daemon = configured_daemon(directory, **sections)
    daemon.start()
    try:
        job = lending_job(directory, daemon.worker_endpoint)
    finally:
        daemon.stop()
    steps, facts = job.steps(), read_facts(daemon.state_dir)
    errors = prediction_errors(facts, steps)
    steady = prediction_errors(facts, steps, within_phase=True)
    lent = [s for s in steps if s["lent"]]
    return {
        "loans_started": len(loans(facts)),
        "loans_landed": len(lent),
        "loans": [{"after_step": s["step"], "phase": s["phase"], "predicted_s": round(p, 3), "measured_s": round(m, 3),
                   "reason": loan.reason}
                  for s, loan, (p, m) in zip(lent, loans(facts), errors, strict=False)],
        "loan_saving_predicted_over_measured": round(predicted_over_measured(errors), 3) if errors else None,
        "within_phase": [(round(p, 3), round(m, 3)) for p, m in steady],
        "steps": [{k: s[k] for k in ("step", "phase", "lent", "wait", "wait_alone", "train")} for s in steps],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if not VERL_PYTHON.exists():
        print(f"needs the verl environment at {VERL_PYTHON} (`make setup-test` creates it)", file=sys.stderr)
        return 2
    runs = []
    for k in range(args.runs):
        with tempfile.TemporaryDirectory(prefix=f"verl-job-{k}-") as tmp:
            runs.append(one_run(Path(tmp)))
    pairs = [(x["predicted_s"], x["measured_s"]) for r in runs for x in r["loans"]]
    steady = [tuple(x) for r in runs for x in r["within_phase"]]
    sections = verl_sections()
    print(json.dumps({
        "loan_saving_predicted_over_measured": round(predicted_over_measured(pairs), 3) if pairs else None,
        "loan_saving_predicted_over_measured_within_phase":
            round(predicted_over_measured(steady), 3) if steady else None,
        "per_run": [r["loan_saving_predicted_over_measured"] for r in runs],
        "predicted_s_mean": round(sum(p for p, _ in pairs) / len(pairs), 3) if pairs else None,
        "measured_s_mean": round(sum(m for _, m in pairs) / len(pairs), 3) if pairs else None,
        "loans": sum(len(r["loans"]) for r in runs),
        "runs": runs,
        "parameters": {"runs": args.runs, "hybrid": LAYOUT.hybrid, "standalone": LAYOUT.standalone,
                       "phases": list(LENDING_PHASES), "seed": LENDING_SEED, "verl_python": str(VERL_PYTHON),
                       "daemon": {k: sections[k] for k in ("policy", "loan_costs", "guards")}},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
