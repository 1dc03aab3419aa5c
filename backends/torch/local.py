"""A training job on this machine without the daemon: a store host, one process per trainer
device, and the daemon's op sequences for a grow or a shrink issued directly.

The rank processes run the real `TrainerRank` and the same op handlers the worker client
calls; only the transport differs (a pipe instead of ZeroMQ). Used by the runnable example's
standalone mode, the benchmark and the tests. The sequences are the core's
(`plan_resize`): JOIN, RESTORE, COMMIT to grow; DRAIN, RELEASE, COMMIT to shrink; and on a
failure the undo ops in reverse (EVICT; RECLAIM, RESUME). A loan (`plan_loan`, trainer side)
is a JOIN with plan LOAN, and its return DRAIN, RELEASE with plan RETURN; no commit. A trainer
lent to the rollout (`lend_to_rollout`) is DRAIN, RELEASE with plan LOAN, and home JOIN with
plan RETURN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any

import msgspec
import structlog

from dynaresized import wire
from dynaresized.backends.torch.store import StoreAddress, StoreHost
from dynaresized.domain import OpKind, PlanKind, Pool

# forkserver: one server process imports torch once and forks each rank from it, so a rank
# starts in milliseconds instead of re-importing torch (1-2 s of CPU on a small machine).
_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "dynaresized.backends.torch.trainer"])


def process_context() -> Any:
    """The multiprocessing context trainer processes start from (forkserver, torch preloaded)."""
    return _ctx


class RankSpec(msgspec.Struct, frozen=True):
    config: Any  # TrainerConfig (kept Any so this module imports without torch)
    job: str  # "package.module:Class"
    job_options: dict[str, Any]
    store: StoreAddress
    log_level: str = "warning"


class OpOutcome(msgspec.Struct, frozen=True):
    device: str
    kind: OpKind
    ok: bool
    detail: str


class ResizeOutcome(msgspec.Struct, frozen=True):
    resize_id: str
    ok: bool
    training: tuple[str, ...]  # the training pool afterwards (the old one if rolled back)
    ops: tuple[OpOutcome, ...]
    seconds: float

    def failures(self) -> list[OpOutcome]:
        return [o for o in self.ops if not o.ok]


def load_job(path: str, options: dict[str, Any]) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"job {path!r} is not 'package.module:Class'")
    return getattr(importlib.import_module(module), name)(**options)


# -- the rank process ---------------------------------------------------------------------------
def _rank_main(spec_bytes: bytes, conn: multiprocessing.connection.Connection) -> None:
    from dynaresized.backends.torch.trainer import TrainerConfig, TrainerRank

    spec = msgspec.msgpack.decode(spec_bytes, type=RankSpec)
    config = msgspec.convert(spec.config, TrainerConfig)
    level = getattr(logging, spec.log_level.upper())
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level),
                        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper("iso"),
                                    structlog.processors.format_exc_info,
                                    structlog.processors.JSONRenderer()])
    try:
        rank = TrainerRank(config, load_job(spec.job, spec.job_options), spec.store)
        report = rank.prepare()
    except Exception as exc:
        conn.send(("prepared", 0, False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("prepared", 0, True, report))
    rank.start()
    asyncio.run(_serve(rank, conn))


async def _serve(rank: Any, conn: multiprocessing.connection.Connection) -> None:
    loop = asyncio.get_running_loop()
    handlers = rank.handlers()
    tasks: set[asyncio.Task[None]] = set()
    send_lock = asyncio.Lock()

    async def reply(*msg: Any) -> None:
        async with send_lock:
            conn.send(msg)

    async def run_op(req: int, data: bytes) -> None:
        op = msgspec.msgpack.decode(data, type=wire.OpCommand)
        try:
            detail = await asyncio.wait_for(handlers[op.kind](op), timeout=op.timeout_s)
            await reply("op", req, True, detail)
        except TimeoutError:
            await reply("op", req, False, f"{op.kind.value} did not finish within {op.timeout_s:.1f}s")
        except Exception as exc:  # reported to the caller as the op's failure, like the worker client does
            await reply("op", req, False, f"{type(exc).__name__}: {exc}")

    while True:
        try:
            msg = await loop.run_in_executor(None, conn.recv)
        except EOFError:  # the launcher is gone
            rank.close()
            return
        kind, req = msg[0], msg[1]
        if kind == "op":
            task = asyncio.create_task(run_op(req, msg[2]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif kind == "view":
            await reply("view", req, True, msgspec.to_builtins(rank.view))
        elif kind == "history":
            await reply("history", req, True, msgspec.to_builtins(rank.history))
        elif kind == "switches":
            await reply("switches", req, True, msgspec.to_builtins(rank.switches))
        elif kind == "stop_at":
            rank.request_stop(msg[2])
            await reply("stop_at", req, True, None)
        elif kind == "wait":
            view = await loop.run_in_executor(None, rank.wait, msg[2])
            await reply("wait", req, True, msgspec.to_builtins(view))
        elif kind == "close":
            await loop.run_in_executor(None, rank.close)
            await reply("close", req, True, None)
            return


# -- the launcher side ------------------------------------------------------------------------------
class RankProcess:
    """One trainer rank in a child process, and a blocking handle on it."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.device: str = spec.config.device if hasattr(spec.config, "device") else spec.config["device"]
        self._conn, child = _ctx.Pipe()
        self.process = _ctx.Process(target=_rank_main, args=(msgspec.msgpack.encode(spec), child), daemon=True,
                                    name=f"trainer-{self.device}")
        self._child = child
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.prepared: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pending[0] = self.prepared

    def start(self) -> None:
        self.process.start()
        self._child.close()
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.device}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, req, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(req, None)
            if future is None:
                continue
            if kind == "op":
                future.set_result((ok, payload))
            elif ok:
                future.set_result(payload)
            else:
                future.set_exception(RuntimeError(f"{self.device}: {payload}"))
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(RuntimeError(f"trainer process for {self.device} exited "
                                                  f"(exit code {self.process.exitcode})"))

    def _request(self, kind: str, *args: Any) -> concurrent.futures.Future[Any]:
        req = next(self._ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._pending[req] = future
        try:
            self._conn.send((kind, req, *args))
        except (OSError, BrokenPipeError) as exc:
            with self._lock:
                self._pending.pop(req, None)
            future.set_exception(RuntimeError(f"trainer process for {self.device} is gone: {exc}"))
        return future

    def op(self, op: wire.OpCommand) -> concurrent.futures.Future[tuple[bool, str]]:
        return self._request("op", msgspec.msgpack.encode(op))

    def view(self, timeout: float = 30) -> dict[str, Any]:
        return self._request("view").result(timeout)

    def history(self, timeout: float = 30) -> list[dict[str, Any]]:
        return self._request("history").result(timeout)

    def switches(self, timeout: float = 30) -> list[dict[str, Any]]:
        return self._request("switches").result(timeout)

    def stop_at(self, step: int, timeout: float = 30) -> None:
        self._request("stop_at", step).result(timeout)

    def wait(self, timeout: float) -> dict[str, Any]:
        return self._request("wait", timeout).result(timeout + 30)

    def close(self, timeout: float = 30) -> None:
        if self.process.pid is None:  # never started
            self._conn.close()
            return
        if self.process.is_alive():
            try:
                self._request("close").result(timeout)
            except (RuntimeError, concurrent.futures.TimeoutError):
                pass  # it died or hung while closing; it is killed below either way
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._conn.close()

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to say goodbye (failure tests)."""
        if self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)


class LocalJob:
    """A store host plus one `RankProcess` per trainer device."""

    def __init__(self, config: Any, job: str, job_options: dict[str, Any] | None = None, *,
                 log_level: str = "warning", op_timeout_s: float = 60.0) -> None:
        self.base = config  # a TrainerConfig; `device` is replaced per rank
        self.host = StoreHost()
        self.op_timeout_s = op_timeout_s
        self.ranks: dict[str, RankProcess] = {}
        for device in config.devices:
            cfg = msgspec.structs.replace(config, device=device)
            self.ranks[device] = RankProcess(RankSpec(config=msgspec.to_builtins(cfg), job=job,
                                                      job_options=job_options or {}, store=self.host.address,
                                                      log_level=log_level))
        self.training: tuple[str, ...] = tuple(d for d in config.devices if d in config.initial)
        self._resizes = itertools.count(1)
        self.resizes: list[ResizeOutcome] = []

    def start(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        for r in self.ranks.values():
            r.start()
        reports = []
        for device, r in self.ranks.items():
            try:
                reports.append(r.prepared.result(timeout))
            except RuntimeError as exc:
                raise RuntimeError(f"trainer for {device} failed to start: {exc}") from None
        return reports

    @property
    def rollout(self) -> tuple[str, ...]:
        return tuple(d for d in self.base.devices if d not in self.training)

    def _command(self, resize_id: str, index: int, kind: OpKind, devices: tuple[str, ...], from_pool: Pool,
                 training: tuple[str, ...], plan: PlanKind = PlanKind.RESIZE) -> wire.OpCommand:
        return wire.OpCommand(op_id=f"{resize_id}/{index}-{kind.value}", resize_id=resize_id, kind=kind,
                              devices=devices, from_pool=from_pool, to_pool=from_pool.other,
                              timeout_s=self.op_timeout_s, training=training,
                              rollout=tuple(d for d in self.base.devices if d not in training), plan=plan)

    def _send(self, resize_id: str, index: int, kind: OpKind, devices: tuple[str, ...], targets: tuple[str, ...],
              from_pool: Pool, training: tuple[str, ...], plan: PlanKind = PlanKind.RESIZE) -> list[OpOutcome]:
        cmd = self._command(resize_id, index, kind, devices, from_pool, training, plan)
        futures = {d: self.ranks[d].op(cmd) for d in targets if self.ranks[d].process.is_alive()}
        outcomes = []
        for d, fut in futures.items():
            try:
                ok, detail = fut.result(self.op_timeout_s + 30)
            except RuntimeError as exc:
                ok, detail = False, str(exc)
            outcomes.append(OpOutcome(device=d, kind=kind, ok=ok, detail=detail))
        return outcomes

    def resize(self, devices: tuple[str, ...], to_pool: Pool, *, abort_after: OpKind | None = None) -> ResizeOutcome:
        """Move `devices` into `to_pool` with the op sequence the daemon would send. With
        `abort_after`, roll back once that op succeeded (an operator's abort)."""
        started = time.perf_counter()
        rid = f"r{next(self._resizes)}"
        devices = tuple(sorted(devices))
        from_pool = to_pool.other
        before = self.training
        if to_pool is Pool.TRAINING:
            after = tuple(d for d in self.base.devices if d in before or d in devices)
            forward = [(OpKind.JOIN, devices), (OpKind.RESTORE, devices), (OpKind.COMMIT, after)]
        else:
            after = tuple(d for d in before if d not in devices)
            forward = [(OpKind.DRAIN, devices), (OpKind.RELEASE, devices), (OpKind.COMMIT, after)]
        ops: list[OpOutcome] = []
        for i, (kind, targets) in enumerate(forward):
            outcomes = self._send(rid, i, kind, devices, targets, from_pool, after)
            ops += outcomes
            if (not all(o.ok for o in outcomes) or kind is abort_after) and kind is not OpKind.COMMIT:
                ops += self._roll_back(rid, forward[: i + 1], devices, from_pool, before)
                outcome = ResizeOutcome(rid, False, before, tuple(ops), time.perf_counter() - started)
                self.resizes.append(outcome)
                return outcome
        self.training = after
        outcome = ResizeOutcome(rid, all(o.ok for o in ops), after, tuple(ops), time.perf_counter() - started)
        self.resizes.append(outcome)
        return outcome

    def _roll_back(self, rid: str, done: list[tuple[OpKind, tuple[str, ...]]], devices: tuple[str, ...],
                   from_pool: Pool, before: tuple[str, ...], plan: PlanKind = PlanKind.RESIZE) -> list[OpOutcome]:
        undo = {OpKind.DRAIN: OpKind.RESUME, OpKind.RELEASE: OpKind.RECLAIM, OpKind.JOIN: OpKind.EVICT}
        ops: list[OpOutcome] = []
        for i, (kind, targets) in enumerate(reversed(done)):
            if kind in undo:
                ops += self._send(rid, 100 + i, undo[kind], devices, targets, from_pool, before, plan)
        return ops

    def lend(self, *devices: str, abort: bool = False) -> ResizeOutcome:
        """Lend `devices` to training for the rest of the RL step (the trainer side of the core's
        `plan_loan`): JOIN with plan LOAN; on a failure, or with `abort` once it succeeded, the
        daemon's rollback (EVICT). The home pool (`training`) does not change."""
        started = time.perf_counter()
        rid = f"l{next(self._resizes)}"
        devices = tuple(sorted(devices))
        during = tuple(d for d in self.base.devices if d in self.training or d in devices)
        ops = self._send(rid, 2, OpKind.JOIN, devices, devices, Pool.ROLLOUT, during, PlanKind.LOAN)
        ok = all(o.ok for o in ops)
        if not ok or abort:
            ops += self._send(rid, 100, OpKind.EVICT, devices, devices, Pool.ROLLOUT, self.training, PlanKind.LOAN)
        outcome = ResizeOutcome(rid, ok and not abort, self.training, tuple(ops), time.perf_counter() - started)
        self.resizes.append(outcome)
        return outcome

    def return_loan(self, *devices: str) -> ResizeOutcome:
        """The loan goes home at the RL-step boundary: DRAIN and RELEASE with plan RETURN (the
        ranks have usually left already, at the boundary, and say so)."""
        started = time.perf_counter()
        rid = f"l{next(self._resizes)}-home"
        devices = tuple(sorted(devices))
        ops: list[OpOutcome] = []
        for i, kind in enumerate((OpKind.DRAIN, OpKind.RELEASE)):
            ops += self._send(rid, i, kind, devices, devices, Pool.TRAINING, self.training, PlanKind.RETURN)
        outcome = ResizeOutcome(rid, all(o.ok for o in ops), self.training, tuple(ops), time.perf_counter() - started)
        self.resizes.append(outcome)
        return outcome

    def lend_to_rollout(self, *devices: str) -> ResizeOutcome:
        """Lend training `devices` to the rollout until the next RL step (the trainer side of the
        core's `plan_loan` to the rollout): DRAIN and RELEASE with plan LOAN; the ranks stay
        members, parked before the next RL step (lending.py). On a failure, the undo ops."""
        started = time.perf_counter()
        rid = f"t{next(self._resizes)}"
        devices = tuple(sorted(devices))
        forward = [(OpKind.DRAIN, devices), (OpKind.RELEASE, devices)]
        ops: list[OpOutcome] = []
        for i, (kind, targets) in enumerate(forward):
            outcomes = self._send(rid, i, kind, devices, targets, Pool.TRAINING, self.training, PlanKind.LOAN)
            ops += outcomes
            if not all(o.ok for o in outcomes):
                ops += self._roll_back(rid, forward[: i + 1], devices, Pool.TRAINING, self.training, PlanKind.LOAN)
                break
        outcome = ResizeOutcome(rid, all(o.ok for o in ops), self.training, tuple(ops), time.perf_counter() - started)
        self.resizes.append(outcome)
        return outcome

    def home_from_rollout(self, *devices: str) -> ResizeOutcome:
        """The trainers lent to the rollout come home at the step boundary: JOIN with plan RETURN."""
        started = time.perf_counter()
        rid = f"t{next(self._resizes)}-home"
        devices = tuple(sorted(devices))
        ops = self._send(rid, 2, OpKind.JOIN, devices, devices, Pool.ROLLOUT, self.training, PlanKind.RETURN)
        outcome = ResizeOutcome(rid, all(o.ok for o in ops), self.training, tuple(ops), time.perf_counter() - started)
        self.resizes.append(outcome)
        return outcome

    def grow(self, *devices: str, abort_after: OpKind | None = None) -> ResizeOutcome:
        return self.resize(tuple(devices), Pool.TRAINING, abort_after=abort_after)

    def shrink(self, *devices: str, abort_after: OpKind | None = None) -> ResizeOutcome:
        return self.resize(tuple(devices), Pool.ROLLOUT, abort_after=abort_after)

    def command(self, kind: OpKind, devices: tuple[str, ...], training: tuple[str, ...],
                resize_id: str | None = None) -> wire.OpCommand:
        """One op as the daemon would send it (for driving ranks op by op)."""
        rid = resize_id or f"r{next(self._resizes)}"
        from_pool = Pool.ROLLOUT if kind in (OpKind.JOIN, OpKind.RESTORE, OpKind.EVICT) else Pool.TRAINING
        return self._command(rid, list(OpKind).index(kind), kind, devices, from_pool, training)

    def stop_at(self, step: int) -> None:
        self.ranks[self.training[0]].stop_at(step)

    def close(self) -> None:
        # Members stop together at their next boundary, so none sees the others vanish
        # mid-collective (which would look like a failure and start a recovery).
        from dynaresized.backends.torch.membership import Registry

        Registry(self.host.store, self.host.address.prefix).request_stop(0)
        for r in self.ranks.values():
            if r.process.pid is not None and r.process.is_alive():
                try:
                    r.wait(30)
                except (RuntimeError, concurrent.futures.TimeoutError):
                    pass  # closed (and if need be killed) below
        for r in self.ranks.values():
            r.close()
        self.host.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
