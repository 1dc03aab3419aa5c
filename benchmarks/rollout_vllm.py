"""Benchmark the vLLM rollout backend on real engines; prints ONE JSON object.

* drain latency, from the drain command to the engine holding no request: with hand-over
  (near-done requests finish, the rest move) versus waiting for the engine's tail;
* release / restore time per mode: on CPU, shutdown + restart with the model inside the
  engine-core process (in-process) versus a separate worker process (multi-process); on a
  GPU, sleep level 1 and 2 + wake_up;
* weight reload time (`collective_rpc("reload_weights")` from the weight store);
* `loan`: the ways an engine can give its device to the training step in progress and take
  it back at the step boundary, on this device type. On a CPU: pause/resume (the path loans
  take), sleep/wake (vLLM's sleep without sleep mode) and a full release/restart (the
  resize path, from `release_restore`); for each, the wall time of release and of restore,
  the engine-core process's CPU share over an idle window (from /proc/<pid>/stat: does it
  spin?) and its resident memory (does it free any?), against an idle running engine and
  one generating.

Runs on the tiny Llama (tiny_model.py), so absolute numbers are about the machinery, not
the model. `--quick` does one repetition of everything. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _requests(step: int, rng: random.Random, count: int, tail: int, tail_tokens: int):
    from dynaresized.backends.vllm.engine import SampleRequest

    return [
        SampleRequest(
            sample_id=f"p{i}",
            prompt_token_ids=tuple(rng.randrange(4, 1024) for _ in range(6)),
            max_tokens=tail_tokens if i < tail else rng.randint(16, 48),
            seed=step * 1000 + i,
            ignore_eos=True,
        )
        for i in range(count)
    ]


async def _drain_trial(router, step: int, hand_over: bool, tail_tokens: int) -> dict[str, float]:
    """One step with a long tail; drain e1 once its requests are under way."""
    router.finish_within_tokens = 8 if hand_over else 1_000_000
    requests = _requests(step, random.Random(step), count=32, tail=6, tail_tokens=tail_tokens)
    started = time.perf_counter()
    run = asyncio.create_task(router.run_step(step, 0, requests))
    while not any(n >= 4 for n in router.in_flight("e1").values()):
        await asyncio.sleep(0.002)
    report = await router.drain("e1")
    result = await run
    await router.admit("e1")
    return {"drain_s": report.seconds, "handed_over": report.handed_over, "step_s": time.perf_counter() - started,
            "samples": len(result.samples)}


async def _release_restore(engine, store, version: int, device_type: str, level: int | None) -> dict[str, float]:
    release_s = await engine.release()
    join_s = await engine.join()
    reload_s = await engine.reload(version, store.path(version))
    out = {"release_s": release_s, "join_s": join_s, "restore_reload_s": reload_s}
    if level is not None:
        out["sleep_level"] = level
    return out


def _rss_mib(pids: list[int]) -> float:
    total_kib = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


async def _cpu_share(engine, seconds: float, work=None) -> float:
    """Share of one core the engine-core process used over `seconds` (while `work` runs, if given)."""
    before = engine.core_cpu_seconds()
    started = time.perf_counter()
    if work is None:
        await asyncio.sleep(seconds)
    else:
        await work
    return (engine.core_cpu_seconds() - before) / (time.perf_counter() - started)


async def _first_sample_s(engine, step: int) -> float:
    """Seconds for one 32-token request: that the engine serves, and how fast."""
    [request] = _requests(step, random.Random(step), count=1, tail=1, tail_tokens=32)
    started = time.perf_counter()
    await engine.generate(request, f"loan-check-{step}")
    return time.perf_counter() - started


async def _loan_paths(engine, reps: int, window_s: float) -> dict:
    """Pause/resume and sleep/wake of a loaded CPU engine, timed, with what each leaves running."""
    from dynaresized.backends.vllm.engine import EngineState

    pids = engine.core_pids
    busy = asyncio.gather(*(engine.generate(r, f"loan-busy-{r.sample_id}") for r in
                            _requests(900, random.Random(900), count=8, tail=8, tail_tokens=200)))
    out: dict = {
        "idle_window_s": window_s,
        "reference": {
            "generating_cpu_share": await _cpu_share(engine, 0.0, busy),
            "idle_running_cpu_share": await _cpu_share(engine, window_s),
            "rss_mib": _rss_mib(pids),
        },
    }
    lend, back, share, rss, before, after = [], [], [], [], [], []
    for rep in range(reps):
        before.append(await _first_sample_s(engine, 910 + rep))
        lend.append(await engine.lend())
        assert engine.state is EngineState.PAUSED
        share.append(await _cpu_share(engine, window_s))
        rss.append(_rss_mib(pids))
        back.append(await engine.join())
        after.append(await _first_sample_s(engine, 920 + rep))
    out["pause_resume"] = {
        "release_s_median": statistics.median(lend), "restore_s_median": statistics.median(back),
        "release_s_max": max(lend), "restore_s_max": max(back),
        "cpu_share_while_paused_median": statistics.median(share), "rss_mib_while_paused": max(rss),
        # one 32-token request just before each pause and just after each resume: a resumed
        # engine serves at once, and as fast as before
        "sample_before_pause_s_median": statistics.median(before),
        "sample_after_resume_s_median": statistics.median(after),
        "same_process": engine.core_pids == pids,
    }
    # vLLM's own sleep/wake, which the backend uses only on a GPU: on a CPU engine started without
    # sleep mode (vLLM refuses it there) it pauses the scheduler and frees nothing.
    sleep, wake, share, rss = [], [], [], []
    for _ in range(reps):
        started = time.perf_counter()
        await engine._llm.sleep(level=1)
        sleep.append(time.perf_counter() - started)
        share.append(await _cpu_share(engine, window_s))
        rss.append(_rss_mib(pids))
        started = time.perf_counter()
        await engine._llm.wake_up()
        wake.append(time.perf_counter() - started)
    out["sleep_wake"] = {
        "release_s_median": statistics.median(sleep), "restore_s_median": statistics.median(wake),
        "cpu_share_while_asleep_median": statistics.median(share), "rss_mib_while_asleep": max(rss),
        "sample_after_wake_s": await _first_sample_s(engine, 930), "same_process": engine.core_pids == pids,
    }
    return out


async def main(quick: bool) -> dict:
    from dynaresized.backends.vllm.engine import EngineConfig, ProcessMode, RolloutEngine, detect_device_type
    from dynaresized.backends.vllm.router import RequestRouter
    from dynaresized.backends.vllm.tiny_model import build_tiny_model, perturbed_weights
    from dynaresized.backends.vllm.weights import WeightStore

    reps = 1 if quick else 3
    work = Path(tempfile.mkdtemp(prefix="rollout-vllm-bench-"))
    model = build_tiny_model(work / "model")
    store = WeightStore(work / "weights")
    store.publish_checkpoint(0, model)
    store.publish(1, perturbed_weights(model, seed=1))
    device_type = detect_device_type()
    out: dict = {
        "benchmark": "rollout_vllm",
        "model": "tiny-llama hidden=128 layers=2 vocab=1024 fp32",
        "device_type": device_type.value,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "repetitions": reps,
    }

    router = RequestRouter(store, max_inflight=64)
    engines = {}
    start_s = {}
    for engine_id in ("e0", "e1"):
        engine = RolloutEngine(engine_id, EngineConfig(model=str(model)))
        start_s[engine_id] = await engine.start()
        router.add(engine)
        await router.admit(engine_id)
        engines[engine_id] = engine
    out["engine_start_s"] = start_s

    # -- drain: hand-over vs waiting for the tail -----------------------------------------
    tail_tokens = 400
    trials = {"hand_over": [], "wait_for_tail": []}
    step = 0
    for _ in range(reps):
        for mode in ("hand_over", "wait_for_tail"):
            step += 1
            trials[mode].append(await _drain_trial(router, step, mode == "hand_over", tail_tokens))
    out["drain"] = {
        "tail_tokens": tail_tokens,
        **{
            mode: {
                "drain_s_median": statistics.median(t["drain_s"] for t in runs),
                "step_s_median": statistics.median(t["step_s"] for t in runs),
                "handed_over_median": statistics.median(t["handed_over"] for t in runs),
                "runs": runs,
            }
            for mode, runs in trials.items()
        },
    }
    out["drain"]["speedup"] = (
        out["drain"]["wait_for_tail"]["drain_s_median"] / max(out["drain"]["hand_over"]["drain_s_median"], 1e-9)
    )

    # -- weight reload -------------------------------------------------------------------------
    reloads = []
    for i in range(5 if quick else 20):
        version = i % 2
        reloads.append(await engines["e0"].reload(version, store.path(version)))
    out["weight_reload_s"] = {"median": statistics.median(reloads), "max": max(reloads), "n": len(reloads)}

    # -- loan paths ----------------------------------------------------------------------------
    router.admitted.clear()  # nothing is placed from here on
    loan: dict = {"load_before": os.getloadavg()[0]}
    if device_type.value == "cpu":
        loan.update(await _loan_paths(engines["e1"], reps=3 if quick else 5, window_s=3.0 if quick else 5.0))
    else:
        loan["gpu"] = "a lent GPU engine sleeps (release_restore's sleep levels): its memory is what the trainer needs"
    loan["load_after"] = os.getloadavg()[0]

    # -- release / restore per mode ------------------------------------------------------------
    release: dict = {}
    if device_type.value == "cpu":
        release["in-process"] = await _release_restore(engines["e1"], store, 1, "cpu", None)
        await engines["e0"].stop()
        await engines["e1"].stop()
        multi = RolloutEngine("m0", EngineConfig(model=str(model), process_mode=ProcessMode.MULTI_PROCESS))
        first = await multi.start()
        release["multi-process"] = {"first_start_s": first, **await _release_restore(multi, store, 1, "cpu", None)}
        await multi.stop()
        release["gpu"] = "not measured: no GPU on this machine (sleep level 1/2 + wake_up run only on a GPU)"
    else:
        for level in (1, 2):
            engine = RolloutEngine(f"g{level}", EngineConfig(model=str(model), sleep_level=level))
            await engine.start()
            release[f"sleep-level-{level}"] = await _release_restore(engine, store, 1, "gpu", level)
            await engine.stop()
        for engine in engines.values():
            await engine.stop()
    out["release_restore"] = release
    if "in-process" in release:
        full = release["in-process"]
        loan["release_restart"] = {
            "release_s_median": full["release_s"], "restore_s_median": full["join_s"] + full["restore_reload_s"],
            "while_released": "the engine-core process has exited", "same_process": False,
        }
        paths = ("pause_resume", "sleep_wake", "release_restart")
        loan["round_trip_s"] = {k: loan[k]["release_s_median"] + loan[k]["restore_s_median"] for k in paths}
        loan["chosen"] = "pause_resume"
    out["loan"] = loan
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of everything")
    args = parser.parse_args()
    # vLLM and its engine-core processes log to stdout; keep stdout for the one JSON object.
    sys.stdout.flush()
    json_out = os.dup(1)
    os.dup2(2, 1)
    result = asyncio.run(main(args.quick))
    sys.stdout.flush()
    os.write(json_out, (json.dumps(result, sort_keys=True) + "\n").encode())
