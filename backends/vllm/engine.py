"""One vLLM engine (`AsyncLLM`) and its life cycle: start, generate, abort, reload, release.

`RolloutEngine` owns one `AsyncLLM` and knows which policy version its weights are. Release
and join depend on the device type, found from vLLM's platform:

* GPU: `sleep(level)` drops the KV cache (level 1 also offloads weights to host memory,
  level 2 discards them) and `wake_up()` brings them back. The engine process is kept.
* CPU: sleep frees nothing (and `enable_sleep_mode` is refused), so release shuts the engine
  down and join starts it again. `ProcessMode.IN_PROCESS` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
  runs the model inside the engine-core process and starts faster than `MULTI_PROCESS`,
  which adds a separate worker process.

A loan (the device serves the training step in progress until the step boundary) takes the
cheap way: `lend()` sleeps a GPU engine (the trainer needs its memory), and pauses a CPU one
(vLLM's `pause_generation`: the engine stays loaded, its scheduler admits nothing and its
core process blocks waiting for input, spending no CPU time, which is what a CPU device is
short of); `join()` resumes it in milliseconds instead of a restart's seconds.

vLLM is imported lazily, so importing this module does not need the `vllm` extra.
Blocking vLLM calls (start, shutdown) run in a thread so the event loop keeps serving
heartbeats and the other engines meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog

log = structlog.get_logger("dynaresized.backends.vllm")

# vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING from the environment when it spawns the engine
# core; starts are serialized so that one engine's mode never leaks into another's.
_START_LOCK = threading.Lock()


class ProcessMode(str, enum.Enum):
    IN_PROCESS = "in-process"  # the engine-core process runs the model itself
    MULTI_PROCESS = "multi-process"  # engine core + a separate model worker process


class DeviceType(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class EngineState(str, enum.Enum):
    STOPPED = "stopped"
    RUNNING = "running"
    SLEEPING = "sleeping"  # GPU only: weights/KV cache released, process kept
    PAUSED = "paused"  # lent (CPU): loaded, scheduler paused, admits nothing, core process idle
    DEAD = "dead"  # the engine core died (EngineDeadError) or stopped answering


class EngineConfig(msgspec.Struct, frozen=True):
    """How to start one engine. `model` is a local directory (config, tokenizer, weights)."""

    model: str
    kv_cache_memory_bytes: int = 64 * 1024 * 1024  # vLLM's default reserves 92% of RAM on CPU
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    process_mode: ProcessMode = ProcessMode.IN_PROCESS
    device_type: DeviceType | None = None  # None: whatever vLLM's platform is
    sleep_level: int = 1  # GPU release: 1 offloads weights to host, 2 discards them
    base_version: int = 0  # the policy version of the weights in `model`
    shutdown_timeout_s: float = 5.0
    tensor_parallel_size: int = 1
    """Devices (CPU: cores) of the engine, one vLLM worker process each beyond the first."""
    cpu_cores: tuple[int, ...] = ()
    """CPU only: the core of each tensor-parallel rank (`VLLM_CPU_OMP_THREADS_BIND`, one core a
    rank). Empty: rank i takes the i-th core this process may run on. vLLM's own choice binds
    ranks to NUMA nodes and refuses more ranks than nodes ("Not enough allowed NUMA nodes to
    bind threads of 2 local CPUWorkers"), which is every TP engine on a one-node machine."""

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_cores and len(self.cpu_cores) != self.tensor_parallel_size:
            raise ValueError(f"cpu_cores names {len(self.cpu_cores)} core(s) for "
                             f"{self.tensor_parallel_size} tensor-parallel rank(s): one a rank")

    def thread_binding(self) -> str:
        """`VLLM_CPU_OMP_THREADS_BIND` for this engine's ranks: "0|1" binds rank 0 to core 0,
        rank 1 to core 1."""
        cores = self.cpu_cores or _default_cores(self.tensor_parallel_size)
        return "|".join(str(c) for c in cores)


def _default_cores(ranks: int) -> tuple[int, ...]:
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed[i % len(allowed)] for i in range(ranks))


class SampleRequest(msgspec.Struct, frozen=True):
    """One sample of a rollout step. `seed` makes a regenerated sample the same draw."""

    sample_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"sample {self.sample_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"sample {self.sample_id!r}: max_tokens must be >= 1, got {self.max_tokens}")


class Generated(msgspec.Struct, frozen=True):
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length" or "abort"
    policy_version: int  # the version loaded while this request ran


class EngineFailure(RuntimeError):
    """The engine cannot serve: it died (EngineDeadError), or is not running."""

    def __init__(self, engine_id: str, reason: str) -> None:
        self.engine_id = engine_id
        self.reason = reason
        super().__init__(f"engine {engine_id}: {reason}")


def detect_device_type() -> DeviceType:
    from vllm.platforms import current_platform

    return DeviceType.CPU if current_platform.is_cpu() else DeviceType.GPU


def _is_engine_dead(exc: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


class RolloutEngine:
    """One vLLM engine; what the router places samples on and the worker releases and joins."""

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        if not Path(config.model).is_dir():
            raise FileNotFoundError(f"engine {engine_id}: model directory {config.model} does not exist")
        self.engine_id = engine_id
        self.config = config
        self.device_type = config.device_type or detect_device_type()
        self.state = EngineState.STOPPED
        self.loaded_version: int | None = None
        self.starts = 0
        self.outputs = 0  # output chunks received, all requests together: progress the health watch sees
        self._llm: Any = None
        self._lock = asyncio.Lock()  # one life-cycle change at a time

    # -- life cycle -----------------------------------------------------------------------
    def reconfigure(self, config: EngineConfig) -> None:
        """Start with `config` from the next start on (a regroup changes the engine's tensor
        parallelism): only while the engine is stopped, since a running vLLM engine cannot
        change its number of ranks."""
        if self.state not in (EngineState.STOPPED, EngineState.DEAD):
            raise RuntimeError(f"engine {self.engine_id} is {self.state.value}: stop it before reconfiguring")
        self.config = config

    async def start(self) -> float:
        """Start the engine with the base weights; returns seconds taken."""
        async with self._lock:
            if self.state in (EngineState.RUNNING, EngineState.SLEEPING, EngineState.PAUSED):
                return 0.0
            if self.state is EngineState.DEAD:
                await self._shutdown_quietly()
            started = time.perf_counter()
            # The engine comes back through a list, not as the thread's result: the thread's
            # frame that sets the result stays referenced after the start (seen with vLLM 0.32
            # on CPU) and kept the engine alive until the interpreter's exit, where its __del__
            # printed a traceback (tests/backends/vllm/test_vllm_worker.py checks the exit).
            made: list[Any] = []
            await asyncio.to_thread(lambda: made.append(self._make_llm()))
            self._llm = made.pop()
            self.state = EngineState.RUNNING
            self.loaded_version = self.config.base_version
            self.starts += 1
            seconds = time.perf_counter() - started
            log.info("engine started", engine=self.engine_id, mode=self.config.process_mode.value, seconds=seconds)
            return seconds

    def _make_llm(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from dynaresized.backends.vllm.logs import drop_harmless_reload_warning

        drop_harmless_reload_warning()  # once per reload per engine otherwise; see logs.py for why harmless

        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=self.config.dtype,
            seed=self.config.seed,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            max_model_len=self.config.max_model_len,
            enforce_eager=True,
            disable_log_stats=True,
            enable_sleep_mode=self.device_type is DeviceType.GPU,
            tensor_parallel_size=self.config.tensor_parallel_size,
            distributed_executor_backend="mp" if self.config.tensor_parallel_size > 1 else None,
        )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.config.process_mode is ProcessMode.IN_PROCESS else "1"}
        if self.device_type is DeviceType.CPU and self.config.tensor_parallel_size > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.config.thread_binding()
        with _START_LOCK:
            previous = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the worker processes vLLM spawns inherit them
            try:
                return AsyncLLM.from_engine_args(args)
            finally:
                for key, value in previous.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

    async def stop(self) -> float:
        """Shut the engine down (its process exits); returns seconds taken."""
        async with self._lock:
            started = time.perf_counter()
            await self._shutdown_quietly()
            self.state = EngineState.STOPPED
            self.loaded_version = None
            return time.perf_counter() - started

    async def _shutdown_quietly(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        handler = getattr(llm, "output_handler", None)
        if handler is not None and llm.get_num_unfinished_requests() == 0:
            # vLLM cancels its output handler only after the engine core has gone, and the
            # handler logs that as "AsyncLLM output_handler failed" (EngineDeadError) on every
            # ordinary stop. With no request left to tell, stop listening first. (With requests
            # in flight the handler stays: it is what fails them with EngineDeadError.)
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(llm.shutdown, self.config.shutdown_timeout_s)

    async def release(self) -> float:
        """Give the device up: sleep on a GPU, shut down on a CPU. Returns seconds taken."""
        if self.device_type is DeviceType.CPU:
            return await self.stop()
        async with self._lock:
            if self.state is not EngineState.RUNNING:
                return 0.0
            started = time.perf_counter()
            await self._llm.sleep(level=self.config.sleep_level)
            self.state = EngineState.SLEEPING
            if self.config.sleep_level == 2:
                self.loaded_version = None  # weights discarded: restore must reload them
            return time.perf_counter() - started

    async def lend(self) -> float:
        """Give the device to the training step in progress until the step boundary: sleep on a
        GPU, pause on a CPU (loaded, admitting nothing, not using the CPU). Returns seconds taken."""
        if self.device_type is DeviceType.GPU:
            return await self.release()
        async with self._lock:
            if self.state is not EngineState.RUNNING:
                return 0.0
            started = time.perf_counter()
            # "abort" is a safety net only: the router drained the engine before it is lent, so
            # no request of the step is left on it. The KV and prefix caches stay (clear_cache
            # False): on a CPU they are host memory nobody else is waiting for.
            await self._llm.pause_generation(mode="abort", clear_cache=False)
            self.state = EngineState.PAUSED
            return time.perf_counter() - started

    async def join(self) -> float:
        """Take the device back: resume a paused engine, wake a sleeping one on a GPU, start one
        on a CPU. Returns seconds taken."""
        async with self._lock:
            if self.state is EngineState.PAUSED:
                started = time.perf_counter()
                await self._llm.resume_generation()
                self.state = EngineState.RUNNING
                return time.perf_counter() - started
        if self.device_type is DeviceType.CPU or self.state in (EngineState.STOPPED, EngineState.DEAD):
            return await self.start()
        async with self._lock:
            if self.state is not EngineState.SLEEPING:
                return 0.0
            started = time.perf_counter()
            await self._llm.wake_up()
            self.state = EngineState.RUNNING
            return time.perf_counter() - started

    # -- serving --------------------------------------------------------------------------
    def _require_running(self) -> Any:
        if self._llm is None and self.state is EngineState.RUNNING:
            raise EngineFailure(self.engine_id, "shutting down (a stop is in progress)")
        if self.state is not EngineState.RUNNING or self._llm is None:
            raise EngineFailure(self.engine_id, f"not running (state {self.state.value})")
        return self._llm

    async def generate(
        self, request: SampleRequest, request_id: str, on_tokens: Callable[[int], None] | None = None
    ) -> Generated:
        """Generate one sample; `on_tokens(n)` is told the response length as it grows."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._require_running()
        version = self.loaded_version
        assert version is not None, "a running engine always has a version"
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            ignore_eos=request.ignore_eos,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        tokens: list[int] = []
        finish_reason = "abort"
        try:
            async for out in llm.generate(
                {"prompt_token_ids": list(request.prompt_token_ids)}, params, request_id=request_id
            ):
                self.outputs += 1
                completion = out.outputs[0]
                tokens.extend(completion.token_ids)
                if on_tokens is not None:
                    on_tokens(len(tokens))
                if out.finished:
                    finish_reason = completion.finish_reason or "abort"
        except Exception as exc:
            if _is_engine_dead(exc) or self.state is EngineState.DEAD:
                self.state = EngineState.DEAD
                raise EngineFailure(self.engine_id, f"engine died: {type(exc).__name__}") from exc
            raise
        if self.loaded_version != version:
            raise RuntimeError(
                f"engine {self.engine_id}: weights changed from version {version} to "
                f"{self.loaded_version} while request {request_id} ran"
            )
        return Generated(tuple(tokens), finish_reason, version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids and self.state is EngineState.RUNNING and self._llm is not None:
            await self._llm.abort(list(request_ids))

    async def reload(self, version: int, weights_path: str | Path) -> float:
        """Load a published version in place at a step boundary; returns seconds taken."""
        async with self._lock:
            llm = self._require_running()
            started = time.perf_counter()
            try:
                # Only the path crosses the RPC: tensors as RPC arguments break the engine.
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
            except Exception as exc:
                if _is_engine_dead(exc):
                    self.state = EngineState.DEAD
                    raise EngineFailure(self.engine_id, "engine died during reload_weights") from exc
                raise
            self.loaded_version = version
            return time.perf_counter() - started

    async def ping(self, timeout_s: float) -> bool:
        """A heartbeat: the engine core answers a utility call within `timeout_s`."""
        llm = self._llm
        if llm is None or self.state is EngineState.DEAD:
            return False
        if llm.errored:
            self.state = EngineState.DEAD
            return False
        try:
            await asyncio.wait_for(llm.is_sleeping(), timeout_s)
        except TimeoutError:
            return False
        except Exception as exc:
            if _is_engine_dead(exc):
                self.state = EngineState.DEAD
                return False
            raise
        return True

    @property
    def changing(self) -> bool:
        """A start, stop, sleep, wake or reload is under way (the engine is not expected to answer)."""
        return self._lock.locked()

    def mark_dead(self) -> None:
        self.state = EngineState.DEAD

    def core_cpu_seconds(self) -> float:
        """CPU time (user + system) the engine-core process(es) used so far, from /proc: what
        tells an idle engine from one that spins."""
        ticks = 0
        for pid in self.core_pids:
            try:
                # the fields after the parenthesised command name; utime and stime are 14th and 15th
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue  # exited meanwhile: it spends nothing any more
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    @property
    def core_pids(self) -> list[int]:
        """Process ids of the engine-core process(es), for operators and failure tests."""
        if self._llm is None:
            return []
        manager = getattr(self._llm.engine_core.resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]

    async def close(self) -> None:
        await self.stop()
