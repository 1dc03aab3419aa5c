"""The daemon's two ROUTER sockets, the worker endpoint (CURVE) and the control endpoint: bound
with their options, sent on without blocking, watched below the messages, and closed.
Reading them is the ingresses' job (dynaresized/daemon/ingress.py, control.py)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynaresized import wire
from dynaresized.control import control_secret_file
from dynaresized.daemon.config import Config, control_endpoint_of
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.preflight import StartupError
from dynaresized.daemon.security import (
    CurveServer,
    Refusals,
    SecurityError,
    load_control_secret,
    make_state_dir,
    owner_only_umask,
    restrict_ipc_socket,
)

NOBLOCK = int(zmq.NOBLOCK)  # a plain int: IntFlag arithmetic costs more than the receive
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)

# A message queued to be sent: the socket, the peer's routing id, the encoded message
Outbox = list[tuple[zmq.asyncio.Socket, bytes, bytes]]


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


def send_to(raw: zmq.Socket, identity: bytes, data: bytes) -> None:
    """Send `data` to the ROUTER peer `identity` without blocking; raises what the first frame's
    send raises (zmq.Again over the high-water mark, EHOSTUNREACH for a routing id nobody holds).
    Two sends with plain int flags: `send_multipart` ORs IntFlags in Python for every frame, which
    cost more than the sends themselves for a heartbeat's acknowledgement."""
    raw.send(identity, _NOBLOCK_MORE)
    raw.send(data, NOBLOCK)


def send_error(raw: zmq.Socket, identity: bytes, code: wire.ErrorCode, message: str,
               *, reason: str = "", ref: Any = None) -> None:
    ref_type = type(ref).__struct_config__.tag if ref is not None else ""
    err = wire.Error(code=code, message=message, reason=reason, ref_type=ref_type)
    with contextlib.suppress(zmq.ZMQError):  # a peer gone or over its high-water mark
        send_to(raw, identity, wire.encode(err))


# Linux's limits (tcp(7)): larger values make setsockopt fail with EINVAL, and libzmq then
# drops every connection it accepts without a word.
_KEEPIDLE_MAX, _KEEPINTVL_MAX, _KEEPCNT_MAX = 32767, 32767, 127


def keepalive_options(timeout_s: float) -> dict[int, int]:
    """Socket options under which the kernel drops a connection whose peer vanished within about
    `timeout_s` wall seconds (at least 3): keepalive probes from a third of it while idle, and
    `TCP_USER_TIMEOUT` (`ZMQ_TCP_MAXRT`) while sends go unacknowledged, within Linux's limits."""
    timeout_s = max(3.0, timeout_s)
    idle = min(_KEEPIDLE_MAX, max(1, int(timeout_s / 3)))
    rest = max(1.0, timeout_s - idle)
    interval = min(_KEEPINTVL_MAX, max(1, math.ceil(rest / _KEEPCNT_MAX)))
    count = min(_KEEPCNT_MAX, max(1, math.ceil(rest / interval)))
    return {zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: idle, zmq.TCP_KEEPALIVE_INTVL: interval,
            zmq.TCP_KEEPALIVE_CNT: count, zmq.TCP_MAXRT: min(2**31 - 1, int(timeout_s * 1000))}


class Endpoints:
    def __init__(self, config: Config, metrics: Metrics, refusals: Refusals) -> None:
        self.config = config
        self.metrics = metrics
        self.refusals = refusals
        self.ctx: zmq.asyncio.Context | None = None
        self.curve: CurveServer | None = None
        self.workers_sock: zmq.asyncio.Socket | None = None
        self.workers_readable = asyncio.Event()  # the worker socket may have a message (see rearm_workers)
        self.control_sock: zmq.asyncio.Socket | None = None
        self.raw: dict[int, zmq.Socket] = {}  # id(socket) -> its shadow, for sends that must not block (bind)
        self.control_secret = b""
        self.worker_endpoint = ""  # as bound (a tcp port 0 becomes the real port)
        self.control_endpoint = ""

    def bind(self) -> None:
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
        self.raw = {id(sock): zmq.Socket.shadow(sock.underlying) for sock in (self.workers_sock, self.control_sock)}
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
            d = self.config.daemon
            timeout_s = max(self.config.core.heartbeat_timeout_s, 3 * d.heartbeat_interval_s) / d.time_scale
            for option, value in keepalive_options(timeout_s).items():
                sock.setsockopt(option, value)
        sock.setsockopt(zmq.LINGER, 1000)
        # No handover: a second connection for a routing id that is connected must not take the
        # slot (it would take that worker's ops and acks). libzmq parks it unrouted; a restarted
        # worker's old connection is gone by the time its new one shakes hands.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.daemon.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.config.daemon.receive_hwm)
        # A send to a routing id with no connection fails (EHOSTUNREACH) instead of vanishing:
        # that is how a hello tells a duplicate process from a restarted one (`Reactor._still_connected`).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve and self.curve is not None:
            self.curve.apply(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise StartupError(f"cannot bind {endpoint}: {exc}") from None
        return sock

    def close(self) -> None:
        for sock in (self.workers_sock, self.control_sock):
            if sock is not None:
                sock.close(linger=500)
        if self.curve is not None:
            self.curve.stop()
        if self.ctx is not None:
            self.ctx.term()

    def rearm_workers(self) -> None:
        """Look at EVENTS and wake the ingress if a message waits: the descriptor's reader, and
        after every send on the worker socket from outside its ingress (a send landing between a
        message's arrival and the ingress's next look takes the descriptor's wake-up, and the
        ingress would never wake: in the chaos runs, the daemon stopped reading every worker for
        good while it went on sending)."""
        if self.workers_sock is not None and self.raw[id(self.workers_sock)].get(zmq.EVENTS) & POLLIN:
            self.workers_readable.set()

    def send_replies(self, outboxes: list[Outbox]) -> None:
        """Send the replies and commands of stepped batches, in order, without blocking."""
        assert self.workers_sock is not None and self.control_sock is not None
        raw = self.raw
        for outbox in outboxes:
            for sock, identity, data in outbox:
                try:  # not contextlib.suppress: one object and two calls less per reply
                    send_to(raw[id(sock)], identity, data)
                except zmq.ZMQError:  # a peer gone or over its high-water mark
                    pass
        if any(outboxes):  # see rearm_workers and _rearm
            self.rearm_workers()
            _rearm(self.control_sock)

    async def watch_worker_connections(self, live_workers: Callable[[], int]) -> None:
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
        grace = max(self.config.core.heartbeat_timeout_s / self.config.daemon.time_scale, 1.0)
        raw = zmq.Socket.shadow(monitor.underlying)
        try:
            while True:
                # Drain every event at once: libzmq's I/O thread blocks on a full monitor queue,
                # and then the whole socket stalls.
                await monitor.poll(timeout=int(grace * 500), flags=zmq.POLLIN)
                while True:
                    try:
                        event = parse_monitor_message(raw.recv_multipart(NOBLOCK))
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
                live = live_workers()
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
