"""The rollout the vLLM tests share, and the steps they run on it.

`Rollout` is the session's router, engines and workers; `ready()` brings it back to the
state every test starts from; `make_requests()` builds a step's samples with a known tail;
`assert_exactly_once()` checks a step's samples independently of the router's ledger.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Rollout:
    model_dir: Path
    router: object  # RequestRouter
    engines: dict[str, object]  # engine id -> RolloutEngine
    workers: dict[str, object]  # engine id -> EngineWorker


async def ready(rollout: Rollout) -> None:
    """Every engine running, at the router's version and admitted: the state tests start from."""
    for engine_id, worker in rollout.workers.items():
        engine = rollout.engines[engine_id]
        if worker.runs or engine.config.tensor_parallel_size != 1:
            # a test that failed inside a regroup left a wide engine: one device, one rank again
            import msgspec

            await engine.stop()
            engine.reconfigure(msgspec.structs.replace(engine.config, tensor_parallel_size=1, cpu_cores=()))
            worker.runs = ()
        if engine.state.value != "running" or worker.lost_reason is not None:
            await worker.recover()
        elif engine_id not in rollout.router.admitted:
            await rollout.router.admit(engine_id)


def make_requests(step: int, count: int, rng: random.Random, *, long: int = 0, long_tokens: int = 300,
                  short: tuple[int, int] = (4, 24), temperature: float = 1.0):
    """`count` samples; the first `long` of them are the long tail (`long_tokens` each).

    `ignore_eos` makes response lengths exact, so a test knows which requests are long.
    """
    from dynaresized.backends.vllm.engine import SampleRequest

    requests = []
    for index in range(count):
        prompt = tuple(rng.randrange(4, 1024) for _ in range(rng.randint(3, 8)))
        max_tokens = long_tokens if index < long else rng.randint(*short)
        requests.append(
            SampleRequest(
                sample_id=f"p{index}",
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                seed=step * 100_003 + index,
                temperature=temperature,
                ignore_eos=True,
            )
        )
    return requests


def assert_exactly_once(result, requests: list, version: int) -> None:
    by_id = {r.sample_id: r for r in requests}
    ids = [s.sample_id for s in result.samples]
    assert sorted(ids) == sorted(by_id), "every sample of the step, and only those"
    assert len(ids) == len(set(ids)), "no sample twice"
    for sample in result.samples:
        assert sample.policy_version == version, sample
        assert sample.step == result.step
        assert len(sample.token_ids) == by_id[sample.sample_id].max_tokens  # ignore_eos: exact length
        assert sample.finish_reason == "length"
    assert result.ledger.samples == len(requests)


async def wait_for_progress(rollout: Rollout, engine_id: str, tokens: int = 5) -> dict[str, int]:
    """Wait until some sample on `engine_id` has generated at least `tokens` tokens."""
    for _ in range(2000):
        flight = rollout.router.in_flight(engine_id)
        if any(n >= tokens for n in flight.values()):
            return flight
        await asyncio.sleep(0.005)
    raise AssertionError(f"no sample on {engine_id} got to {tokens} tokens")
