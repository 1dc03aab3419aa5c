"""Fair, bounded intake on the worker endpoint: one connection's junk cannot starve the others.

A connection gets `daemon.junk_budget` refused frames (malformed, several payload frames, a
wrong identity or key) per `daemon.junk_window_s`, each answered with an `error`. The next one
cuts it: its TCP connection is shut down under libzmq (which then drops it as if the peer had
gone), `dynaresized_connections_cut_total{reason}` counts it, one log line says so, and what it
had already queued is dropped unread. Registered workers never come near the budget: our client
stops sending on a refusal and says hello again.

Memory is bounded by the socket: each connection queues at most `daemon.receive_hwm` messages
of at most `daemon.max_message_bytes` before libzmq stops reading it (TCP then pushes back).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import structlog
import zmq
from prometheus_client import Counter

log = structlog.get_logger("dynaresized")

_SRCFD = int(zmq.SRCFD)  # the descriptor of the connection a message came in on (libzmq metadata)
_LOG_EVERY_S = 10.0


def _connection(fd: int) -> socket.socket | None:
    """A socket object over a duplicate of `fd` (closing it closes the duplicate only), or None
    where `fd` is not open any more."""
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


def _peer_of(fd: int) -> object:
    """The peer address of the connection on descriptor `fd`, or None where it is not a socket
    (any more): checked again before a cut, so a descriptor number that libzmq closed and reused
    for another connection meanwhile is never cut."""
    s = _connection(fd)
    if s is None:
        return None
    with s:
        try:
            return s.getpeername()
        except OSError:
            return None


def _shut(fd: int, peer: object) -> bool:
    """Shut the connection on `fd` down if it is still the one whose peer was `peer`."""
    s = _connection(fd) if peer is not None else None
    if s is None:
        return False
    with s:
        try:
            if s.getpeername() != peer:
                return False
            s.shutdown(socket.SHUT_RDWR)  # the connection, not the descriptor: libzmq sees it end
        except OSError:
            return False
    return True


class Intake:
    """Per-connection budgets of refused frames on the worker endpoint (see the module)."""

    def __init__(self, budget: int, window_s: float, cut_counter: Counter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.window_s = window_s
        self.cut_counter = cut_counter
        self.clock = clock
        self._refused: dict[bytes, tuple[float, int, int, object]] = {}  # id -> (window start, count, fd, peer)
        self._cut: dict[bytes, tuple[float, int]] = {}  # id -> (when cut, fd)
        self._pruned = clock()
        self._logged = -_LOG_EVERY_S
        self._unsaid = 0

    def dropped(self, identity: bytes, frame: zmq.Frame) -> bool:
        """Whether a message from `identity` is dropped unread: it came from a connection that
        was cut (what it had queued before the cut took effect), or from an identity whose
        messages the core refused past the budget (dropped for the rest of the window). A new
        connection that took the same identity since, or one a window after the cut, is read
        as any other."""
        cut = self._cut.get(identity)
        if cut is None:
            return False
        when, fd = cut
        if (fd < 0 or frame.get(_SRCFD) == fd) and self.clock() - when < self.window_s:
            return True
        del self._cut[identity]
        return False

    def refused(self, identity: bytes, frame: zmq.Frame | None, reason: str) -> bool:
        """Count one refused frame from `identity` (`frame` None: a message the core refused,
        whose connection is not known here). True when this one took the connection over its
        budget and it was cut: say nothing more to it."""
        now = self.clock()
        entry = self._refused.get(identity)
        if entry is None or now - entry[0] >= self.window_s:
            fd = frame.get(_SRCFD) if frame is not None else -1
            entry = (now, 0, fd, _peer_of(fd) if fd >= 0 else None)
        start, count, fd, peer = entry
        count += 1
        if now - self._pruned >= self.window_s:
            self._prune(now)
        if count <= self.budget:
            self._refused[identity] = (start, count, fd, peer)
            return False
        self._refused.pop(identity, None)
        self._cut[identity] = (now, fd)
        shut = fd >= 0 and _shut(fd, peer)
        self.cut_counter.labels(reason).inc()
        if now - self._logged >= _LOG_EVERY_S:
            log.warning("cut a connection to the worker endpoint that sent junk", reason=reason,
                        peer=identity.hex()[:16], refused=count - 1, window_s=self.window_s, shut=shut,
                        **({"cut_unlogged_since_last": self._unsaid} if self._unsaid else {}))
            self._logged, self._unsaid = now, 0
        else:
            self._unsaid += 1
        return True

    @property
    def cut_ids(self) -> dict[bytes, tuple[float, int]]:
        """The identities of connections cut within the last window (the same object for the
        intake's life: the ingress looks every message's identity up in it)."""
        return self._cut

    def _prune(self, now: float) -> None:
        """Forget budgets whose window ended and cuts older than a window: bounded by the
        connections seen in one window."""
        self._pruned = now
        self._refused = {k: v for k, v in self._refused.items() if now - v[0] < self.window_s}
        for k in [k for k, (when, _) in self._cut.items() if now - when >= self.window_s]:
            del self._cut[k]

    def __len__(self) -> int:
        return len(self._refused) + len(self._cut)


class ReportRate:
    """A token bucket per worker for the reports that write facts (`queue_empty`,
    `mini_batch_done`, `step_report`, `state_report`): `daemon.report_rate` a second on the
    daemon's clock, bursts of `daemon.report_burst`. A report over it is refused `rate_limited`
    and changes nothing; a worker that follows the protocol sends a few a step."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # worker id -> (tokens, when)

    def take(self, worker_id: str, now: float) -> bool:
        tokens, when = self._buckets.get(worker_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            self._buckets[worker_id] = (tokens, now)
            return False
        self._buckets[worker_id] = (tokens - 1.0, now)
        return True

    def forget(self, worker_id: str) -> None:
        self._buckets.pop(worker_id, None)
