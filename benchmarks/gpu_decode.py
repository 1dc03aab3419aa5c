"""What a GPU shows that this project's CPU machine cannot: prints ONE JSON object on stdout (progress
on stderr), asserts nothing on time. Plain torch (no vLLM, no project imports): run it where a GPU is lent.

* `tp_shard_decode`: one decode iteration of one rank of a tensor-parallel engine of k devices,
  k = 1, 2, 4, 8, for a Qwen3-8B-shaped model (36 layers, hidden 4096, 32 query / 8 KV heads of
  128, MLP 12288, vocabulary 151936, bf16): the rank holds 1/k of the heads, of the MLP columns
  and of the vocabulary, and the KV cache of its heads only. Batches of 1-256 sequences of
  `--ctx` tokens, captured in a CUDA graph (vLLM decodes with graphs) and timed by events. The
  all-reduces between ranks are left out: one GPU cannot run two ranks of NCCL. This is the
  simulator's TP curve less its communication term: `iter_base_s(k)` is said to split k ways
  but for a fixed part (docs/simulator.md, "Tensor parallelism").
* `time_share`: an engine (the k = 1 model, 64 sequences) and a trainer (about 1B parameters:
  bf16 weights, fp32 master weights and Adam moments) taking turns on the one GPU as verl's hybrid
  replicas do: the engine sleeps (KV cache freed, weights to pinned host memory), the trainer
  wakes and trains, the engine's weights wake, the trainer's new weights are copied into them, the
  trainer offloads, the KV cache comes back. Seconds and GPU memory freed or taken by each step.
* `pinned_staging`: host <-> GPU copies of `--staging-gib` in 64 MiB chunks and whole, from
  pinned and from pageable host memory.

    python benchmarks/gpu_decode.py                          # on a GPU machine (about 1-2 minutes)
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
BUDGET_SPENT = "time budget (--budget-s) spent"


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    """Return cached blocks to the driver, so that mem_get_info and the next case start clean."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def rand(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.bfloat16, scale: float = 0.02) -> torch.Tensor:
    """Small random values (never zeros: they hide unwritten outputs and can run faster)."""
    return torch.randn(shape, device=device, dtype=dtype) * scale


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Rank:
    """One TP-k rank's weights and KV cache, and its decode iteration (RMSNorm, fused QKV, attention
    of one new token per sequence over the cache, output projection, RMSNorm, gated MLP; the LM head).
    RoPE is skipped, and the new token's key and value are computed but not written into the cache:
    a cache of fixed size keeps the CUDA graph static, and one token of `ctx` is noise."""

    def __init__(self, g: dict[str, int], k: int, batch: int, ctx: int, device: str) -> None:
        h, hd = g["hidden"], g["head_dim"]
        # a rank holds heads/k query heads; KV heads are replicated once k exceeds them (as vLLM does)
        self.q, self.kv = g["heads"] // k, max(1, g["kv_heads"] // k)
        inter = g["inter"] // k
        self.batch, self.hd = batch, hd
        # distinct tensors per layer: one layer's weights reused 36 times would sit in L2, not HBM
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

    def kv_bytes(self) -> int:
        return nbytes([t for pair in self.cache for t in pair])

    def bytes_read(self) -> int:
        """The floor of one iteration's memory traffic: every weight and every cached key and value once."""
        return nbytes(self.weights()) + self.kv_bytes()

    def step(self) -> torch.Tensor:
        x, b, hd = self.x, self.batch, self.hd
        group = self.q // self.kv
        for layer, (kc, vc) in zip(self.layers, self.cache):
            qkv = F.rms_norm(x, (x.shape[-1],)) @ layer["qkv"]
            # GQA by reshaping the queries: each KV head's group of query heads becomes SDPA's query
            # "sequence", so K and V are read once (repeating them would read them `group` times)
            q = qkv[:, : self.q * hd].reshape(b, self.kv, group, hd)
            a = F.scaled_dot_product_attention(q, kc, vc)  # (batch, kv, group, hd): no mask, the whole cache
            x = x + a.reshape(b, self.q * hd) @ layer["o"]
            gate, up = (F.rms_norm(x, (x.shape[-1],)) @ layer["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return x @ self.lm


def time_ms(fn: Callable[[], Any], device: str, warmup: int = 5, reps: int = 20) -> tuple[float, str]:
    """Median milliseconds of `fn`: a CUDA graph replayed and timed with events on a GPU (eager if
    capture fails), the wall clock on a CPU."""
    if device != "cuda":
        for _ in range(2):  # the first calls pay for lazy initialisation and page faults
            fn()
        times = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times), "eager"
    mode, run = "graph", fn
    try:
        # warm up on a side stream, as capture requires (cuBLAS workspaces, SDPA kernels chosen)
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
                cases.append({"k": k, "batch": batch, "skipped": BUDGET_SPENT})
                continue
            rank: Rank | None = None
            try:
                rank = Rank(g, k, batch, ctx, device)
                ms, mode = time_ms(rank.step, device)
                moved = rank.bytes_read()
                cases.append({"k": k, "batch": batch, "ctx": ctx, "q_heads": rank.q, "kv_heads": rank.kv,
                              "ms_per_iter": round(ms, 4), "timing": mode, "bytes_read": moved,
                              "achieved_gbps": round(moved / (ms / 1000) / 1e9, 1)})
                log(f"tp k={k} batch={batch}: {ms:.3f} ms ({mode})")
            except torch.OutOfMemoryError:
                cases.append({"k": k, "batch": batch, "ctx": ctx, "error": "oom"})
                log(f"tp k={k} batch={batch}: out of memory")
            finally:
                rank = None  # drop the rank before the next one is built, OOM or not
                free(device)
    ratios: dict[str, dict[str, float]] = {}
    for batch in batches:
        by_k = {c["k"]: c["ms_per_iter"] for c in cases if c.get("batch") == batch and "ms_per_iter" in c}
        if 1 in by_k:
            ratios[str(batch)] = {f"tp{k}": round(by_k[1] / v, 3) for k, v in sorted(by_k.items())}
    return {"model": g, "dtype": "bfloat16", "ctx": ctx, "cases": cases, "speedup_vs_tp1_per_rank": ratios,
            "gqa": "queries reshaped to (batch, kv heads, query heads per kv head, head_dim) for SDPA: "
                   "K and V read once, not repeated",
            "not_measured": "the all-reduces between ranks (two per layer per iteration): one GPU cannot run two "
                            "NCCL ranks; a TP-k engine's iteration is this plus them. RoPE and the KV-cache write "
                            "of the new token are left out too"}


def can_pin(device: str) -> bool:
    """Pinned host memory needs a CUDA build with a GPU: CPU builds raise on pin_memory=True."""
    if device != "cuda":
        return False
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


class Trainer:
    """The training side of a hybrid replica: a stack of square bf16 matrices (about `params`
    parameters) trained in mixed precision as FSDP and Megatron do, with fp32 master weights and
    fp32 Adam moments: 2 + 4 + 4 + 4 bytes a parameter to move when it offloads."""

    def __init__(self, params: int, width: int, batch: int, device: str) -> None:
        n = max(1, params // (width * width))
        # built on the device (building 1B parameters on the host first takes seconds); a
        # 1/sqrt(width) scale keeps activations near 1 through the stack
        self.weights = [rand((width, width), device, scale=width ** -0.5).requires_grad_() for _ in range(n)]
        self.master = [w.detach().float() for w in self.weights]
        self.opt = torch.optim.Adam(self.master, lr=1e-4)
        self.x = rand((batch, width), device, scale=1.0)
        self.step()  # Adam's moments exist from here on

    def step(self) -> None:
        h = self.x
        for w in self.weights:
            h = h @ w
        h.float().pow(2).mean().backward()
        for w, m in zip(self.weights, self.master):
            m.grad, w.grad = w.grad.float(), None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, m in zip(self.weights, self.master):
                w.copy_(m)

    def tensors(self) -> list[torch.Tensor]:
        # the objects themselves (not `p.data`, a fresh alias each call): `offload` swaps their storage
        out = self.weights + self.master
        for state in self.opt.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        return out


def gpu_memory(device: str) -> dict[str, float]:
    if device != "cuda":
        return {}
    free_b, _ = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated() / GIB, "reserved": torch.cuda.memory_reserved() / GIB,
            "free": free_b / GIB}


def offload(tensors: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """Each tensor's bytes to its host buffer, then its GPU storage dropped (vLLM's sleep level 1
    for weights; FSDP's parameter and optimizer offload for a trainer)."""
    for t, h in zip(tensors, host):
        h.copy_(t, non_blocking=True)
    for t in tensors:  # the caching allocator orders the reuse after the copies: same stream
        t.data = torch.empty(0, device=t.device, dtype=t.dtype)


def restore(tensors: list[torch.Tensor], host: list[torch.Tensor], device: str) -> None:
    for t, h in zip(tensors, host):
        t.data = h.to(device, non_blocking=True)


def time_share(g: dict[str, int], device: str, ctx: int, batch: int, trainer_params: int, width: int,
               cycles: int, train_steps: int, deadline: float) -> dict[str, Any]:
    pin = can_pin(device)
    engine = Rank(g, 1, batch, ctx, device)
    trainer = Trainer(trainer_params, width, 256 if device == "cuda" else 16, device)
    weights = engine.weights()
    engine_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in weights]
    trainer_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in trainer.tensors()]
    report: dict[str, Any] = {
        "pinned": pin, "pinned_note": None if pin else "no pinned memory on this device/build: pageable host buffers",
        "engine": {"layers": g["layers"], "batch": batch, "ctx": ctx, "weights_bytes": nbytes(weights),
                   "kv_bytes": engine.kv_bytes(), "weights_gib": round(nbytes(weights) / GIB, 2),
                   "kv_gib": round(engine.kv_bytes() / GIB, 2)},
        "trainer": {"params": sum(w.numel() for w in trainer.weights), "layers": len(trainer.weights), "width": width,
                    "state": "bf16 weights + fp32 master weights + fp32 Adam moments",
                    "state_bytes": nbytes(trainer.tensors()), "state_gib": round(nbytes(trainer.tensors()) / GIB, 2)},
        "order": "verl's: engine KV freed, engine weights to host, trainer wakes and trains, engine weights wake, "
                 "weight sync on the GPU, trainer offloads, KV cache back",
        "memory_note": "per transition: [before, after] GiB; gpu_freed_gib = change in mem_get_info free "
                       "(negative: taken); peak_allocated_gib: the allocator's peak during it; the allocator's "
                       "cache is emptied before each transition",
        "cycles": []}

    def transition(row: dict[str, Any], name: str, fn: Callable[[], Any], release: bool = False) -> None:
        free(device)  # start from an empty cache: what the step takes then shows in mem_get_info
        before = gpu_memory(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        if release:  # freeing is part of sleeping: vLLM and FSDP offload empty the cache
            free(device)
        sync(device)
        entry: dict[str, Any] = {"s": round(time.perf_counter() - t0, 4)}
        after = gpu_memory(device)
        if after:
            entry |= {f"{key}_gib": [round(before[key], 2), round(after[key], 2)] for key in after}
            entry["gpu_freed_gib"] = round(after["free"] - before["free"], 2)
            entry["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        row[name] = entry
        log(f"time_share {name}: {entry}")

    def decode_ms() -> float:
        ms, mode = time_ms(engine.step, device)  # a fresh graph each time: the storage moved
        report["decode_timing"] = mode
        free(device)
        return round(ms, 3)

    def drop_kv() -> None:
        engine.cache = []

    def weight_sync() -> None:
        # every engine weight overwritten from the trainer's bf16 weights, cycled: the same bytes as
        # vLLM's reload_weights, GPU to GPU
        src, i = [w.detach().reshape(-1) for w in trainer.weights], 0
        for t in weights:
            flat, n = t.view(-1), 0
            while n < flat.numel():
                part = src[i % len(src)][: flat.numel() - n]
                flat[n:n + part.numel()].copy_(part)
                n += part.numel()
                i += 1

    setup: dict[str, Any] = {}  # both start resident; the trainer goes to the host first
    transition(setup, "trainer_offload", lambda: offload(trainer.tensors(), trainer_host), release=True)
    report["setup"] = setup
    for cycle in range(cycles):
        if time.monotonic() > deadline:
            report["cycles"].append({"cycle": cycle, "skipped": BUDGET_SPENT})
            continue
        row: dict[str, Any] = {"cycle": cycle, "decode_ms_before": decode_ms()}
        transition(row, "engine_kv_free", drop_kv, release=True)
        transition(row, "engine_sleep", lambda: offload(weights, engine_host), release=True)
        transition(row, "trainer_wake", lambda: restore(trainer.tensors(), trainer_host, device))
        transition(row, f"trainer_train_{train_steps}_steps", lambda: [trainer.step() for _ in range(train_steps)])
        transition(row, "engine_wake", lambda: restore(weights, engine_host, device))
        transition(row, "weight_sync", weight_sync)
        transition(row, "trainer_offload", lambda: offload(trainer.tensors(), trainer_host), release=True)
        transition(row, "engine_kv_alloc", lambda: engine.alloc_cache(ctx, device))
        row["decode_ms_after"] = decode_ms()
        report["cycles"].append(row)
    del engine, trainer, engine_host, trainer_host, weights
    free(device)
    return report


def pinned_staging(device: str, gib: float, chunk_mib: float, deadline: float, reps: int = 3) -> dict[str, Any]:
    pin = can_pin(device)
    n, chunk = int(gib * GIB), int(chunk_mib * 1024 * 1024)
    dev = torch.randint(0, 255, (n,), device=device, dtype=torch.uint8)
    out: dict[str, Any] = {"bytes": n, "chunk_bytes": chunk, "reps": reps, "stat": "GB/s of the median rep",
                           "pinned_available": pin}
    if device != "cuda":
        out["note"] = "no GPU: tiny cpu -> cpu copies, to check the code runs; the numbers mean nothing"
    for kind in ("pinned", "pageable") if pin else ("pageable",):
        if time.monotonic() > deadline:
            out[f"{kind}_skipped"] = BUDGET_SPENT
            continue
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        # fault the pages in now: a first touch inside a timed copy measures page faults, not the bus
        host.fill_(1)
        blocking = kind != "pinned"  # only pinned memory copies asynchronously
        for direction in ("d2h", "h2d"):
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            for how in ("whole", "chunked"):
                times = []
                for _ in range(reps):
                    sync(device)
                    t0 = time.perf_counter()
                    if how == "whole":
                        dst.copy_(src, non_blocking=not blocking)
                    else:
                        for i in range(0, n, chunk):
                            dst[i:i + chunk].copy_(src[i:i + chunk], non_blocking=not blocking)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                out[f"{kind}_{direction}_{how}_gbps"] = round(n / statistics.median(times) / 1e9, 2)
        log(f"staging {kind}: done")
        del host
    del dev
    free(device)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a check that it runs)")
    p.add_argument("--only", default="tp_shard_decode,time_share,pinned_staging")
    p.add_argument("--ctx", type=int, default=1024, help="tokens cached per sequence (at most 64 with --smoke)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="past this many seconds, skip the cases, cycles and parts not yet started (said in the JSON)")
    p.add_argument("--staging-gib", type=float, default=4.0)
    args = p.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    smoke, dev = args.smoke, args.device
    g = TINY if smoke else QWEN3_8B
    ctx = min(args.ctx, 64) if smoke else args.ctx
    report: dict[str, Any] = {"device": dev, "gpu": torch.cuda.get_device_name() if dev == "cuda" else None,
                              "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": smoke,
                              "budget_s": args.budget_s}
    torch.manual_seed(0)
    parts: dict[str, Callable[[], Any]] = {
        "tp_shard_decode": lambda: tp_shard_decode(g, dev, ctx, [1, 4] if smoke else [1, 16, 64, 256], deadline),
        "time_share": lambda: time_share(g, dev, ctx, 4 if smoke else 64, 1 << 16 if smoke else 1 << 30,
                                         128 if smoke else 4096, cycles=2, train_steps=3, deadline=deadline),
        "pinned_staging": lambda: pinned_staging(dev, 0.01 if smoke else args.staging_gib, 1 if smoke else 64,
                                                 deadline),
    }
    try:
        report["copy_bandwidth_gbps"] = copy_bandwidth_gbps(dev, 0.01 if smoke else 4.0)
        report["copy_bandwidth_note"] = "one device-to-device copy, bytes read + written / time: achieved_gbps's ceiling"
    except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others
        report["copy_bandwidth_gbps"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        if name not in parts:
            report[name] = {"error": f"unknown part (known: {', '.join(parts)})"}
            continue
        if time.monotonic() > deadline:
            report[name] = {"skipped": BUDGET_SPENT}
            continue
        try:
            report[name] = parts[name]()
        except Exception as exc:  # noqa: BLE001 - as above
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        free(dev)
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
