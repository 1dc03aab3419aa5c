"""The README's main command, shortened: the real daemon, device processes over real ZeroMQ,
and a resize and loans inside steps that show up in the daemon's own event log."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynaresized.core import facts as f
from dynaresized.core.facts import decode_fact
from dynaresized.demo import _follow
from dynaresized.domain import StepTiming
from dynaresized.store import open_recorder
from dynaresized.store.factlog import FactLog

from tests.readme_demo import excerpt
from tests.test_readme import unmatched_demo_lines


def test_demo_moves_devices_to_the_slow_stage_and_beats_the_static_split() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dynaresized.cli", "demo", "--steps", "30", "--speedup", "20000", "--json", "--keep"],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    state = Path(summary["state_dir"])
    try:
        assert summary["steps"] == 30
        assert summary["resizes"] >= 1 and summary["final_split"] in ("4:4", "3:5")
        assert summary["speedup_vs_static_split"] > 1.2
        # and against what an operator would pick by hand, engine size included (TP-4 at 4:4)
        assert summary["best_static_config"] == "4:4/TP-4"
        assert summary["best_static_config_total_time_s"] < summary["static_total_time_s"]
        # shown live, with its reason; its target comes from measured steps, which loans shorten
        assert re.search(r"resize r1 started: 6:2 -> (4:4|3:5)", result.stderr), result.stderr[-3000:]
        assert "resize r1 prediction: step" in result.stderr  # checked against what was measured
        # idle figures per pool at the end, from the daemon's own accounting (docs/idle.md)
        for pool in ("rollout", "training"):
            assert f"  idle {pool}" in result.stderr
            assert 0.0 <= summary["idle_ratio"][pool] < 1.0
        recorder = open_recorder(state / "events.sqlite", read_only=True)
        facts = [decode_fact(e.data) for e in recorder.read_all()]
        recorder.close()
        registered = {x.worker.worker_id for x in facts if isinstance(x, f.WorkerRegistered)}
        assert len(registered) == 16  # an engine and a trainer per device, each its own client
        started = [x for x in facts if isinstance(x, f.ResizeStarted)]
        assert started[0].source == "hysteresis" and "rollout is the slower stage" in started[0].reason
        assert [type(x) for x in facts if isinstance(x, f.ResizeCommitted | f.ResizeRolledBack)][0] \
            is f.ResizeCommitted
        assert sum(isinstance(x, f.StepObserved) for x in facts) == 30
        # Idle devices are lent to the stage in progress, shown live with their reasons, and come
        # home. Which way they go (engines to training at "rollout queue empty", trainers to the
        # rollout) depends on where each step's idle time falls, which at 20000x moves with the
        # machine's load, so the test asks for loans and their reasons, not for one direction.
        assert summary["loans"] >= 5 and summary["router"] == "pull"
        loans = [x for x in facts if isinstance(x, f.LoanStarted)]
        assert loans and all(x.saves_s > x.cost_s for x in loans)
        assert all(" to training at mini-batch " in x.reason or " to the rollout: " in x.reason for x in loans)
        assert any(x.reason.split(":")[0] in result.stderr for x in loans), result.stderr[-3000:]
        # every lent device goes home at a step boundary (one return for all of a step's loans)
        lent = [d for x in loans for d in x.plan.devices]
        home = [d for x in facts if isinstance(x, f.LoanReturnStarted) for d in x.plan.devices]
        assert set(lent) == set(home) and len(home) >= len(lent) - len(set(lent))
        assert any(isinstance(x, f.MiniBatchObserved) for x in facts)
        # every line has a shape the README's sample is held to (tests/test_readme.py), and the
        # README's cut of a run (tests/readme_demo.py) finds its parts in this one
        lines = result.stderr.rstrip("\n").split("\n")
        assert unmatched_demo_lines(lines) == []
        sample = excerpt(lines)
        assert sample[0].startswith("dynaresized demo: ") and sample[1].startswith("step    0  ")
        assert " resize r1 started: " in sample[3] and " resize r1 committed " in sample[4]
        assert sample[6].startswith("done: 30 steps") and "best static configuration" in sample[-2]
        assert sample[-1].startswith("  predictions resizes 1 checked, mean abs error ")
        # each loan's prediction is checked against the timings (the leader, which acts on the
        # loans, stops the run if the daemon refuses its status requests); the engine that pulls
        # a step's last request says the queue is empty before it runs dry
        checked = [x for x in facts if isinstance(x, f.LoanChecked)]
        assert checked and summary["predictions_checked"]["loan"] == len(checked)
        assert summary["prediction_mae_s"]["loan"] == pytest.approx(
            sum(abs(x.error_s) for x in checked) / len(checked), abs=0.01)
        assert any(isinstance(x, f.EngineQueueEmptyObserved) and x.running > 0 for x in facts)
        # one-step off: window 0 has nothing to train
        first = next(x for x in facts if isinstance(x, f.MiniBatchObserved))
        assert (first.step, first.done, first.total) == (0, 0, 0)
    finally:
        shutil.rmtree(state.parent, ignore_errors=True)


def test_the_demo_reads_the_log_on_after_the_leader_exits_until_every_step_is_in(tmp_path: Path) -> None:
    # The leader's last step report can reach the log after the leader has exited (the daemon
    # commits it with an fsync): the demo must not count one step short and fail the run.
    def step(i: int) -> f.StepObserved:
        return f.StepObserved(at=float(i), worker_id="tr-0", timing=StepTiming(step=i, rollout_s=2.0, train_s=1.0))

    writer = FactLog(open_recorder(tmp_path / "events.sqlite"))
    writer.append([step(0), step(1)])
    leader = subprocess.Popen([sys.executable, "-c", "pass"])
    leader.wait()  # gone before its last step is in the log
    late = threading.Timer(0.5, lambda: writer.append([step(2)]))
    late.start()
    try:
        summary = _follow(tmp_path, leader, 3, lambda line: None, open_recorder, decode_fact)
    finally:
        late.join()
        writer.recorder.close()
    assert summary["steps"] == 3 and summary["total_time_s"] == 7.0  # windows 2, 2, 2, then the last training 1
    # a leader that died early is waited for no longer than settle_s
    began = time.monotonic()
    assert _follow(tmp_path, leader, 5, lambda line: None, open_recorder, decode_fact, settle_s=0.3)["steps"] == 3
    assert time.monotonic() - began < 5


def test_the_step_line_shows_the_split_after_a_commit_and_each_loans_direction(tmp_path: Path) -> None:
    """The pool bar lagged a step behind each commit (it drew the split the step started on), and
    `lent` listed engines lent to training and trainers lent to the rollout as one list."""
    from dynaresized.core import events as ev
    from dynaresized.domain import Split

    from tests.core.cluster import EAGER, boot, engine, make_core, trainer

    d = boot(make_core(EAGER, "hysteresis", op_timeout_s=30.0), 2, 2)

    def step(i: int) -> None:  # what the workers say: the step ran on 2:2
        d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
            step=i, rollout_s=10.0, train_s=10.0, rollout_devices=2, train_devices=2)))
        d.finish()

    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=0))  # trainers to the rollout
    d.finish()
    d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=0, done=0, total=8))  # ... and home
    d.finish()
    for done in (1, 2):
        d.send(ev.MiniBatchDone(at=d.at(60), worker_id=trainer(0), step=0, done=done, total=8))
    d.send(ev.EngineQueueEmpty(at=d.at(), worker_id=engine(3), step=1, running=0))  # an engine to training
    d.finish()
    step(0)
    d.send(ev.ResizeRequested(at=d.at(), target=Split(train=3, rollout=1)))
    d.finish()
    step(1)
    FactLog(open_recorder(tmp_path / "events.sqlite")).append(d.log)
    leader = subprocess.Popen([sys.executable, "-c", "pass"])
    leader.wait()
    lines: list[str] = []
    _follow(tmp_path, leader, 2, lines.append, open_recorder, decode_fact)
    steps = [x for x in lines if x.startswith("step ")]
    assert steps[0].startswith("step    0  T■■ R□□ ") and steps[0].endswith("  lent to training gpu3; to rollout gpu0, gpu1")
    assert lines.index("  >> resize r1 committed in 8.00s at step 0") < lines.index(steps[1])
    assert steps[1].startswith("step    1  T■■■ R□ ") and "lent" not in steps[1]
