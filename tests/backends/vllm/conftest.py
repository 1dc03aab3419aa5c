"""Shared fixtures for the vLLM backend tests: one tiny model, one weight store, two real engines.

Engine starts dominate the time of these tests (several seconds each on a 2-core machine),
so the engines are session-scoped and every test leaves them running and admitted
(`ready()` repairs what a test broke). vLLM is imported only inside fixtures, so modules
here that do not need it still run without the extra.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.backends.vllm.workload import Rollout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VERSIONS = (0, 1, 2)  # 0 is the base checkpoint; 1 and 2 are "trained" (perturbed) versions


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dynaresized.backends.vllm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def weight_store(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from dynaresized.backends.vllm.tiny_model import perturbed_weights
    from dynaresized.backends.vllm.weights import WeightStore

    store = WeightStore(tmp_path_factory.mktemp("weights"))
    store.publish_checkpoint(0, tiny_model)
    for version in VERSIONS[1:]:
        store.publish(version, perturbed_weights(tiny_model, seed=version))
    return store


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def rollout(tiny_model: Path, weight_store) -> AsyncIterator[Rollout]:
    from dynaresized.backends.vllm.engine import EngineConfig, RolloutEngine
    from dynaresized.backends.vllm.router import RequestRouter
    from dynaresized.backends.vllm.worker import EngineWorker

    router = RequestRouter(weight_store, max_inflight=64, finish_within_tokens=8)
    engines: dict[str, object] = {}
    workers: dict[str, object] = {}
    config = EngineConfig(model=str(tiny_model), kv_cache_memory_bytes=64 * 1024 * 1024)
    for index in range(2):
        engine = RolloutEngine(f"e{index}", config)
        engines[engine.engine_id] = engine
        workers[engine.engine_id] = EngineWorker(
            engine, router, (f"node0:cpu{index}",), heartbeat_interval_s=1.0, missed_heartbeats=5
        )
        await engine.start()
    for engine_id, worker in workers.items():
        await worker.start()
        await router.admit(engine_id)
    yield Rollout(tiny_model, router, engines, workers)
    for worker in workers.values():
        await worker.close()
    for engine in engines.values():
        await engine.stop()
