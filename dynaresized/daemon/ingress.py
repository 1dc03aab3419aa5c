"""The worker ingress: frames in, events out (it never touches the state). It reads the worker
socket in batches handed on at most every `daemon.batch_window_ms`, yields after a full one,
and refuses what does not decode or authenticate before the reactor sees it."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import zmq

from dynaresized import wire
from dynaresized.daemon.config import Config
from dynaresized.daemon.endpoints import NOBLOCK, POLLIN, Endpoints, send_error
from dynaresized.daemon.intake import Intake
from dynaresized.daemon.reactor import BATCH, Items, WorkerIn
from dynaresized.daemon.security import CurveServer, Refusals


class WorkerIngress:
    def __init__(self, config: Config, endpoints: Endpoints, queue: asyncio.Queue[Items], intake: Intake,
                 frame_refusals: Refusals) -> None:
        self.config = config
        self.endpoints = endpoints
        self.queue = queue
        self.intake = intake
        # refused frames: every one counted, a log line per kind every 10 s (a flood must not fill the journal)
        self.frame_refusals = frame_refusals
        self.curve: CurveServer | None = None  # the endpoints' once bound
        self._worker_decoder = wire.worker_decoder(config.daemon.max_message_bytes)

    async def run(self) -> None:
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
        endpoints = self.endpoints
        assert endpoints.workers_sock is not None
        self.curve = endpoints.curve
        raw = endpoints.raw[id(endpoints.workers_sock)]
        loop = asyncio.get_running_loop()
        fd = raw.getsockopt(zmq.FD)
        endpoints.workers_readable = asyncio.Event()  # of this loop
        # The descriptor stays readable until EVENTS is read, and the loop's selector asks it
        # level-triggered: the reader reads EVENTS, or the loop spins while a batch waits its window.
        loop.add_reader(fd, endpoints.rearm_workers)
        try:
            await self._drain(raw, loop)
        finally:
            loop.remove_reader(fd)

    async def _wait(self, raw: zmq.Socket) -> None:
        """Until the worker socket has a message. The descriptor is edge-triggered: reading
        EVENTS re-arms it, so a message that arrives after the read sets the event. A send on
        the socket can take that edge (see `Endpoints.rearm_workers`)."""
        while not raw.get(zmq.EVENTS) & POLLIN:
            self.endpoints.workers_readable.clear()
            await self.endpoints.workers_readable.wait()

    async def _drain(self, raw: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        handed = -math.inf  # when the last batch was handed on (-inf: take the next one at once)
        intake = self.intake
        dropped_from = intake.cut_ids  # the identities of cut connections (a set lookup per message)
        while True:
            await self._wait(raw)
            # in the daemon's clock: a demo's daemon, whose clock runs time_scale times faster,
            # waits as much of its own time as a real one does
            window_s = self.config.daemon.batch_window_ms / 1000.0 / self.config.daemon.time_scale
            wait = handed + window_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            batch: list[WorkerIn] = []
            drained = False
            for _ in range(BATCH):
                try:
                    # A ROUTER delivers a message whole, as the sender's routing id and at least
                    # one frame after it, so the payload is there once the id is. The id as bytes;
                    # the payload as a Frame: `Frame.more` is an attribute, where recv_multipart
                    # asks the socket for RCVMORE through the Python layer for every frame.
                    identity = raw.recv(NOBLOCK)
                    payload = raw.recv(NOBLOCK, copy=False)
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
            send_error(raw, identity, kind, message, reason=reason, ref=ref)

    def _admit(self, raw: zmq.Socket, identity: bytes, payload: zmq.Frame) -> WorkerIn | None:
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
        return WorkerIn(identity, msg)

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
