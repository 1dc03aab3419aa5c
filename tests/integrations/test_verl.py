"""verl's real DynamicResourceController, driven over many steps by our policy inside a real Ray
actor, against the real daemon: the daemon lends verl's hybrid replicas to the rollout between
training steps and verl keeps its sleep-before-training contract (the test job's checkpoint
manager checks it); the daemon's predicted saving of each loan is checked against what the job
measured; verl's own default policy decides while the daemon is unreachable, at start or lost
mid-job, and hands back when it answers; CURVE keys on a non-loopback daemon.

The verl side runs as a subprocess of the verl environment (tests/integrations/verl_run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dynaresized.core import facts as f
from dynaresized.domain import Pool
from dynaresized.integrations.verl.layout import ROLLOUT_WORKER, TRAINER_WORKER, VerlLayout
from tests.daemon.conftest import make_daemon, read_facts, wait_for  # noqa: F401  (make_daemon is a fixture)
from tests.integrations.verl_run import (
    JOB,
    LAYOUT,
    LENDING_PHASES,
    ROOT,
    STARTUP_S,
    VERL_OLDEST_PYTHON,
    VERL_PYTHON,
    VerlJob,
    lending_job,
    loans,
    predicted_over_measured,
    prediction_errors,
    verl_sections,
)

pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    pytest.mark.skipif(not VERL_PYTHON.exists(),
                       reason=f"needs the verl environment at {VERL_PYTHON} (`make setup-test` creates it)"),
]


def deciders(job: VerlJob) -> list[str]:
    return [s["decider"] for s in job.steps()]


def daemon_decides_then_is_lost(job: VerlJob, daemon: Any, phase: Path, *, lines: tuple[str, str],
                                steps_after_loss: int) -> None:
    """Of a job that runs on verl's own rule with the daemon down: the daemon comes up and
    decides (a loan of its own, its `lines[0]` said), is killed, and verl's rule decides again
    for `steps_after_loss` steps (`lines[1]` said); then the job is told to stop and ends well."""
    answers, lost = lines
    daemon.start()
    wait_for(lambda: "daemon" in deciders(job), timeout=120, what="the daemon deciding")
    wait_for(lambda: loans(read_facts(daemon.state_dir)), timeout=120, what="a loan by the daemon")
    wait_for(lambda: answers in job.text(), timeout=60, what="the line saying the daemon decides")
    daemon.kill()
    at_kill = len(job.steps())
    wait_for(lambda: deciders(job)[-1] == "default" and len(job.steps()) >= at_kill + steps_after_loss, timeout=120,
             what="verl's own rule deciding after the daemon was lost")
    wait_for(lambda: lost in job.text(), timeout=60, what="the line saying the daemon was lost")
    assert job.proc.poll() is None, job.output()
    phase.write_text("stop")
    assert job.wait() == 0, job.output()


def assert_one_line_per_change(job: VerlJob, lines: tuple[str, str, str]) -> None:
    """verl's rule, the daemon, verl's rule: one log line for each change of who decides."""
    order = deciders(job)
    changes = [d for i, d in enumerate(order) if i == 0 or order[i - 1] != d]
    assert changes == ["default", "daemon", "default"], order
    output = job.text()  # (Ray forwards the actor's lines late)
    assert [output.count(line) for line in lines] == [1, 1, 1], output[-8000:]


def job_with_loans(daemon: Any, tmp_path: Path, phases: tuple[str, ...] | list[str],
                   **job: Any) -> tuple[VerlJob, list[Any]]:
    """A verl job of `phases` run to its end against `daemon` (`lending_job`), and the daemon's
    facts. Checked: a line per phase; verl's trainer group is never resized; the daemon lent the
    hybrid slots to the rollout (after training steps; they come home when the next one begins,
    as verl activates and deactivates them)."""
    run = lending_job(tmp_path, daemon.worker_endpoint, phases=phases, **job)
    assert len(run.steps()) == len(phases), run.output()
    facts = read_facts(daemon.state_dir)
    assert not any(isinstance(x, f.ResizeStarted) for x in facts)
    started = loans(facts)
    assert started, run.output()
    assert all(x.plan.to_pool is Pool.ROLLOUT and set(x.plan.devices) == set(LAYOUT.hybrid_devices) for x in started)
    return run, facts


@pytest.mark.parametrize("python", [
    pytest.param(VERL_PYTHON, id="newest"),
    pytest.param(VERL_OLDEST_PYTHON, id="oldest", marks=pytest.mark.skipif(
        not VERL_OLDEST_PYTHON.exists(), reason=f"needs the oldest verl at {VERL_OLDEST_PYTHON} (`make setup-test`)")),
])
def test_daemon_lends_hybrid_replicas_between_steps_and_verl_keeps_its_contract(make_daemon: Any, tmp_path: Path,  # noqa: F811
                                                                                  python: Path) -> None:
    daemon = make_daemon(**verl_sections())
    phases = LENDING_PHASES
    job, facts = job_with_loans(daemon, tmp_path, phases, python=python)
    lines, steps = job.lines(), job.steps()
    assert lines[0]["policy"] == "dynaresized.integrations.verl.policy.DynaresizedSchedulePolicy"
    landed = [x for x in facts if isinstance(x, f.LoanLanded)]
    lent = [s for s in steps if s["lent"]]
    assert len(landed) == len(lent) == steps[-1]["activations"], (len(landed), len(lent), job.output())
    assert steps[-1]["deactivations"] >= steps[-1]["activations"] - 1
    assert len([x for x in facts if isinstance(x, f.LoanReturned)]) >= len(landed) - 1
    # lent while the rollout is the slower stage, not once training is (after a step to notice)
    assert any(s["phase"] == "rollout" for s in lent)
    assert not [s["step"] for s in lent if s["phase"] == "train" and s["step"] > len(phases) - 6 + 2], steps
    # verl updated the hybrid replicas' weights before each activation, asleep (the manager checked)
    assert lines[-1]["updates"] == [s["step"] for s in lent]
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)] == [s["step"] for s in steps]
    # the daemon was told when verl would take each loan back: verl's threshold at the next step
    reported = {x.timing.step: x.timing.loan_home_share for x in facts if isinstance(x, f.StepObserved)}
    by_step = {s["step"]: s for s in steps}
    assert [round(reported[s["step"]] * lines[0]["required_samples"]) for s in lent] == [
        by_step[s["step"] + 1]["deactivated_at"] for s in lent], (lent, reported)
    errors = prediction_errors(facts, steps)
    print("loan predictions (predicted, measured seconds saved):", json.dumps(errors))
    assert errors and all(predicted > 0 for predicted, _ in errors)
    # The daemon's model of a verl job is its loans, which verl takes back once deactivate_wait_samples
    # are queued: within a phase its mean predicted saving is within 0.8-1.25x of the measured one
    # (0.97-1.05 in two full test runs). The loan after the last rollout-bound step, whose next step
    # runs the training-bound phase (a rollout 15x faster, which no model of the steps before sees
    # coming), predicts ~1.3 s and saves ~0.08 s: over all loans the mean was 1.17-1.37
    # (benchmarks/verl_job.py), and it is held below 1.5.
    steady = prediction_errors(facts, steps, within_phase=True)
    assert steady and 0.8 <= predicted_over_measured(steady) <= 1.25, steady
    assert predicted_over_measured(errors) < 1.5, errors
    status = daemon.status()
    assert status["devices"]["verl:hybrid_0"] in ("training", "rollout")


UNREACHABLE = "dynaresized is unreachable; verl's default policy decides"
ANSWERS = "dynaresized answers; it decides"
LOST = "dynaresized stopped answering; verl's default policy decides"


def test_fallback_to_verls_default_policy_and_back(make_daemon: Any, tmp_path: Path) -> None:  # noqa: F811
    """Three transitions: unreachable at start (verl's default decides), the daemon comes up (it
    decides), the daemon is lost mid-job (verl's default again), each said in one log line."""
    daemon = make_daemon(start=False, **verl_sections())
    phase = tmp_path / "phase"
    phase.write_text("rollout")
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phase-file", str(phase), "--max-steps", "400")
    try:
        wait_for(lambda: len(job.steps()) >= 4, timeout=STARTUP_S, what="verl steps with no daemon")
        assert set(deciders(job)) == {"default"}
        wait_for(lambda: UNREACHABLE in job.text(), timeout=60, what="the line saying verl's default decides")
        # verl's own default policy object decides (its cost/benefit check is its own log line)
        assert "[DefaultDynamicSchedulePolicy] step=" in job.text() and "cost/benefit check" in job.text()
        daemon_decides_then_is_lost(job, daemon, phase, lines=(ANSWERS, LOST), steps_after_loss=3)
    finally:
        job.stop()
    assert_one_line_per_change(job, (UNREACHABLE, ANSWERS, LOST))


def test_curve_keys_on_a_non_loopback_daemon(make_daemon: Any, tmp_path: Path) -> None:  # noqa: F811
    from dynaresized.daemon.security import keygen
    from tests.daemon.conftest import free_port

    server_pub, server_secret = keygen(tmp_path / "server", "server")
    authorized, keys = tmp_path / "authorized", tmp_path / "keys"
    authorized.mkdir()
    for worker in (TRAINER_WORKER, ROLLOUT_WORKER):
        pub, _ = keygen(keys, worker)
        (authorized / pub.name).write_bytes(pub.read_bytes())
    keygen(tmp_path / "intruders", TRAINER_WORKER)
    keygen(tmp_path / "intruders", ROLLOUT_WORKER)
    endpoint = f"tcp://127.0.0.2:{free_port()}"
    daemon = make_daemon(daemon={"worker_endpoint": endpoint},
                         security={"server_secret_key": str(server_secret), "authorized_keys_dir": str(authorized)},
                         **verl_sections())
    # Wrong keys: refused with a clear error, and verl goes on with its default policy.
    wrong = subprocess.run([str(VERL_PYTHON), "-c", CHECK_KEYS, endpoint], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "DYNARESIZED_KEY_DIR": str(tmp_path / "intruders"),
                                             "DYNARESIZED_SERVER_KEY": str(server_pub)})
    assert "refused this worker's CURVE key" in wrong.stdout, wrong.stdout + wrong.stderr
    missing = subprocess.run([str(VERL_PYTHON), "-c", CHECK_KEYS, endpoint], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "DYNARESIZED_KEY_DIR": str(tmp_path / "server"),
                                               "DYNARESIZED_SERVER_KEY": str(server_pub)})
    assert "no verl-trainer.key_secret" in missing.stdout, missing.stdout + missing.stderr
    # The right keys: the job attaches over CURVE and the daemon lends.
    job = VerlJob(tmp_path, endpoint, "--phases", ",".join(["rollout"] * 6),
                  "--env", f"DYNARESIZED_KEY_DIR={keys}", "--env", f"DYNARESIZED_SERVER_KEY={server_pub}")
    try:
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    facts = read_facts(daemon.state_dir)
    assert {x.worker.worker_id for x in facts if isinstance(x, f.WorkerRegistered)} == {TRAINER_WORKER, ROLLOUT_WORKER}
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)], job.output()
    assert "daemon" in [s["decider"] for s in job.steps()]


CHECK_KEYS = """
import sys, time
from dynaresized.integrations.verl.layout import VerlLayout
from dynaresized.integrations.verl.workers import Cycle, VerlWorkers, curve_keys
try:
    keys = curve_keys()
except ValueError as exc:
    print(exc); sys.exit(0)
workers = VerlWorkers(sys.argv[1], VerlLayout(hybrid=2, standalone=1), Cycle(), keys=keys)
deadline = time.monotonic() + 60
while not (workers.last_error or workers.refused or workers.answering) and time.monotonic() < deadline:
    time.sleep(0.1)
print(workers.last_error or workers.refused or "attached")
"""


def documented_verl_overrides(marker: str = "verl-config") -> list[str]:
    """The verl command-line lines in docs/verl.md after `<!-- marker: ... -->`, as the shell
    would pass them."""
    import shlex

    text = (ROOT / "docs" / "verl.md").read_text()
    block = text.split(f"<!-- {marker}:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_documented_config_lines_reach_ray_init_and_select_the_policy() -> None:
    overrides = documented_verl_overrides()
    assert overrides, "docs/verl.md lists the verl config lines"
    result = subprocess.run([str(VERL_PYTHON), str(JOB.with_name("verl_config.py")), *overrides], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    composed = json.loads(result.stdout.strip().splitlines()[-1])
    assert composed["use_dynamic_resource_scheduling"] is True
    assert composed["dynamic_schedule_policy"] == "dynaresized"
    env = composed["runtime_env"]
    assert env["worker_process_setup_hook"] == "dynaresized.integrations.verl.register"
    documented = {k: v for k, v in env["env_vars"].items() if k.startswith("DYNARESIZED_")}
    assert all(isinstance(v, str) for v in documented.values()), documented  # Ray takes only strings
    assert set(documented) == {"DYNARESIZED_ENDPOINT", "DYNARESIZED_KEY_DIR", "DYNARESIZED_SERVER_KEY"}
    assert documented["DYNARESIZED_ENDPOINT"].startswith("tcp://")


def test_without_standalone_replicas_verl_keeps_its_own_cycle_and_the_daemon_observes(make_daemon: Any,
                                                                                        tmp_path: Path) -> None:  # noqa: F811
    only_hybrid = VerlLayout(hybrid=2, standalone=0)
    daemon = make_daemon(**verl_sections(only_hybrid))
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phases", ",".join(["rollout"] * 5), standalone=0)
    try:
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    steps = job.steps()
    # verl's only-hybrid cycle: the hybrid replicas (its only rollout) wake after every weight sync
    # and sleep before every step; asleep for good they would leave verl nothing to generate with.
    assert [s["activations"] for s in steps] == list(range(2, 7))  # the first at start
    assert [s["deactivations"] for s in steps] == list(range(1, 6))
    facts = read_facts(daemon.state_dir)
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)][-3:] == [s["step"] for s in steps][-3:]
    assert {x.worker.worker_id for x in facts if isinstance(x, f.WorkerRegistered)} == {TRAINER_WORKER}
    assert not any(isinstance(x, (f.ResizeStarted, f.LoanStarted)) for x in facts)
