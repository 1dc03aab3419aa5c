"""verl's V1 separate-async trainer with dynaresized deciding its hybrid-rollout switch: the
`dynaresized_separate_async` trainer, looked up by verl's trainer registry after the Ray setup
hook registered it, built by its own `__init__` from verl's composed config, and driven through
verl's own step hooks inside a real Ray actor (tests/integrations/verl_v1_job.py), against the
real daemon. With the daemon, its loans are verl's switch decisions and verl keeps its sleep
contract (the job's checkpoint manager checks it); without it, or once it is lost, verl's own
inline rule decides, one log line at each change.

As for tests/integrations/test_verl.py, the verl side runs as a subprocess of the verl
environment (`.venv-verl`, or $DYNARESIZED_VERL_PYTHON).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dynaresized.core import facts as f
from dynaresized.integrations.verl.layout import V1_TRAINER_NAME
from tests.daemon.conftest import make_daemon, read_facts, wait_for  # noqa: F401  (make_daemon is a fixture)
from tests.integrations.test_verl import (
    assert_one_line_per_change,
    daemon_decides_then_is_lost,
    documented_verl_overrides,
    job_with_loans,
)
from tests.integrations.verl_run import ROOT, STARTUP_S, VERL_PYTHON, VerlJob, loans, verl_sections

JOB = Path(__file__).with_name("verl_v1_job.py")
TRAINER = "dynaresized.integrations.verl.v1.DynaresizedSeparateAsyncTrainer"

pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    pytest.mark.skipif(not VERL_PYTHON.exists(),
                       reason=f"needs the verl environment at {VERL_PYTHON} (`make setup-test` creates it)"),
]

UNREACHABLE = "dynaresized is unreachable; verl's switch rule decides until it answers"
ANSWERS = "dynaresized answers; it decides verl's hybrid activations"
LOST = "dynaresized stopped answering; verl's switch rule decides until it is back"


def test_the_daemons_loans_are_verls_switch_decisions_and_verl_keeps_its_contract(make_daemon: Any,  # noqa: F811
                                                                                   tmp_path: Path) -> None:
    daemon = make_daemon(**verl_sections())
    phases = ["rollout"] * 7 + ["train"] * 5
    job, facts = job_with_loans(daemon, tmp_path, phases, job=JOB)
    lines, steps = job.lines(), job.steps()
    assert lines[0] == {"trainer": TRAINER, "trainer_mode": "separate_async"}, lines[0]
    # The daemon decides from the first step on (its workers attach at on_init_end). Every switch
    # to rollout after a step is a loan the daemon made and that landed; where it lent nothing,
    # verl's inline rule said so too.
    assert {s["decider"] for s in steps[1:]} == {"daemon"}, steps
    assert {s["by_dynaresized"] for s in steps[1:]} == {1.0}, steps
    lent = [s for s in steps if s["lent"]]
    landed = [x for x in facts if isinstance(x, f.LoanLanded)]
    assert len(landed) == len(lent) >= 1, (len(landed), len(lent), job.output())
    assert all(s["decider"] == "daemon" for s in lent), lent
    assert {s["verl_should_switch"] for s in steps if s["decider"] == "daemon" and not s["lent"]} == {0.0}, steps
    # The daemon is asked only while verl's next step misses samples, so verl's rule lends with
    # it (but where groups arrived while the daemon decided, then the replicas are lent anyway).
    assert len([s for s in lent if s["verl_should_switch"] != 1.0]) <= 1, lent
    assert len([x for x in facts if isinstance(x, f.LoanReturned)]) >= len(landed) - 1
    # lent while the rollout is the slower stage, not once training is (after a step to notice)
    assert any(s["phase"] == "rollout" for s in lent)
    assert not [s["step"] for s in lent if s["phase"] == "train" and s["step"] > len(phases) - 5 + 2], steps
    # verl synced the hybrid replicas' weights at start and before each loan, asleep (the manager checked)
    assert lines[-1]["updates"] == [0] + [s["step"] for s in lent]
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)] == [s["step"] for s in steps]
    # the hybrid replicas left the balancer before each training step they had served in
    calls = [c for c, _ in lines[-1]["balancer"]]
    assert calls.count("remove_servers") == len(lent) + 1  # the start, in rollout mode, and each loan


def test_a_loan_the_daemon_refuses_is_not_made_though_verls_rule_would_lend(make_daemon: Any,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    """A rollout-bound job, where verl's rule lends after every step (the next test), with a
    daemon whose loans never pay back: the daemon decides, and nothing is lent."""
    sections = verl_sections()
    sections["loan_costs"] = {**sections["loan_costs"], "to_rollout_s": 100.0, "return_s": 100.0}
    daemon = make_daemon(**sections)
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phases", ",".join(["rollout"] * 5), job=JOB)
    try:
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    steps = job.steps()
    assert {s["decider"] for s in steps[1:]} == {"daemon"}, steps
    assert not [s for s in steps if s["lent"]], steps
    facts = read_facts(daemon.state_dir)
    assert not loans(facts)
    assert any(isinstance(x, f.ProposalRejected) and x.guard == "loan_payback" for x in facts), job.output()
    assert job.lines()[-1]["updates"] == [0]  # verl synced the hybrid replicas only at start


def test_verls_own_switch_rule_decides_without_the_daemon_and_once_it_is_lost(make_daemon: Any,  # noqa: F811
                                                                              tmp_path: Path) -> None:
    """Three transitions: unreachable at start (verl's rule decides), the daemon comes up (it
    decides), the daemon is lost mid-job (verl's rule again), each said in one log line."""
    daemon = make_daemon(start=False, **verl_sections())
    phase = tmp_path / "phase"
    phase.write_text("rollout")
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phase-file", str(phase), "--max-steps", "400", job=JOB)
    try:
        wait_for(lambda: len(job.steps()) >= 3, timeout=STARTUP_S, what="verl steps with no daemon")
        wait_for(lambda: UNREACHABLE in job.text(), timeout=60, what="the line saying verl's rule decides")
        alone = job.steps()
        assert {s["decider"] for s in alone} == {"default"} and {s["by_dynaresized"] for s in alone} == {0.0}
        # verl's inline rule lends on its own: no switch cost measured yet, groups missing
        assert any(s["lent"] and s["verl_should_switch"] == 1.0 for s in alone), alone
        daemon_decides_then_is_lost(job, daemon, phase, lines=(ANSWERS, LOST), steps_after_loss=2)
    finally:
        job.stop()
    assert_one_line_per_change(job, (UNREACHABLE, ANSWERS, LOST))


def test_documented_v1_config_lines_select_the_trainer_and_reach_ray_init() -> None:
    overrides = documented_verl_overrides("verl-v1-config")
    assert overrides, "docs/verl.md lists the verl V1 config lines"
    result = subprocess.run([str(VERL_PYTHON), str(JOB.with_name("verl_config.py")), "--v1", *overrides], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    composed = json.loads(result.stdout.strip().splitlines()[-1])
    assert composed["trainer_mode"] == V1_TRAINER_NAME
    assert composed["enable_switch"] is True
    env = composed["runtime_env"]
    assert env["worker_process_setup_hook"] == "dynaresized.integrations.verl.register_v1"
    documented = {k: v for k, v in env["env_vars"].items() if k.startswith("DYNARESIZED_")}
    assert set(documented) == {"DYNARESIZED_ENDPOINT", "DYNARESIZED_KEY_DIR", "DYNARESIZED_SERVER_KEY"}
    assert documented["DYNARESIZED_ENDPOINT"].startswith("tcp://")
