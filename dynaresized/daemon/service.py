"""The daemon: one reactor task owns the cluster state and reads one queue.

Ingress tasks (workers, control) decode frames and put events on the queue; the ticker puts
ticks; nothing else touches the state. For each batch the reactor steps the core, appends the
facts to the store (durable), and only then sends the commands and replies they imply. Root
tasks are guarded: one that ends unexpectedly stops the daemon with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import secrets
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynaresized import wire
from dynaresized.core import Command, Core, IllegalTransition, QueryState, Refused
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.policy import Policy
from dynaresized.core.state import ClusterState, Phase
from dynaresized.control import control_secret_file
from dynaresized.daemon.config import Config, ConfigError, config_warnings, control_endpoint_of, load_config
from dynaresized.daemon.intake import Intake, ReportRate
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.notify import Notifier
from dynaresized.daemon.preflight import (
    EVENTS_FILE,
    LOG_ERRORS,
    StartupError,
    check_startup,
    configured_policy,
    inventory_problem,
    log_problem,
    raise_open_files,
)
from dynaresized.daemon.security import (
    CurveServer,
    Refusals,
    SecurityError,
    load_control_secret,
    make_state_dir,
    owner_only_umask,
    restrict_ipc_socket,
    secret_digest,
)
from dynaresized.daemon.status import idle_status, observe, outcome_status, status_of
from dynaresized.domain import Split, WorkerStatus
from dynaresized.explain import explain
from dynaresized.store import FactLog, open_recorder

log = structlog.get_logger("dynaresized")

_BATCH = 512
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: IntFlag arithmetic costs more than the receive
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_PENDING_MAX = 16  # stepped batches awaiting the log before the reactor waits for it (backpressure)


def _rearm(sock: zmq.asyncio.Socket) -> None:
    """Call after sending on `sock`'s raw shadow from outside its ingress.

    A ZeroMQ socket wakes its reader through a file descriptor that any operation on the socket
    may clear: a send landing between a message's arrival and the event loop's next look at that
    descriptor takes the wake-up, and the ingress waiting on `sock` never wakes (in the chaos
    runs, the daemon stopped reading every worker for good while it went on sending). Reading
    EVENTS through the asyncio socket makes pyzmq look again (its own sends do the same)."""
    sock.get(zmq.EVENTS)


CONNECTIONS_PER_IO_THREAD = 1024


def io_threads_for(config: Config) -> int:
    """`daemon.io_threads`, or where 0 one libzmq I/O thread per 1,024 worker connections (an
    engine and a trainer per device of the inventory), 1 to 8: libzmq's timers per I/O thread
    are cancelled by a scan, which made the ZMTP heartbeats of one thread's connections cost
    the square of their number."""
    if config.daemon.io_threads:
        return config.daemon.io_threads
    return max(1, min(8, math.ceil(config.worker_connections() / CONNECTIONS_PER_IO_THREAD)))


def _send_to(raw: zmq.Socket, identity: bytes, data: bytes) -> None:
    """Send `data` to the ROUTER peer `identity` without blocking; raises what the first frame's
    send raises (zmq.Again over the high-water mark, EHOSTUNREACH for a routing id nobody holds).
    Two sends with plain int flags: `send_multipart` ORs IntFlags in Python for every frame, which
    cost more than the sends themselves for a heartbeat's acknowledgement."""
    raw.send(identity, _NOBLOCK_MORE)
    raw.send(data, _NOBLOCK)


# Reports that write facts: rate-bounded per worker (daemon.report_rate)
_FACT_REPORTS = frozenset({wire.QueueEmpty, wire.MiniBatchDone, wire.StepReport, wire.StateReport})
# Core refusals of messages that no registered worker sent: they count against the connection's
# junk budget (daemon.junk_budget), as malformed frames do
_NOBODY = frozenset({"unknown_worker", "not_registered"})


class _WorkerIn(msgspec.Struct):
    identity: bytes
    msg: Any  # a wire.WorkerMessage


class _ControlIn(msgspec.Struct):
    identity: bytes
    msg: Any  # a wire.ControlRequest


class _TickIn(msgspec.Struct):
    pass


class _ReloadIn(msgspec.Struct):
    """SIGHUP: re-read [policy] and [guards] from the configuration file."""


class Daemon:
    def __init__(self, config: Config, *, policy: Policy | None = None, clock: Callable[[], float] | None = None,
                 notifier: Notifier | None = None, config_path: str | Path | None = None) -> None:
        self.config = config
        self.config_path = config_path  # what SIGHUP re-reads; None: reload is refused
        self.scale = config.daemon.time_scale
        self.clock = clock or scaled_clock(self.scale)
        self.policy = policy or configured_policy(config)
        self.core = Core(config.core_config(), self.policy)
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        self.refusals = Refusals(self.metrics.security_refusals)
        # refused frames: every one counted, a log line per kind every 10 s (a flood must not fill the journal)
        self.frame_refusals = Refusals(self.metrics.decode_errors)
        self.intake = Intake(config.daemon.junk_budget, config.daemon.junk_window_s, self.metrics.connections_cut)
        self.report_rate = ReportRate(config.daemon.report_rate, config.daemon.report_burst)
        # core refusals: every one counted, a log line per reason every 10 s
        self.core_refusals = Refusals(self.metrics.refusals)
        self.control_secret = b""
        self.boot_id = uuid.uuid4().hex[:12]
        self.state = ClusterState()
        self.queue: asyncio.Queue[list[_WorkerIn | _ControlIn | _TickIn | _ReloadIn]] = asyncio.Queue()
        self.ctx: zmq.asyncio.Context | None = None
        self.workers_sock: zmq.asyncio.Socket | None = None
        self._workers_readable = asyncio.Event()  # the worker socket may have a message (see _wait_workers)
        self.control_sock: zmq.asyncio.Socket | None = None
        self._raw: dict[int, zmq.Socket] = {}  # id(socket) -> its shadow, for sends that must not block (_bind)
        self.curve: CurveServer | None = None
        self.factlog: FactLog | None = None
        self.worker_endpoint = ""  # as bound (a tcp port 0 becomes the real port)
        self.control_endpoint = ""
        self._ready = asyncio.Event()
        self._stop_deadline: float | None = None
        self._abort_sent = False
        self._last_watchdog = 0.0
        # Group commit: the reactor queues each stepped batch (its facts, the state after it and
        # the replies and commands it implies); the log writer appends everything queued in one
        # transaction from a thread (SQLite releases the GIL while it writes and fsyncs), then
        # sends what those facts imply. The reactor steps on meanwhile, at most _PENDING_MAX ahead.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynaresized-log")
        self._pending: list[tuple[list[f.Fact], ClusterState, list[tuple[zmq.asyncio.Socket, bytes, bytes]]]] = []
        self._pending_changed = asyncio.Event()
        self._writing = False
        # Per-registration tokens and routing ids, in memory only: a restarted daemon knows none,
        # so every worker says hello again (its messages are refused as `stale_token` until then).
        self._tokens: dict[str, str] = {}
        self._routes: dict[str, bytes] = {}
        self._worker_decoder = wire.worker_decoder(config.daemon.max_message_bytes)
        self._control_decoder = wire.control_decoder(config.daemon.max_message_bytes)

    # -- start-up --------------------------------------------------------------------
    def _open_log(self) -> None:
        """Open and replay the log; the first write comes only after the last check passed."""
        state_dir = Path(self.config.daemon.state_dir)
        try:
            make_state_dir(state_dir, self.config.security.control_group)
        except OSError as exc:
            raise StartupError(f"cannot create state_dir {state_dir}: {exc}") from None
        path = state_dir / EVENTS_FILE
        try:
            recorder = open_recorder(path)
            self.factlog = FactLog(recorder, snapshot_every=self.config.daemon.snapshot_every,
                                   retention=self.config.store.retention())  # compacts after each snapshot
            self.state = self.factlog.replay()
        except LOG_ERRORS as exc:
            raise StartupError(log_problem(path, exc)) from None
        if problem := inventory_problem(self.config, self.state):
            raise StartupError(problem)
        devices, pools = self.config.initial_pools()
        now = self.clock()
        if not self.state.configured:
            self._apply(ev.Configure(at=now, devices=devices, pools=pools,
                                     candidates=self.config.candidate_splits()))
        else:
            self._apply(ev.DaemonStarted(at=now))
        log.info("replayed", facts=self.state.version, phase=self.state.phase.value, split=str(self.state.split))

    def _apply(self, event: ev.Event) -> list[Command]:
        """Step the core outside the reactor (start-up only) and record the facts."""
        self.state, facts, commands = self.core.step(self.state, event)
        self._persist(facts, self.state)
        observe(self.metrics, facts, self.state)
        return commands

    def _bind(self) -> None:
        d = self.config.daemon
        sec = self.config.security
        self.ctx = zmq.asyncio.Context(io_threads=io_threads_for(self.config))
        if sec.server_secret_key:
            try:
                self.curve = CurveServer(self.ctx, sec.server_secret_key, sec.authorized_keys_dir, self.refusals)
            except SecurityError as exc:
                raise StartupError(str(exc)) from None
        self.workers_sock = self._router(d.worker_endpoint, curve=True)
        state_dir = Path(d.state_dir)  # holds the control secret, and by default the control socket
        try:
            make_state_dir(state_dir, sec.control_group)
            self.control_secret = load_control_secret(state_dir)
        except (OSError, SecurityError) as exc:
            raise StartupError(f"control secret {control_secret_file(state_dir)}: {exc}") from None
        with owner_only_umask():
            self.control_sock = self._router(control_endpoint_of(d), curve=False)  # loopback only, see config
        self.worker_endpoint = self.workers_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control_endpoint = self.control_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._raw = {id(sock): zmq.Socket.shadow(sock.underlying) for sock in (self.workers_sock, self.control_sock)}
        try:
            restrict_ipc_socket(self.control_endpoint, sec.control_group)
        except OSError as exc:
            raise StartupError(f"cannot restrict the control socket {self.control_endpoint}: {exc}") from None

    def _router(self, endpoint: str, *, curve: bool) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.ROUTER)
        if curve:  # the worker endpoint
            # The kernel drops a connection whose peer vanished without a FIN (host down) within
            # about the heartbeat timeout, so that the worker's next connection can take its
            # identity: TCP keepalives while it is idle, TCP_USER_TIMEOUT (ZMQ_TCP_MAXRT) while the
            # daemon's sends go unacknowledged. Not ZMTP heartbeats: libzmq's heartbeat timer
            # writes to a connection whose peer closed while its queue was full, and aborts the
            # daemon (`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`, after a
            # junk flood: docs/benchmarks.md, "Flood"); and their timers cost the I/O thread.
            timeout_s = max(self.config.core.heartbeat_timeout_s, 3 * self.config.daemon.heartbeat_interval_s)
            idle_s = max(1, int(timeout_s / 3))
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, max(1, math.ceil(timeout_s - idle_s)))
            sock.setsockopt(zmq.TCP_MAXRT, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 1000)
        # No handover: a second connection for a routing id that is connected must not take the
        # slot (it would take that worker's ops and acks). libzmq parks it unrouted; a restarted
        # worker's old connection is gone by the time its new one shakes hands.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.daemon.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.config.daemon.receive_hwm)
        # A send to a routing id with no connection fails (EHOSTUNREACH) instead of vanishing:
        # that is how a hello tells a duplicate process from a restarted one (`_still_connected`).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve and self.curve is not None:
            self.curve.apply(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise StartupError(f"cannot bind {endpoint}: {exc}") from None
        return sock

    # -- run -------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        d = self.config.daemon
        try:
            # Everything that can refuse the start comes before the log's first write: a refused
            # start leaves the log as it was (or absent), so fixing the configuration is enough.
            check_startup(self.config, read_log=False, policy=False)
            self._bind()
            if d.metrics_port:
                self.metrics.serve(d.metrics_host, d.metrics_port)
            self._open_log()
        except Exception:
            self._close()
            raise
        self.metrics.state = self.state
        self.metrics.observe_idle(self.state)
        self.metrics.payback_factor.set(self.state.history.payback_factor)
        for key, why in config_warnings(self.config):
            log.warning("exposed by configuration", key=key, why=why)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGTERM, self.request_stop)
            loop.add_signal_handler(signal.SIGINT, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        tasks = {
            asyncio.create_task(self._reactor(), name="reactor"),
            asyncio.create_task(self._log_writer(), name="log-writer"),
            asyncio.create_task(self._ingress_workers(), name="ingress-workers"),
            asyncio.create_task(self._ingress_control(), name="ingress-control"),
            asyncio.create_task(self._ticker(), name="ticker"),
            asyncio.create_task(self._watch_worker_connections(), name="watch-worker-connections"),
        }
        reactor = next(t for t in tasks if t.get_name() == "reactor")
        self.notifier.ready(f"serving {self.worker_endpoint}; split {self.state.split}")
        log.info("serving", workers=self.worker_endpoint, control=self.control_endpoint, boot_id=self.boot_id,
                 policy=self.policy.name)
        self._ready.set()
        code = 0
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is reactor and not task.cancelled() and task.exception() is None:
                    continue  # a clean drain
                exc = None if task.cancelled() else task.exception()
                log.error("root task ended unexpectedly", task=task.get_name(), error=repr(exc),
                          exc_info=exc)
                code = 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.notifier.stopping("stopped")
            self._close()
        log.info("stopped", exit_code=code, phase=self.state.phase.value)
        return code

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def request_stop(self) -> None:
        self.queue.put_nowait([_ControlIn(identity=b"", msg=wire.DrainRequest())])

    def request_reload(self) -> None:
        self.queue.put_nowait([_ReloadIn()])

    def _close(self) -> None:
        self._writer.shutdown(wait=True)
        for sock in (self.workers_sock, self.control_sock):
            if sock is not None:
                sock.close(linger=500)
        if self.curve is not None:
            self.curve.stop()
        if self.ctx is not None:
            self.ctx.term()
        if self.factlog is not None:
            self.factlog.close()

    # -- ingress: frames in, events out (never touches the state) ---------------------
    async def _ingress_workers(self) -> None:
        """Wait for readability once, then drain what is there without blocking: per-message
        awaits through zmq.asyncio cost more than decoding and recording the message.

        Batches are handed on at most every `daemon.batch_window_ms`: a message that arrives
        within the window after the last batch waits for the window's end, with the others that
        arrive meanwhile. On a quiet cluster that costs nothing (the message is taken at once);
        on a busy one it makes the reactor, the log writer's thread and the fsync run once per
        window instead of once per message, the largest part of the daemon's CPU at scale
        (docs/benchmarks.md).

        Readability is watched on the socket's file descriptor directly, not through
        zmq.asyncio's poll: its futures and event handling were a third of the reactor thread's
        Python time at 1,024 devices (docs/benchmarks.md, "Scale")."""
        assert self.workers_sock is not None
        raw = self._raw[id(self.workers_sock)]
        loop = asyncio.get_running_loop()
        fd = raw.getsockopt(zmq.FD)
        self._workers_readable = asyncio.Event()  # of this loop
        # The descriptor stays readable until EVENTS is read, and the loop's selector asks it
        # level-triggered: the reader reads EVENTS, or the loop spins while a batch waits its window.
        loop.add_reader(fd, self._rearm_workers)
        try:
            await self._drain_workers(raw, loop)
        finally:
            loop.remove_reader(fd)

    async def _wait_workers(self, raw: zmq.Socket) -> None:
        """Until the worker socket has a message. The descriptor is edge-triggered: reading
        EVENTS re-arms it, so a message that arrives after the read sets the event. A send on
        the socket can take that edge (see `_rearm_workers`)."""
        while not raw.get(zmq.EVENTS) & _POLLIN:
            self._workers_readable.clear()
            await self._workers_readable.wait()

    def _rearm_workers(self) -> None:
        """Look at EVENTS and wake the ingress if a message waits: the descriptor's reader, and
        after every send on the worker socket from outside its ingress (a send landing between a
        message's arrival and the ingress's next look takes the descriptor's wake-up, and the
        ingress would never wake: in the chaos runs, the daemon stopped reading every worker for
        good while it went on sending)."""
        if self.workers_sock is not None and self._raw[id(self.workers_sock)].get(zmq.EVENTS) & _POLLIN:
            self._workers_readable.set()

    async def _drain_workers(self, raw: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        handed = -math.inf  # when the last batch was handed on (-inf: take the next one at once)
        intake = self.intake
        dropped_from = intake.cut_ids  # the identities of cut connections (a set lookup per message)
        while True:
            await self._wait_workers(raw)
            # in the daemon's clock: a demo's daemon, whose clock runs time_scale times faster,
            # waits as much of its own time as a real one does
            window_s = self.config.daemon.batch_window_ms / 1000.0 / self.config.daemon.time_scale
            wait = handed + window_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            batch: list[_WorkerIn] = []
            drained = False
            for _ in range(_BATCH):
                try:
                    # A ROUTER delivers a message whole, as the sender's routing id and at least
                    # one frame after it, so the payload is there once the id is. The id as bytes;
                    # the payload as a Frame: `Frame.more` is an attribute, where recv_multipart
                    # asks the socket for RCVMORE through the Python layer for every frame.
                    identity = raw.recv(_NOBLOCK)
                    payload = raw.recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    drained = True
                    break
                if identity in dropped_from and intake.dropped(identity, payload):
                    while payload.more:  # what a cut connection had queued: unread, unanswered
                        payload = raw.recv(0, copy=False)
                    continue
                if payload.more:
                    self._refuse_extra_frames(raw, identity, payload)
                    continue
                item = self._admit(raw, identity, payload)
                if item is not None:
                    batch.append(item)
            if batch:
                self.queue.put_nowait(batch)
            if drained:
                handed = loop.time()
            else:
                # A full batch: the rest are taken at once, but after the reactor, the log writer and
                # the replies had their turn. Without this a connection that floods the socket kept
                # the loop here and no heartbeat was answered (docs/benchmarks.md, "Flood").
                handed = -math.inf
                await asyncio.sleep(0)

    def _refuse_extra_frames(self, raw: zmq.Socket, identity: bytes, payload: zmq.Frame) -> None:
        """Read and drop the rest of a message of several payload frames, and say so."""
        extra = 1
        while raw.recv(0, copy=False).more:
            extra += 1
        self._refuse_frame(raw, identity, payload, wire.ErrorCode.MALFORMED,
                           f"expected exactly one payload frame, got {extra + 1}")

    def _refuse_frame(self, raw: zmq.Socket, identity: bytes, payload: zmq.Frame, kind: wire.ErrorCode,
                      message: str, *, reason: str = "", ref: Any = None, **fields: object) -> None:
        """Count, log (a line per kind every 10 s) and answer a refused frame, unless it takes its
        connection over `daemon.junk_budget`: then the connection is cut and told nothing more."""
        self.frame_refusals.record(kind.value, "refused frame", peer=identity.hex()[:16],
                                   error=message, **fields)
        if not self.intake.refused(identity, payload, kind.value):
            self._send_error(raw, identity, kind, message, reason=reason, ref=ref)

    def _admit(self, raw: zmq.Socket, identity: bytes, payload: zmq.Frame) -> _WorkerIn | None:
        """Decode and authenticate one message; bad ones are answered here and go no further."""
        try:
            msg = self._worker_decoder.decode(payload)  # the frame's buffer, as is: no copy, no memoryview
        except wire.WireError as exc:
            self._refuse_frame(raw, identity, payload, exc.kind, exc.message)
            return None
        if type(msg) is wire.Hello and (problem := wire.hello_problem(msg)):
            self._refuse_frame(raw, identity, payload, wire.ErrorCode.INVALID, problem, reason="bad_request", ref=msg)
            return None
        problem, reason = self._authenticate(identity, payload, msg)
        if problem:
            self._refuse_frame(raw, identity, payload, wire.ErrorCode.UNAUTHORIZED, problem, reason=reason, ref=msg,
                               worker=msg.worker_id)
            return None
        return _WorkerIn(identity, msg)

    def _count_decode_error(self, kind: wire.ErrorCode) -> None:
        self.metrics.decode_errors.labels(kind.value).inc()

    def _authenticate(self, identity: bytes, frame: zmq.Frame, msg: Any) -> tuple[str, str]:
        """A worker is who its CURVE key says, and its connection's routing identity names it:
        the worker id, or the worker id, '#' and its process (what our client sets). A hello's
        identity names its process exactly: `<worker_id>#<process>` (the bare worker id only for
        a hello without `process`), so one connection registers one process.
        Returns (the problem, its reason code), ("", "") when there is none."""
        if self.curve is not None:
            owner = self.curve.worker_of(frame)
            if owner != msg.worker_id:
                return f"this key may act as worker {owner!r}, not {msg.worker_id!r}", "wrong_key"
        if type(msg) is wire.Hello:
            expected = f"{msg.worker_id}#{msg.process}" if msg.process else msg.worker_id
            if identity != expected.encode():
                return (f"a hello of worker {msg.worker_id!r} with process {msg.process!r} must come from a connection "
                        f"whose ZeroMQ identity is {expected!r}: a new process connects with its own identity",
                        "wrong_identity")
            return "", ""
        if identity.partition(b"#")[0] != msg.worker_id.encode():
            return (f"messages for worker {msg.worker_id!r} must come from a connection whose ZeroMQ identity is "
                    f"{msg.worker_id!r} or '{msg.worker_id}#<process>' (the client sets it)", "wrong_identity")
        return "", ""

    def _check_token(self, msg: Any) -> None:
        """Every message after hello carries the token of the registration it belongs to."""
        worker_id = msg.worker_id
        token = self._tokens.get(worker_id)
        if token is None:
            if self.state.is_live(worker_id):  # live in the log, not yet registered with this boot
                raise _Reply(wire.ErrorCode.REFUSED,
                             f"the daemon restarted (boot {self.boot_id}) since worker {worker_id!r} registered; "
                             "say hello again", "stale_token")
            return  # unknown or lost: the core says so (unknown_worker, not_registered)
        if msg.token != token:
            if not msg.token:
                raise _Reply(wire.ErrorCode.REFUSED,
                             f"messages of worker {worker_id!r} must carry the token its welcome gave "
                             f"(protocol {wire.PROTOCOL_VERSION})", "missing_token")
            raise _Reply(wire.ErrorCode.REFUSED,
                         f"the token does not belong to worker {worker_id!r}'s current registration (another "
                         "process registered under this id since, or this one was re-registered): say hello again",
                         "stale_token")

    def _still_connected(self, msg: wire.Hello, identity: bytes) -> bool:
        """Whether a hello from a new process finds the live registration's connection still open
        (a duplicate process started by mistake, or someone claiming its id) rather than gone
        (the old process died). Before the old process has said hello to this daemon start, its
        connection is the one its identity names (`<worker_id>#<process>`, see _authenticate):
        its DEALER reconnects to a restarted daemon by itself."""
        old = self.state.workers.get(msg.worker_id)
        if old is None or not self.state.is_live(msg.worker_id) or not old.process or old.process == msg.process:
            return False
        route = self._routes.get(msg.worker_id, f"{msg.worker_id}#{old.process}".encode())
        if route == identity:
            return False
        assert self.workers_sock is not None
        try:
            _send_to(self._raw[id(self.workers_sock)], route, wire.encode(wire.HeartbeatAck(seq=0, boot_id=self.boot_id)))
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: nobody holds that routing id any more
        finally:
            self._rearm_workers()  # the reactor's send: see _rearm_workers
        return True

    async def _ingress_control(self) -> None:
        assert self.control_sock is not None
        sock = self.control_sock
        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            frames = await sock.recv_multipart()
            identity = frames[0]
            if len(frames) != 3:  # the ROUTER's identity, then the secret (empty for status) and the request
                self._count_decode_error(wire.ErrorCode.MALFORMED)
                self._send_error(raw, identity, wire.ErrorCode.MALFORMED,
                                 f"a control request is two frames, the control secret (empty for status) and the "
                                 f"request; got {len(frames) - 1}", reason="frames")
                continue
            _, secret, payload = frames
            try:
                msg = self._control_decoder.decode(payload)
            except wire.WireError as exc:
                self._count_decode_error(exc.kind)
                self._send_error(raw, identity, exc.kind, exc.message)
                continue
            if msg.protocol != wire.PROTOCOL_VERSION:
                self._send_error(raw, identity, wire.ErrorCode.BAD_VERSION,
                                 f"protocol {msg.protocol} not supported; this daemon speaks {wire.PROTOCOL_VERSION}")
                continue
            if type(msg) is not wire.StatusRequest and not secrets.compare_digest(secret, self.control_secret):
                tag = type(msg).__struct_config__.tag
                self.refusals.record("control_secret", "refused a control request without the control secret",
                                     request=tag)
                self._send_error(raw, identity, wire.ErrorCode.UNAUTHORIZED,
                                 f"{tag} needs the control secret in "
                                 f"{control_secret_file(self.config.daemon.state_dir)}: run the CLI as the daemon's "
                                 "user or root, with the daemon's --config",
                                 reason="missing_secret" if not secret else "wrong_secret", ref=msg)
                continue
            self.queue.put_nowait([_ControlIn(identity, msg)])

    async def _watch_worker_connections(self) -> None:
        """Count and log what the worker socket refuses below the messages: failed handshakes (a
        plaintext peer, a wrong server key; the ZAP handler counts unknown keys), and connections
        that no live worker stands behind for a heartbeat timeout. The latter is also how a second
        connection for a connected worker id shows: libzmq parks it unrouted without a word."""
        assert self.workers_sock is not None
        failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        monitor = self.workers_sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | failed)
        connected: set[int] = set()  # by file descriptor: libzmq names the fd on accept and disconnect only
        reported = 0  # connections without a live worker already counted
        excess_since = 0.0
        # A heartbeat timeout in wall time, but never under a second: a demo's daemon.time_scale
        # would make it microseconds, and this loop a busy one.
        grace = max(self.config.core.heartbeat_timeout_s / self.scale, 1.0)
        raw = zmq.Socket.shadow(monitor.underlying)
        try:
            while True:
                # Drain every event at once: libzmq's I/O thread blocks on a full monitor queue,
                # and then the whole socket stalls.
                await monitor.poll(timeout=int(grace * 500), flags=zmq.POLLIN)
                while True:
                    try:
                        event = parse_monitor_message(raw.recv_multipart(_NOBLOCK))
                    except zmq.Again:
                        break
                    if event["event"] == zmq.EVENT_ACCEPTED:
                        connected.add(event["value"])
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        connected.discard(event["value"])
                    else:
                        self.refusals.record("handshake_failed", "refused a handshake on the worker endpoint",
                                             handshake=zmq.Event(event["event"]).name, errno=event["value"])
                self.metrics.worker_connections.set(len(connected))
                live = sum(1 for w in self.state.workers.values() if w.status is WorkerStatus.LIVE)
                excess = len(connected) - live
                now = time.monotonic()
                if excess <= reported:
                    reported, excess_since = max(excess, 0), now
                elif now - excess_since >= grace:
                    self.refusals.record("idle_connection",
                                         "connections to the worker endpoint without a live worker: a second "
                                         "connection for a connected worker id (not routed), or a peer that "
                                         "never registered", connections=len(connected), live_workers=live)
                    self.metrics.security_refusals.labels("idle_connection").inc(excess - reported - 1)
                    reported = excess
        finally:
            self.workers_sock.disable_monitor()
            monitor.close(linger=0)

    async def _ticker(self) -> None:
        interval = self.config.daemon.tick_interval_s
        while True:
            await asyncio.sleep(interval)
            self.queue.put_nowait([_TickIn()])

    def _send_error(self, raw: zmq.Socket, identity: bytes, code: wire.ErrorCode, message: str,
                    *, reason: str = "", ref: Any = None) -> None:
        ref_type = type(ref).__struct_config__.tag if ref is not None else ""
        err = wire.Error(code=code, message=message, reason=reason, ref_type=ref_type)
        with contextlib.suppress(zmq.ZMQError):  # a peer gone or over its high-water mark
            _send_to(raw, identity, wire.encode(err))

    # -- the reactor -----------------------------------------------------------------
    async def _reactor(self) -> None:
        while True:
            items = await self.queue.get()
            while len(items) < _BATCH:
                try:
                    items.extend(self.queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            facts: list[f.Fact] = []
            commands: list[Command] = []
            outbox: list[tuple[zmq.asyncio.Socket, bytes, bytes]] = []
            for item in items:
                self._handle(item, facts, commands, outbox)
            encoded: dict[tuple[object, ...], bytes] = {}  # an op goes to every target as the same bytes
            for command in commands:
                self._queue_op(command, outbox, encoded)
            if commands:
                self._log_ops(commands)
            self._pending.append((facts, self.state, outbox))
            self._pending_changed.set()
            while len(self._pending) > _PENDING_MAX:  # the log is the bottleneck: let it catch up
                await self._log_progress()
            if self._stop_deadline is not None and self._drained():
                while self._pending or self._writing:
                    await self._log_progress()
                return

    async def _log_progress(self) -> None:
        self._pending_changed.clear()
        await self._pending_changed.wait()

    async def _log_writer(self) -> None:
        """Append what the reactor has stepped, durably and in order; only then send the replies
        and commands it implies. Facts are durable before anything they imply leaves."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                await self._log_progress()
                continue
            batches, self._pending = self._pending, []
            self._writing = True
            facts = [fact for batch_facts, _, _ in batches for fact in batch_facts]
            if facts:
                # An append that fails ends this task, and so the daemon: nothing it implied was sent.
                await loop.run_in_executor(self._writer, self._persist, facts, batches[-1][1])
            self._writing = False
            for batch_facts, state, _ in batches:
                if batch_facts:
                    observe(self.metrics, batch_facts, state)
            self._send_replies([outbox for _, _, outbox in batches])
            self.metrics.flush_messages()
            self._pending_changed.set()

    def _send_replies(self, outboxes: list[list[tuple[zmq.asyncio.Socket, bytes, bytes]]]) -> None:
        """Send the replies and commands of stepped batches, in order, without blocking."""
        assert self.workers_sock is not None and self.control_sock is not None
        raw = self._raw
        for outbox in outboxes:
            for sock, identity, data in outbox:
                try:  # not contextlib.suppress: one object and two calls less per reply
                    _send_to(raw[id(sock)], identity, data)
                except zmq.ZMQError:  # a peer gone or over its high-water mark
                    pass
        if any(outboxes):  # see _rearm_workers and _rearm
            self._rearm_workers()
            _rearm(self.control_sock)

    def _drained(self) -> bool:
        if self.state.inflight is None:
            log.info("drained", phase=self.state.phase.value)
            return True
        now = self.clock()
        assert self._stop_deadline is not None
        if now >= self._stop_deadline + self.config.core.op_timeout_s:
            log.error("drain gave up: the resize in flight is recorded and will be reconciled at next start",
                      resize_id=self.state.inflight.plan.resize_id, phase=self.state.phase.value)
            return True
        return False

    def _handle(self, item: Any, facts: list[f.Fact], commands: list[Command],
                outbox: list[tuple[zmq.asyncio.Socket, bytes, bytes]]) -> None:
        now = self.clock()
        if type(item) is not _WorkerIn:
            if isinstance(item, _TickIn):
                self._step(ev.Tick(at=now), facts, commands)
                self._on_tick(now, facts, commands)
            elif isinstance(item, _ControlIn):
                self._control(item, now, facts, commands, outbox)
            elif isinstance(item, _ReloadIn):
                self._reload(now, facts, commands)
            return
        assert self.workers_sock is not None
        msg = item.msg
        sock = self.workers_sock
        self.metrics.message(type(msg))
        try:
            if type(msg) is not wire.Hello:
                self._check_token(msg)
                if type(msg) in _FACT_REPORTS and not self.report_rate.take(msg.worker_id, now):
                    raise _Reply(wire.ErrorCode.REFUSED,
                                 f"worker {msg.worker_id!r} sent more than daemon.report_rate "
                                 f"({self.config.daemon.report_rate:g}/s, bursts of {self.config.daemon.report_burst}) "
                                 "reports that write facts; this one changed nothing", "rate_limited")
            match msg:  # the message types are disjoint: the most frequent come first
                case wire.Progress():
                    self._step(ev.ProgressReported(at=now, worker_id=msg.worker_id, step=msg.step, done=msg.done,
                                                   total=msg.total, tokens=msg.tokens), facts, commands)
                case wire.QueueEmpty():
                    self._step(ev.EngineQueueEmpty(at=now, worker_id=msg.worker_id, step=msg.step,
                                                   running=msg.running, tokens_left=msg.tokens_left), facts, commands)
                case wire.MiniBatchDone():
                    self._step(ev.MiniBatchDone(at=now, worker_id=msg.worker_id, step=msg.step, done=msg.done,
                                                total=msg.total), facts, commands)
                case wire.Heartbeat():
                    self._step(ev.Heartbeat(at=now, worker_id=msg.worker_id), facts, commands)
                    if msg.ack:
                        outbox.append((sock, item.identity, wire.encode(
                            wire.HeartbeatAck(seq=msg.seq, boot_id=self.boot_id))))
                case wire.Hello():
                    if msg.protocol != wire.PROTOCOL_VERSION:
                        raise _Reply(wire.ErrorCode.BAD_VERSION,
                                     f"protocol {msg.protocol} not supported; this daemon speaks "
                                     f"{wire.PROTOCOL_VERSION}")
                    before = self.state.workers.get(msg.worker_id)
                    here = (msg.worker_id in self._tokens and before is not None and bool(msg.process)
                            and before.process == msg.process)
                    self._step(ev.WorkerHello(at=now, worker_id=msg.worker_id, kind=msg.kind,
                                              devices=tuple(msg.devices), process=msg.process, actual=msg.actual,
                                              previous_connected=self._still_connected(msg, item.identity),
                                              registered_here=here, secret_sha256=secret_digest(msg.secret)),
                               facts, commands)
                    worker = self.state.workers[msg.worker_id]
                    if here and before is not None and before.incarnation == worker.incarnation:
                        token = self._tokens[msg.worker_id]  # the same registration: its token stands
                    else:
                        token = self._tokens[msg.worker_id] = secrets.token_hex(16)
                    self._routes[msg.worker_id] = item.identity
                    outbox.append((sock, item.identity, wire.encode(wire.Welcome(
                        protocol=wire.PROTOCOL_VERSION, worker_id=msg.worker_id, incarnation=worker.incarnation,
                        boot_id=self.boot_id, heartbeat_interval_s=self.config.daemon.heartbeat_interval_s,
                        heartbeat_timeout_s=self.config.core.heartbeat_timeout_s,
                        candidates=self.state.candidates, token=token,
                        pool=self.state.pool_of(worker), desired=self.state.desired(worker)))))
                    # The op re-sent to a re-registered worker must follow its Welcome: the outbox
                    # leaves in order, and commands are queued after this item's replies.
                case wire.StepReport():
                    self._step(ev.StepReported(at=now, worker_id=msg.worker_id, timing=msg.timing), facts, commands)
                case wire.OpResult():
                    self._step(ev.OpReported(at=now, worker_id=msg.worker_id, op_id=msg.op_id, ok=msg.ok,
                                             detail=msg.detail, actual=msg.actual), facts, commands)
                case wire.StateReport():
                    self._step(ev.StateReported(at=now, worker_id=msg.worker_id, actual=msg.actual), facts, commands)
                case wire.Bye():
                    self._step(ev.WorkerBye(at=now, worker_id=msg.worker_id), facts, commands)
                    self._tokens.pop(msg.worker_id, None)
        except _Reply as r:
            self.core_refusals.record(r.reason or r.code.value, "refused", worker=getattr(msg, "worker_id", ""),
                                      type=type(msg).__struct_config__.tag, code=r.code.value, error=r.message)
            if r.reason in _NOBODY and self.intake.refused(item.identity, None, r.reason):
                return  # messages of no registered worker, past the budget: dropped for the rest of the window
            outbox.append((sock, item.identity, wire.encode(wire.Error(
                code=r.code, message=r.message, reason=r.reason, ref_type=type(msg).__struct_config__.tag,
                token=getattr(msg, "token", "")))))

    def _step(self, event: ev.Event, facts: list[f.Fact], commands: list[Command]) -> None:
        """Step the core; a refusal becomes an error reply to the sender and changes nothing."""
        try:
            self.state, new_facts, new_commands = self.core.step(self.state, event)
        except Refused as exc:
            raise _Reply(wire.ErrorCode.REFUSED, exc.message, exc.code) from None
        except IllegalTransition as exc:
            raise _Reply(wire.ErrorCode.REFUSED, str(exc), "illegal_transition") from None
        facts.extend(new_facts)
        commands.extend(new_commands)

    def _on_tick(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        mono = time.monotonic()  # the watchdog is about wall time, whatever daemon.time_scale says
        if self.notifier.watchdog_interval_s is not None and mono - self._last_watchdog >= \
                self.notifier.watchdog_interval_s:
            self.notifier.watchdog()  # sent by the reactor itself: a stuck reactor gets restarted
            self._last_watchdog = mono
        if self._stop_deadline is not None and not self._abort_sent and now >= self._stop_deadline \
                and self.state.inflight is not None:
            self._abort_sent = True
            log.warning("drain timeout: rolling back the resize in flight",
                        resize_id=self.state.inflight.plan.resize_id)
            self._step_quiet(ev.AbortRequested(at=now, requested_by="shutdown",
                                               reason=f"drain_timeout_s={self.config.daemon.drain_timeout_s:g} "
                                                      "passed"), facts, commands)

    def _reload(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        """Take [policy] and [guards] from the configuration file, or keep both as they are.

        They are read by the core only when it decides on a new resize, so a resize in flight
        runs on as planned. A file that does not load, or a policy that does not build, changes
        nothing: the daemon never stops over a reload. Other sections take effect at restart.
        Either way the log records it (`config_reloaded` or `reload_refused`)."""
        self.notifier.reloading()
        try:
            if self.config_path is None:
                raise ConfigError("the daemon was started without a configuration file")
            new = load_config(self.config_path)
            policy = configured_policy(new)
        except (ConfigError, StartupError) as exc:
            log.error("reload refused: the running policy and guards are kept", error=str(exc))
            self._step_quiet(ev.ReloadRefused(at=now, reason=str(exc)[:4000]), facts, commands)
            self.notifier.ready(f"reload refused: {str(exc).splitlines()[0]}")
            return
        restart_only = [name for name in Config.__struct_fields__ if name not in ("policy", "guards")
                        and getattr(new, name) != getattr(self.config, name)]
        if restart_only:
            log.warning("reload: changes to these sections take effect at the next start", sections=restart_only)
        changed = {key: [old, value] for key, old, value in (
            (k, getattr(self.config.guards, k), getattr(new.guards, k)) for k in new.guards.__struct_fields__)
            if old != value}
        self.config = msgspec.structs.replace(self.config, policy=new.policy, guards=new.guards)
        self.policy = policy
        self.core.policy = policy
        self.core.config = self.config.core_config()
        self._step_quiet(ev.ConfigReloaded(at=now, policy=policy.name, options=dict(new.policy.options),
                                           guards_changed={k: (old, value) for k, (old, value) in changed.items()},
                                           restart_only=tuple(restart_only)), facts, commands)
        log.info("reloaded", policy=policy.name, options=dict(new.policy.options), guards_changed=changed,
                 resize_in_flight=self.state.inflight.plan.resize_id if self.state.inflight else None)
        self.notifier.ready(f"reloaded; policy {policy.name}")

    def _step_quiet(self, event: ev.Event, facts: list[f.Fact], commands: list[Command]) -> None:
        try:
            self._step(event, facts, commands)
        except _Reply as r:  # operator/daemon events are accepted in every phase; log if not
            log.error("daemon event refused", event=type(event).__name__, error=r.message)

    def _control(self, item: _ControlIn, now: float, facts: list[f.Fact], commands: list[Command],
                 outbox: list[tuple[zmq.asyncio.Socket, bytes, bytes]]) -> None:
        msg = item.msg
        match msg:
            case wire.StatusRequest():
                reply = wire.ControlReply(ok=True, message="status", data=status_of(self.state, self))
            case wire.PauseRequest():
                self._step_quiet(ev.PauseRequested(at=now, requested_by="operator", reason=msg.reason), facts,
                                 commands)
                reply = wire.ControlReply(ok=True, message="resizing paused")
            case wire.ResumeRequest():
                self._step_quiet(ev.ResumeRequested(at=now, requested_by="operator"), facts, commands)
                reply = wire.ControlReply(ok=True, message="resizing resumed")
            case wire.ResizeRequest():
                event = ev.ResizeRequested(at=now, target=Split(train=msg.train, rollout=msg.rollout),
                                           requested_by="operator", reason=msg.reason)
                reply = self._start_sequence(event, f.ResizeStarted, facts, commands)
            case wire.RegroupRequest():
                event = ev.RegroupRequested(at=now, devices=tuple(msg.devices), tp=msg.tp, requested_by="operator",
                                            reason=msg.reason)
                reply = self._start_sequence(event, f.RegroupStarted, facts, commands)
            case wire.DrainRequest():
                self._begin_stop(now, facts, commands)
                reply = wire.ControlReply(ok=True, message="draining: no new resize; the daemon exits when the "
                                                           "resize in flight has finished or rolled back")
            case _:  # pragma: no cover - the decoder admits only the types above
                return
        if item.identity:
            assert self.control_sock is not None
            outbox.append((self.control_sock, item.identity, wire.encode(reply)))

    def _start_sequence(self, event: ev.Event, started: type[f.Fact], facts: list[f.Fact],
                        commands: list[Command]) -> wire.ControlReply:
        """An operator's resize or regroup: ok when `started` (its start fact) was written; the
        message explains that fact or the guard that refused it."""
        before = len(facts)
        self._step_quiet(event, facts, commands)
        new = facts[before:]
        text = "; ".join(explain(x) for x in new if isinstance(x, started | f.ProposalRejected))
        return wire.ControlReply(ok=any(isinstance(x, started) for x in new), message=text or "nothing to do")

    def _begin_stop(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = now + self.config.daemon.drain_timeout_s * self.scale
            self.notifier.stopping("draining")
            log.info("draining", resize_in_flight=self.state.inflight is not None,
                     drain_timeout_s=self.config.daemon.drain_timeout_s)
            self._step_quiet(ev.ShutdownRequested(at=now), facts, commands)

    def _queue_op(self, command: Command, outbox: list[tuple[zmq.asyncio.Socket, bytes, bytes]],
                  encoded: dict[tuple[object, ...], bytes]) -> None:
        assert self.workers_sock is not None
        route = self._routes.get(command.worker_id, command.worker_id.encode())
        if isinstance(command, QueryState):
            outbox.append((self.workers_sock, route, wire.encode(wire.StateQuery(boot_id=self.boot_id))))
            return
        op = command.op
        # The message names both pools whole: encoded once per op and batch, not once per target
        # (a commit goes to a worker of every device: that was quadratic in the cluster). The
        # core hands every target of one send the same pool tuples, alive for this batch.
        key = (op.op_id, command.resize_id, command.deadline, command.plan, id(command.training), id(command.rollout),
               command.engine)
        data = encoded.get(key)
        if data is None:
            msg = wire.OpCommand(op_id=op.op_id, resize_id=command.resize_id, kind=op.kind, devices=op.devices,
                                 from_pool=op.from_pool, to_pool=op.to_pool,
                                 timeout_s=max(command.deadline - self.clock(), 0.0) / self.scale,
                                 training=command.training, rollout=command.rollout, plan=command.plan,
                                 engine=command.engine)
            data = encoded[key] = wire.encode(msg)
        outbox.append((self.workers_sock, route, data))

    @staticmethod
    def _log_ops(commands: list[Command]) -> None:
        """One line per op sent (a commit goes to a worker of every device: at 1,024 devices a
        line per target was thousands a resize), naming its first 8 targets (all at debug)."""
        sent: dict[tuple[str, str, str], list[str]] = {}
        for command in commands:
            if not isinstance(command, QueryState):
                sent.setdefault((command.op.op_id, command.op.kind.value, command.resize_id), []).append(
                    command.worker_id)
        every = log.is_enabled_for(logging.DEBUG)
        for (op_id, kind, resize_id), workers in sent.items():
            shown = workers if every or len(workers) <= 8 else [*workers[:8], f"... {len(workers) - 8} more"]
            log.info("op sent", op_id=op_id, op=kind, resize_id=resize_id, targets=len(workers), workers=shown)

    def _persist(self, facts: list[f.Fact], state: ClusterState) -> None:
        """Append facts durably (and snapshot now and then). Runs in the writer thread."""
        assert self.factlog is not None
        self.factlog.append(facts)
        self.factlog.maybe_snapshot(state)


def scaled_clock(scale: float) -> Callable[[], float]:
    """Wall-clock seconds, or with `scale` != 1 a clock that runs `scale` times faster from now
    (daemon.time_scale: the demo's daemon then lives in simulated time, and so does its log)."""
    if scale == 1.0:
        return time.time
    origin = time.time()
    return lambda: origin + (time.time() - origin) * scale


class _Reply(Exception):
    def __init__(self, code: wire.ErrorCode, message: str, reason: str = "") -> None:
        self.code, self.message, self.reason = code, message, reason
        super().__init__(message)


def run_daemon(config: Config, config_path: str | Path | None = None) -> int:
    """Run the daemon on uvloop until it drains; returns the exit code. SIGHUP re-reads
    [policy] and [guards] from `config_path`."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    check_startup(config, read_log=False)  # every root cause at once, the policy's among them
    raise_open_files(config)  # a connection per worker: systemd's soft 1,024 is 512 devices' worth
    daemon = Daemon(config, config_path=config_path)
    return runner(daemon.run())


__all__ = ["EVENTS_FILE", "Daemon", "StartupError", "idle_status", "outcome_status", "run_daemon", "status_of", "Phase"]
