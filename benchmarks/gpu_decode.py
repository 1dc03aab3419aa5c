"""What a GPU shows that this project's CPU machine cannot: prints ONE JSON object, asserts nothing
on time. Plain torch (no vLLM, no project imports): run it where a GPU is lent.

* `tp_shard_decode`: one decode iteration of one rank of a tensor-parallel engine of k devices,
  k = 1, 2, 4, 8, for a Qwen3-8B-shaped model (36 layers, hidden 4096, 32 query / 8 KV heads of
  128, MLP 12288, vocabulary 151936, bf16): the rank holds 1/k of the heads, of the MLP columns
  and of the vocabulary, and the KV cache of its heads only. Batches of 1-256 sequences of
  `--ctx` tokens, captured in a CUDA graph (vLLM decodes with graphs) and timed by events. The
  all-reduces between ranks are left out: one GPU cannot run two ranks of NCCL. This is the
  simulator's TP curve less its communication term: `iter_base_s(k)` is said to split k ways
  but for a fixed part (docs/simulator.md, "Tensor parallelism").
* `time_share`: an engine (the k = 1 model, 64 sequences) and a trainer (about 1B fp32
  parameters with Adam) taking turns on the one GPU as verl's hybrid replicas do: the engine
  sleeps (weights to pinned host memory, KV cache freed), the trainer wakes and trains, the
  engine wakes, the trainer's new weights are copied into it, the trainer offloads, the KV cache
  comes back. Seconds and GPU memory freed or taken by each transition.
* `pinned_staging`: host <-> GPU copies of `--staging-gib` in 64 MiB chunks and whole, from
  pinned and from pageable host memory.

    python benchmarks/gpu_decode.py                          # on a GPU machine (about 2 minutes)
    python benchmarks/gpu_decode.py --smoke --device cpu     # tiny sizes, to check it here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

QWEN3_8B = {"layers": 36, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 12288,
            "vocab": 151936}
TINY = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 32, "inter": 512, "vocab": 1024}
GIB = 1024 ** 3


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rand(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Small random values (never zeros: they hide unwritten outputs and run faster)."""
    return torch.randn(shape, device=device, dtype=dtype) * 0.02


class Rank:
    """One TP-k rank's weights and KV cache, and its decode iteration (RMSNorm, fused QKV, attention
    of one new token per sequence over the cache, output projection, gated MLP; the LM head)."""

    def __init__(self, g: dict[str, int], k: int, batch: int, ctx: int, device: str) -> None:
        h, hd = g["hidden"], g["head_dim"]
        self.q, self.kv = g["heads"] // k, max(1, g["kv_heads"] // k)
        inter = g["inter"] // k
        self.batch, self.hd = batch, hd
        self.layers = [{"qkv": rand((h, (self.q + 2 * self.kv) * hd), device), "o": rand((self.q * hd, h), device),
                        "gu": rand((h, 2 * inter), device), "down": rand((inter, h), device)}
                       for _ in range(g["layers"])]
        self.lm = rand((h, g["vocab"] // k), device)
        self.alloc_cache(ctx, device)
        self.x = rand((batch, h), device)

    def alloc_cache(self, ctx: int, device: str) -> None:
        # one tensor per layer for keys and one for values: (batch, kv heads, ctx, head_dim)
        self.cache = [(rand((self.batch, self.kv, ctx, self.hd), device), rand((self.batch, self.kv, ctx, self.hd), device))
                      for _ in self.layers]

    def weights(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.values()] + [self.lm]

    def bytes_read(self) -> int:
        """The floor of one iteration's memory traffic: every weight and every cached key and value once."""
        return sum(t.numel() * t.element_size() for t in self.weights()) + sum(
            k.numel() * k.element_size() * 2 for k, _ in self.cache)

    def step(self) -> torch.Tensor:
        x, b, hd = self.x, self.batch, self.hd
        group = self.q // self.kv
        for layer, (kc, vc) in zip(self.layers, self.cache):
            qkv = F.rms_norm(x, (x.shape[-1],)) @ layer["qkv"]
            q = qkv[:, : self.q * hd].reshape(b, self.kv, group, hd)  # the query heads of each KV head
            a = F.scaled_dot_product_attention(q, kc, vc)  # (batch, kv, group, hd): no mask, all of the cache
            x = x + a.reshape(b, self.q * hd) @ layer["o"]
            gate, up = (F.rms_norm(x, (x.shape[-1],)) @ layer["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return x @ self.lm


def time_ms(fn: Callable[[], Any], device: str, warmup: int = 5, reps: int = 20) -> tuple[float, str]:
    """Median milliseconds of `fn`: a CUDA graph replayed and timed with events on a GPU (eager
    if capture fails), the wall clock on a CPU."""
    if device != "cuda":
        fn()
        times = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times), "eager"
    mode, run = "graph", fn
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - a capture that fails still leaves an eager time
        log(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        mode, run = "eager", fn
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), mode


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def copy_bandwidth_gbps(device: str, gib: float) -> float:
    """One large device-to-device copy, bytes read plus written over its time: the ceiling."""
    n = int(gib * GIB) // 2
    a, b = rand((n,), device), torch.empty(n, device=device, dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: b.copy_(a), device, reps=10)
    del a, b
    free(device)
    return round(2 * n * 2 / (ms / 1000) / 1e9, 1)


def tp_shard_decode(g: dict[str, int], device: str, ctx: int, batches: list[int], deadline: float) -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    for batch in batches:
        for k in (1, 2, 4, 8):
            if time.monotonic() > deadline:
                cases.append({"k": k, "batch": batch, "skipped": "time budget spent"})
                continue
            try:
                rank = Rank(g, k, batch, ctx, device)
                ms, mode = time_ms(rank.step, device)
                moved = rank.bytes_read()
                cases.append({"k": k, "batch": batch, "ctx": ctx, "ms_per_iter": round(ms, 4), "timing": mode,
                              "bytes_read": moved, "achieved_gbps": round(moved / (ms / 1000) / 1e9, 1)})
                log(f"tp k={k} batch={batch}: {ms:.3f} ms ({mode})")
                del rank
            except torch.OutOfMemoryError:
                cases.append({"k": k, "batch": batch, "ctx": ctx, "error": "oom"})
            free(device)
    ratios: dict[str, dict[str, float]] = {}
    for batch in batches:
        by_k = {c["k"]: c["ms_per_iter"] for c in cases if c.get("batch") == batch and "ms_per_iter" in c}
        if 1 in by_k:
            ratios[str(batch)] = {f"tp{k}": round(by_k[1] / v, 3) for k, v in sorted(by_k.items())}
    return {"model": g, "cases": cases, "speedup_vs_tp1_per_rank": ratios,
            "not_measured": "the all-reduces between ranks (two per layer per iteration): one GPU cannot run two "
                            "NCCL ranks; a TP-k engine's iteration is this plus them"}


class Trainer:
    """About `params` fp32 parameters in square layers with Adam: the training side of a hybrid replica."""

    def __init__(self, params: int, width: int, device: str) -> None:
        layers = max(1, params // (width * width))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(256, width, device=device)
        self.step()  # Adam's moments exist from here on

    def step(self) -> None:
        loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for state in self.opt.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        return out


def gpu_memory(device: str) -> dict[str, float]:
    if device != "cuda":
        return {}
    free_b, total = torch.cuda.mem_get_info()
    return {"allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2),
            "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2), "free_gib": round(free_b / GIB, 2)}


def offload(tensors: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """Each tensor's bytes to its host buffer, then the GPU storage dropped (vLLM's sleep level 1
    for weights; FSDP's param/optimizer offload for a trainer)."""
    for t, h in zip(tensors, host):
        h.copy_(t, non_blocking=True)
    for t in tensors:
        t.data = torch.empty(0, device=t.device, dtype=t.dtype)


def restore(tensors: list[torch.Tensor], host: list[torch.Tensor], device: str) -> None:
    for t, h in zip(tensors, host):
        t.data = h.to(device, non_blocking=True)


def time_share(g: dict[str, int], device: str, ctx: int, trainer_params: int, width: int, cycles: int) -> dict[str, Any]:
    pin = device == "cuda"  # pinned host memory needs CUDA (it fails on CPU builds)
    engine = Rank(g, 1, 64 if device == "cuda" else 4, ctx, device)
    trainer = Trainer(trainer_params, width, device)
    weights = engine.weights()
    engine_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in weights]
    trainer_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in trainer.tensors()]
    report: dict[str, Any] = {"pinned": pin, "engine_weights_gib": round(sum(t.numel() * 2 for t in weights) / GIB, 2),
                              "engine_kv_gib": round(sum(k.numel() * 2 * 2 for k, _ in engine.cache) / GIB, 2),
                              "trainer_state_gib": round(sum(t.numel() * t.element_size() for t in trainer.tensors()) / GIB, 2),
                              "decode_timing": "eager (the weights move between cycles: no graph)", "cycles": []}

    def transition(name: str, fn: Callable[[], None], row: dict[str, Any]) -> None:
        sync(device)
        before = gpu_memory(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if name.endswith(("sleep", "offload", "kv_free")):
            free(device)
        after = gpu_memory(device)
        row[name] = {"s": round(time.perf_counter() - t0, 4),
                     "gpu_freed_gib": round(after.get("free_gib", 0) - before.get("free_gib", 0), 2)}
        log(f"time_share {name}: {row[name]}")

    def drop_kv() -> None:
        engine.cache = []

    trainer_offloaded = False
    for cycle in range(cycles):
        row: dict[str, Any] = {"cycle": cycle}
        row["decode_ms_before"] = round(_eager_ms(engine.step, device), 3)
        if not trainer_offloaded:
            transition("trainer_offload", lambda: offload(trainer.tensors(), trainer_host), row)
            trainer_offloaded = True
        transition("engine_kv_free", drop_kv, row)
        transition("engine_sleep", lambda: offload(weights, engine_host), row)
        transition("trainer_wake", lambda: restore(trainer.tensors(), trainer_host, device), row)
        transition("trainer_train_3_steps", lambda: [trainer.step() for _ in range(3)], row)
        transition("engine_wake", lambda: restore(weights, engine_host, device), row)
        src = [p.data.reshape(-1) for p in trainer.model.parameters()]

        def weight_sync() -> None:  # every engine weight overwritten from the trainer's (cast, cycled)
            i = 0
            for t in weights:
                flat, n = t.view(-1), 0
                while n < flat.numel():
                    part = src[i % len(src)][: flat.numel() - n]
                    flat[n:n + part.numel()].copy_(part)
                    n += part.numel()
                    i += 1

        transition("weight_sync", weight_sync, row)
        transition("trainer_offload", lambda: offload(trainer.tensors(), trainer_host), row)
        transition("engine_kv_alloc", lambda: engine.alloc_cache(ctx, device), row)
        row["decode_ms_after"] = round(_eager_ms(engine.step, device), 3)
        report["cycles"].append(row)
    del engine, trainer, engine_host, trainer_host, weights
    free(device)
    return report


def _eager_ms(fn: Callable[[], Any], device: str, reps: int = 10) -> float:
    """Median wall milliseconds of `fn` run eagerly, synchronized."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def pinned_staging(device: str, gib: float, chunk_mib: int = 64) -> dict[str, Any]:
    if device != "cuda":
        return {"note": "no GPU: host <-> device copies are not meaningful here", "skipped": True}
    n = int(gib * GIB)
    gpu = torch.randint(0, 255, (n,), device=device, dtype=torch.uint8)
    out: dict[str, Any] = {"bytes": n, "chunk_mib": chunk_mib}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        chunk = chunk_mib * 1024 * 1024
        for direction in ("d2h", "h2d"):
            for how in ("whole", "chunked"):
                src, dst = (gpu, host) if direction == "d2h" else (host, gpu)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if how == "whole":
                    dst.copy_(src, non_blocking=kind == "pinned")
                else:
                    for i in range(0, n, chunk):
                        dst[i:i + chunk].copy_(src[i:i + chunk], non_blocking=kind == "pinned")
                torch.cuda.synchronize()
                out[f"{kind}_{direction}_{how}_gbps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
        log(f"staging {kind}: {out}")
        del host
    del gpu
    free(device)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a check that it runs)")
    p.add_argument("--only", default="tp_shard_decode,time_share,pinned_staging")
    p.add_argument("--ctx", type=int, default=1024, help="tokens cached per sequence")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip what is left of the TP cases past this")
    p.add_argument("--staging-gib", type=float, default=4.0)
    args = p.parse_args()
    started = time.monotonic()
    g = TINY if args.smoke else QWEN3_8B
    ctx = 64 if args.smoke else args.ctx
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "smoke": args.smoke,
                              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    torch.manual_seed(0)
    parts: dict[str, Callable[[], Any]] = {
        "tp_shard_decode": lambda: tp_shard_decode(g, args.device, ctx, [1, 4] if args.smoke else [1, 16, 64, 256],
                                                   started + args.budget_s),
        "time_share": lambda: time_share(g, args.device, ctx, 1 << 16 if args.smoke else 1 << 30,
                                         128 if args.smoke else 4096, 2),
        "pinned_staging": lambda: pinned_staging(args.device, 0.01 if args.smoke else args.staging_gib),
    }
    try:
        report["copy_bandwidth_gbps"] = copy_bandwidth_gbps(args.device, 0.01 if args.smoke else 4.0)
    except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others
        report["copy_bandwidth_gbps"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in args.only.split(","):
        try:
            report[name] = parts[name]()
        except Exception as exc:  # noqa: BLE001 - as above
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        free(args.device)
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
