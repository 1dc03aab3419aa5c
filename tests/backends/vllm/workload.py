"""The rollout the vLLM tests share, and the steps they run on it.

`Rollout` is the session's router, engines and workers; `ready()` brings it back to the
state every test starts from; `make_requests()` builds a step's samples with a known tail.
"""

from __future__ import annotations

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
