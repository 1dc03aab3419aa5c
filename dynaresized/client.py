"""The worker client: what a vLLM engine wrapper or a trainer rank imports to attach.

    client = WorkerClient("tcp://127.0.0.1:5555", "trainer-0", WorkerKind.TRAINER_RANK, ("node0:gpu0",))
    client.on(OpKind.JOIN, handle_join)          # async def handle_join(op: OpRequest) -> str
    await client.start()                          # registers; heartbeats and ops run in the background
    await client.report_step(StepTiming(...))
    await client.close()

Operations are deduplicated by op id: a command the daemon re-sends (after a restart, or
because no answer came) is answered from the record of its first run, never run twice. If
the daemon restarts (a new boot id) or forgets the worker, the client registers again by
itself, with backoff. A worker that can say what it holds passes `actual=` (a function
returning an `ActualState`): the client sends it with hello, with every op result and when
the daemon asks, and the daemon then converges the worker with its log (reconciliation).
Each process names its connection `<worker_id>#<process>` and proves itself in every hello with
a secret of its own that only the daemon sees (docs/security.md): a reader of the event log,
which shows `process`, cannot say hello in its place.
`BlockingWorkerClient` offers the same for code without an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from dynaresized import wire
from dynaresized.domain import ActualState, OpKind, Pool, StepTiming, WorkerKind

log = structlog.get_logger("dynaresized.client")

_PERMANENT = {"unknown_device", "device_owned", "conflict", "bad_request", "duplicate_worker", "not_the_process"}


OpRequest = wire.OpCommand
"""An operation as a handler sees it."""


OpHandler = Callable[[OpRequest], Awaitable[str]]


def op_handlers(worker: object) -> dict[OpKind, OpHandler]:
    """A backend's handlers by naming convention: the async method named after each op kind
    (`drain`, `release`, `join`, ...) that the object has."""
    return {kind: getattr(worker, kind.value) for kind in OpKind if callable(getattr(worker, kind.value, None))}


class DaemonRejected(Exception):
    """The daemon refused this worker for good (wrong version, bad key, unknown or taken device)."""

    def __init__(self, error: wire.Error) -> None:
        self.error = error
        self.code = error.code
        self.reason = error.reason
        super().__init__(f"daemon refused {error.ref_type or 'message'}: {error.message}"
                         + (f" ({error.reason})" if error.reason else ""))


class DaemonUnavailable(TimeoutError):
    pass


class CurveKeys:
    """Client-side CURVE keys: this worker's key pair and the daemon's public key."""

    def __init__(self, secret_key_file: str | Path, server_public_key_file: str | Path) -> None:
        import zmq.auth

        for role, path in (("secret key", secret_key_file), ("daemon's public key", server_public_key_file)):
            if not Path(path).is_file():  # zmq.auth calls a missing file an "Invalid certificate file"
                missing = "is a directory" if Path(path).is_dir() else "does not exist"
                raise ValueError(f"the worker's {role} file {path} {missing} "
                                 "(`dynaresized keygen NAME --dir DIR` writes DIR/NAME.key and DIR/NAME.key_secret)")
        self.public, self.secret = zmq.auth.load_certificate(str(secret_key_file))
        self.server_public, _ = zmq.auth.load_certificate(str(server_public_key_file))
        if self.secret is None:
            raise ValueError(f"{secret_key_file} holds no secret key")


class WorkerClient:
    def __init__(self, endpoint: str, worker_id: str, kind: WorkerKind, devices: tuple[str, ...], *,
                 curve: CurveKeys | None = None, hello_timeout_s: float = 5.0,
                 max_backoff_s: float = 5.0, op_records: int = 1024,
                 actual: Callable[[], ActualState] | None = None) -> None:
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.kind = kind
        self.devices = tuple(devices)
        self.curve = curve
        self.hello_timeout_s = hello_timeout_s
        self.max_backoff_s = max_backoff_s
        self.handlers: dict[OpKind, OpHandler] = {}
        self.incarnation = 0
        self.process = uuid.uuid4().hex  # tells the daemon a restarted worker from a reconnecting one
        wire.identity_of(worker_id, self.process)  # a ValueError here, before anything connects
        # Proves this process to the daemon: sent in every hello, never logged (the daemon keeps
        # its SHA-256), so whoever reads `process` in the event log cannot say hello in our place.
        self._secret = secrets.token_hex(16)
        self.boot_id = ""
        self.token = ""  # this registration's token, from the welcome; every later message carries it
        self.welcome: wire.Welcome | None = None  # the last one: what the daemon says this worker should be
        self.actual = actual
        self.heartbeat_interval_s = 1.0
        self.heartbeat_timeout_s = 10.0
        self.errors: list[wire.Error] = []  # errors the daemon sent back (for callers and tests)
        self.ops_run: list[str] = []  # op ids actually executed, in order
        self._records: OrderedDict[str, wire.OpResult] = OrderedDict()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._op_records = op_records
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._welcome: asyncio.Future[wire.Welcome] | None = None
        self._later: wire.Welcome | None = None  # a newer answer to the hello in progress
        self._registered = asyncio.Event()
        self._last_ack = 0.0
        self._last_ask = 0.0  # when a heartbeat last asked for an answer
        self._last_report = -math.inf  # when this process last sent anything but a heartbeat
        self._seq = 0
        self._closed = False
        self._fatal: DaemonRejected | None = None
        self._decoder = wire.daemon_decoder()
        self._send_lock = asyncio.Lock()
        self.handshake_failure = ""  # under CURVE: why the last handshake failed ("" if none did)

    @property
    def heartbeats_sent(self) -> int:
        """Heartbeats this client has sent (a worker that reports sends few: see `_heartbeat`)."""
        return self._seq

    @property
    def registered(self) -> bool:
        """The daemon answers this worker now: registered, and not re-registering after a lost
        heartbeat or a daemon restart."""
        return self._registered.is_set() and not self._closed and self._fatal is None

    def answered(self, op_id: str) -> bool:
        """This worker's answer to op `op_id` has been sent (it is in the record of ops run)."""
        return op_id in self._records

    def on(self, kind: OpKind, handler: OpHandler) -> None:
        self.handlers[kind] = handler

    def on_all(self, handlers: dict[OpKind, OpHandler]) -> None:
        self.handlers.update(handlers)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> wire.Welcome:
        """Connect and register; raises DaemonUnavailable (a TimeoutError) if no welcome comes
        within `hello_timeout_s`, or DaemonRejected. A failed start may simply be called again."""
        self._closed = False
        self._tasks = []
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        # One routing id per process: a second process under the same worker id (a restart, or a
        # duplicate started by mistake) never takes this connection's slot at the daemon.
        self._sock.setsockopt(zmq.IDENTITY, wire.identity_of(self.worker_id, self.process))
        self._sock.setsockopt(zmq.LINGER, 1000)  # a goodbye leaves before exit
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.curve is not None:
            self._sock.curve_secretkey = self.curve.secret
            self._sock.curve_publickey = self.curve.public
            self._sock.curve_serverkey = self.curve.server_public
            # A failed CURVE handshake sends nothing back: only the socket's events tell a
            # refused key from a daemon that is down (the hello timeout says which).
            monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                addr=f"inproc://dynaresized-handshake-{id(self)}")
            self._tasks.append(asyncio.create_task(self._watch_handshake(monitor), name=f"{self.worker_id}-curve"))
        self._sock.connect(self.endpoint)
        self._tasks.append(asyncio.create_task(self._receive(), name=f"{self.worker_id}-receive"))
        try:
            welcome = await self._hello(self.hello_timeout_s)
        except BaseException:
            await self.close(say_bye=False)
            raise
        self._tasks.append(asyncio.create_task(self._heartbeat(), name=f"{self.worker_id}-heartbeat"))
        return welcome

    async def close(self, *, say_bye: bool = True, reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        if say_bye and self._sock is not None and self._registered.is_set():
            with contextlib.suppress(zmq.ZMQError):
                await self._send(wire.Bye(worker_id=self.worker_id, reason=reason, token=self.token))
        for task in [*self._tasks, *self._running.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._running.values(), return_exceptions=True)
        if self._sock is not None:
            # The bye gets a second to leave; without one the client goes silent as a killed
            # process would, and nothing queued (heartbeats to a daemon that is gone) holds the
            # close up: a linger of 1 s per client made a host of 16 clients take 16 s to exit.
            self._sock.close(linger=1000 if say_bye else 0)
        if self._ctx is not None:
            self._ctx.term()

    async def __aenter__(self) -> WorkerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- reporting -------------------------------------------------------------------
    async def report_step(self, timing: StepTiming) -> None:
        """Report one completed RL step. Exactly one worker of the job reports each step
        (trainer rank 0, or the driver's worker): the daemon refuses a second report of a step
        it has already observed (`stale_step`), since it would count the step twice."""
        await self._send(wire.StepReport(worker_id=self.worker_id, timing=timing, sent_at=time.time(),
                                         token=self.token))

    async def report_progress(self, step: int, done: int, total: int, tokens: int = 0) -> None:
        await self._send(wire.Progress(worker_id=self.worker_id, step=step, done=done, total=total, tokens=tokens,
                                       sent_at=time.time(), token=self.token))

    async def report_state(self) -> None:
        """Tell the daemon what this worker holds now (when it changed by itself, e.g. the engine
        died); the daemon also asks now and then. Needs `actual=`."""
        if self.actual is not None and self._registered.is_set():
            await self._send(wire.StateReport(worker_id=self.worker_id, actual=self.actual(), token=self.token,
                                              sent_at=time.time()))

    def _actual_now(self) -> ActualState | None:
        if self.actual is None:
            return None
        try:
            return self.actual()
        except Exception as exc:  # a backend bug must not stop the client: the daemon then knows nothing
            log.error("actual-state callback failed", worker=self.worker_id, error=repr(exc), exc_info=exc)
            return None

    async def report_queue_empty(self, step: int, running: int = 0, tokens_left: int = 0) -> None:
        """An engine: no queued request of rollout step `step` is left (again with `running`
        0 once idle, so the daemon may lend the device to the training step in progress)."""
        await self._send(wire.QueueEmpty(worker_id=self.worker_id, step=step, running=running,
                                         tokens_left=tokens_left, sent_at=time.time(), token=self.token))

    async def report_mini_batch(self, step: int, done: int, total: int) -> None:
        """A trainer (one rank per job): mini-batch `done` of `total` of training step `step`
        is done; the next boundary is where a lent device joins."""
        await self._send(wire.MiniBatchDone(worker_id=self.worker_id, step=step, done=done, total=total,
                                            sent_at=time.time(), token=self.token))

    # -- internals -------------------------------------------------------------------
    async def _send(self, msg: Any) -> None:
        if self._fatal is not None:
            raise self._fatal
        assert self._sock is not None, "start() first"
        async with self._send_lock:
            await self._sock.send(wire.encode(msg))
        if type(msg) is not wire.Heartbeat:
            self._last_report = time.monotonic()

    async def _hello(self, timeout: float) -> wire.Welcome:
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        self._later = None
        welcome_future = self._welcome

        async def say_hello() -> wire.Welcome:
            # the send is inside the deadline too: a DEALER with no usable connection (a CURVE
            # handshake that keeps failing, say) may block on it, and start() must still end in time
            await self._send(self._hello_message())
            return await asyncio.shield(welcome_future)

        try:
            welcome = await asyncio.wait_for(say_hello(), timeout)
        except TimeoutError:
            why = f": {self.handshake_failure}" if self.handshake_failure else ""
            raise DaemonUnavailable(f"no answer from the daemon at {self.endpoint} within {timeout:g}s{why}") from None
        if self._later is not None and self._later.incarnation > welcome.incarnation:
            welcome = self._later  # several hellos were answered: the newest registration is current
        self._adopt(welcome)
        self._registered.set()
        log.info("registered", worker=self.worker_id, incarnation=welcome.incarnation, boot_id=welcome.boot_id)
        return welcome

    def _hello_message(self) -> wire.Hello:
        return wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=self.worker_id, kind=self.kind,
                          devices=self.devices, pid=os.getpid(), host=socket.gethostname(),
                          sent_at=time.time(), process=self.process, actual=self._actual_now(),
                          secret=self._secret)

    def _adopt(self, welcome: wire.Welcome) -> None:
        """Take a welcome's registration as this worker's own. A welcome on this connection
        answers one of this process's hellos; when several hellos reached the daemon (sent while
        it was down and delivered together once it was up) each registered anew, and the newest
        registration is the one whose token the daemon accepts."""
        self.incarnation = welcome.incarnation
        self.boot_id = welcome.boot_id
        self.token = welcome.token
        self.welcome = welcome
        self.heartbeat_interval_s = welcome.heartbeat_interval_s
        self.heartbeat_timeout_s = welcome.heartbeat_timeout_s
        self._last_ack = time.monotonic()

    async def _reregister(self, why: str) -> None:
        """Say hello again until the daemon answers (it restarted, or forgot us).

        The pause between hellos doubles up to `max_backoff_s`, and never beyond a quarter of
        the heartbeat timeout the daemon announced: a restarted daemon gives each worker that
        long to say hello again, however long it was down. Each pause is drawn between half and
        all of it, so that workers that lost the daemon together do not retry together."""
        if not self._registered.is_set():
            return  # already re-registering
        self._registered.clear()
        log.warning("re-registering", worker=self.worker_id, why=why)
        backoff = 0.1
        while not self._closed:
            try:
                await self._hello(max(self.heartbeat_interval_s * 2, 1.0))
                return
            except DaemonUnavailable:
                self._reconnect()
                await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)
                backoff = min(backoff * 2, self.max_backoff_s, self.heartbeat_timeout_s / 4)

    def _reconnect(self) -> None:
        """Say the next hello on a new connection. The daemon does not route a connection whose
        identity it still holds for an earlier one (no ROUTER_HANDOVER): after a drop that only
        this side saw, hellos on that connection go unanswered until it is replaced."""
        assert self._sock is not None
        with contextlib.suppress(zmq.ZMQError):  # not connected: nothing to drop
            self._sock.disconnect(self.endpoint)
        self._sock.connect(self.endpoint)

    async def _heartbeat(self) -> None:
        """Every `heartbeat_interval_s`, a heartbeat, unless another message went out since the
        last beat (the daemon counts any message as one) and no answer is due. An answer is
        asked for once the last answer, and the last ask, came `heartbeat_timeout_s / 4` ago (a
        late answer does not make every beat ask again): the daemon need not answer
        every beat of every worker (at 1,024 devices, a third of its messages), and silence
        from it for `heartbeat_timeout_s` still means it is gone."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            if not self._registered.is_set():
                continue
            now = time.monotonic()
            # Counted from the last answer or the last ask, whichever is later: a daemon that
            # answers late is not asked again with every beat (asks would multiply as it slows).
            ack = now - max(self._last_ack, self._last_ask) >= max(self.heartbeat_interval_s,
                                                                  self.heartbeat_timeout_s / 4)
            if ack or now - self._last_report >= self.heartbeat_interval_s:
                if ack:
                    self._last_ask = now
                self._seq += 1
                await self._send(wire.Heartbeat(worker_id=self.worker_id, seq=self._seq, sent_at=time.time(),
                                                token=self.token, ack=ack))
            if time.monotonic() - self._last_ack > self.heartbeat_timeout_s:
                asyncio.create_task(self._reregister("no heartbeat answer from the daemon"))

    async def _watch_handshake(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.handshake_failure = ""
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.handshake_failure = (
                        "the daemon refused this worker's CURVE key (its public key is not in the daemon's "
                        f"authorized_keys_dir as {self.worker_id}.key)")
                else:
                    self.handshake_failure = (
                        "the CURVE handshake failed (is the server public key this worker was given the "
                        "daemon's, and does the daemon run with CURVE on?)")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                if self._sock is not None and not self._sock.closed:
                    self._sock.disable_monitor()
            monitor.close(linger=0)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            data = await self._sock.recv()
            try:
                msg = self._decoder.decode(data)
            except wire.WireError as exc:
                log.error("undecodable message from the daemon", error=str(exc))
                continue
            match msg:
                case wire.Welcome():
                    if self._welcome is not None and not self._welcome.done():
                        self._welcome.set_result(msg)
                    elif not self._registered.is_set():  # answered before the first answer was taken
                        if self._later is None or msg.incarnation > self._later.incarnation:
                            self._later = msg
                    elif msg.incarnation > self.incarnation:
                        self._adopt(msg)
                case wire.HeartbeatAck():
                    self._last_ack = time.monotonic()
                    if msg.boot_id != self.boot_id:
                        asyncio.create_task(self._reregister(f"daemon restarted (boot {msg.boot_id})"))
                case wire.OpCommand():
                    self._dispatch(msg)
                case wire.StateQuery():
                    asyncio.create_task(self.report_state())
                case wire.Error():
                    self._on_error(msg)

    def _on_error(self, err: wire.Error) -> None:
        self.errors.append(err)
        if err.token and err.token != self.token:
            return  # about a message sent under an earlier registration: this one is current
        if err.reason in ("stale_op", "illegal_transition") and err.ref_type == "op_result":
            # A late answer to a re-sent op: the daemon moved on after the first one.
            log.info("late answer to a re-sent op refused", worker=self.worker_id, error=err.message)
            return
        log.warning("daemon error", worker=self.worker_id, code=err.code.value, reason=err.reason,
                    error=err.message)
        if err.code is wire.ErrorCode.UNAUTHORIZED and err.reason == "wrong_identity":
            # This client always names its connection after its worker: the daemon saw another
            # routing id on it (something between the two lost it). A new connection, not an end.
            self._reconnect()
            asyncio.create_task(self._reregister(err.message))
            return
        fatal = (err.code in (wire.ErrorCode.BAD_VERSION, wire.ErrorCode.UNAUTHORIZED)
                 or (err.ref_type == "hello" and err.reason in _PERMANENT))
        if fatal:
            self._fatal = DaemonRejected(err)
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_exception(self._fatal)
        elif err.reason in ("unknown_worker", "not_registered", "stale_token", "missing_token"):
            asyncio.create_task(self._reregister(err.message))

    def _dispatch(self, cmd: wire.OpCommand) -> None:
        record = self._records.get(cmd.op_id)
        if record is not None:  # re-sent (a daemon restart, a lost answer): answer, do not re-run
            # The recorded outcome under the current registration's token (docs/protocol.md).
            asyncio.create_task(self._send(msgspec.structs.replace(record, token=self.token, actual=self._actual_now())))
            return
        if cmd.op_id in self._running:
            return  # still running: its result goes out when it ends
        self._running[cmd.op_id] = asyncio.create_task(self._run_op(cmd), name=f"op-{cmd.op_id}")

    async def _run_op(self, op: OpRequest) -> None:
        started = time.monotonic()
        handler = self.handlers.get(op.kind)
        self.ops_run.append(op.op_id)
        with structlog.contextvars.bound_contextvars(resize_id=op.resize_id, op=op.kind.value,
                                                     worker=self.worker_id):
            if handler is None:
                ok, detail = False, f"worker {self.worker_id} has no handler for {op.kind.value}"
            else:
                try:
                    detail = await asyncio.wait_for(handler(op), timeout=max(op.timeout_s, 0.001))
                    ok = True
                except TimeoutError:
                    ok, detail = False, f"{op.kind.value} did not finish within {op.timeout_s:.1f}s"
                except Exception as exc:  # the handler's failure is the op's result, reported to the daemon
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                    log.warning("op failed", error=detail, exc_info=exc)
        result = wire.OpResult(worker_id=self.worker_id, op_id=op.op_id, ok=ok, detail=str(detail)[:4000],
                               duration_s=time.monotonic() - started, sent_at=time.time(), token=self.token,
                               actual=self._actual_now())
        self._records[op.op_id] = result
        while len(self._records) > self._op_records:
            self._records.popitem(last=False)
        self._running.pop(op.op_id, None)
        await self._send(result)


class BlockingWorkerClient:
    """WorkerClient for code without an event loop: runs one in a background thread.
    Handlers are plain functions `(OpRequest) -> str`, run in a worker thread."""

    def __init__(self, endpoint: str, worker_id: str, kind: WorkerKind, devices: tuple[str, ...],
                 **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"dynaresized-{worker_id}", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(endpoint, worker_id, kind, devices, kwargs))

    async def _make(self, *args: Any) -> WorkerClient:
        endpoint, worker_id, kind, devices, kwargs = args
        return WorkerClient(endpoint, worker_id, kind, devices, **kwargs)

    def _call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    @property
    def client(self) -> WorkerClient:
        return self._client

    def on(self, kind: OpKind, handler: Callable[[OpRequest], str]) -> None:
        async def run(op: OpRequest) -> str:
            return await asyncio.to_thread(handler, op)

        self._client.on(kind, run)

    def start(self) -> wire.Welcome:
        return self._call(self._client.start())

    def report_step(self, timing: StepTiming) -> None:
        self._call(self._client.report_step(timing))

    def report_progress(self, step: int, done: int, total: int, tokens: int = 0) -> None:
        self._call(self._client.report_progress(step, done, total, tokens))

    def report_state(self) -> None:
        self._call(self._client.report_state())
    def report_queue_empty(self, step: int, running: int = 0, tokens_left: int = 0) -> None:
        self._call(self._client.report_queue_empty(step, running, tokens_left))

    def report_mini_batch(self, step: int, done: int, total: int) -> None:
        self._call(self._client.report_mini_batch(step, done, total))

    def close(self, reason: str = "") -> None:
        try:
            self._call(self._client.close(reason=reason), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> BlockingWorkerClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ActualState", "BlockingWorkerClient", "CurveKeys", "DaemonRejected", "DaemonUnavailable", "OpHandler", "OpRequest",
           "Pool", "WorkerClient"]
