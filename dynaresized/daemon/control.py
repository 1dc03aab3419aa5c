"""What operators ask through the control socket: status, pause and resume, a resize or regroup,
and drain. The control ingress checks the frames, the protocol and the control secret; the
reactor hands the requests here, and asks when a drain is done."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from dynaresized import wire
from dynaresized.control import control_secret_file
from dynaresized.core import Command
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.daemon.cluster import Cluster
from dynaresized.daemon.config import Config
from dynaresized.daemon.endpoints import Endpoints, Outbox, send_error
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.notify import Notifier
from dynaresized.daemon.reactor import ControlIn, Items
from dynaresized.daemon.security import Refusals
from dynaresized.domain import Split
from dynaresized.explain import explain

log = structlog.get_logger("dynaresized")


class Control:
    def __init__(self, config: Config, cluster: Cluster, endpoints: Endpoints, queue: asyncio.Queue[Items], *,
                 status: Callable[[], dict[str, Any]], notifier: Notifier, metrics: Metrics,
                 refusals: Refusals) -> None:
        self.config, self.cluster, self.status = config, cluster, status
        self.endpoints, self.queue = endpoints, queue  # requests in; replies leave through the reactor's outbox
        self.notifier, self.metrics, self.refusals = notifier, metrics, refusals
        self.stop_deadline: float | None = None  # set once a drain began
        self._abort_sent = False
        self._control_decoder = wire.control_decoder(config.daemon.max_message_bytes)

    async def serve(self) -> None:
        """The control ingress: a request that passes its checks goes on the reactor's queue."""
        sock = self.endpoints.control_sock
        assert sock is not None
        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            frames = await sock.recv_multipart()
            identity = frames[0]
            if len(frames) != 3:  # the ROUTER's identity, then the secret (empty for status) and the request
                self._count_decode_error(wire.ErrorCode.MALFORMED)
                send_error(raw, identity, wire.ErrorCode.MALFORMED,
                           f"a control request is two frames, the control secret (empty for status) and the "
                           f"request; got {len(frames) - 1}", reason="frames")
                continue
            _, secret, payload = frames
            try:
                msg = self._control_decoder.decode(payload)
            except wire.WireError as exc:
                self._count_decode_error(exc.kind)
                send_error(raw, identity, exc.kind, exc.message)
                continue
            if msg.protocol != wire.PROTOCOL_VERSION:
                send_error(raw, identity, wire.ErrorCode.BAD_VERSION,
                           f"protocol {msg.protocol} not supported; this daemon speaks {wire.PROTOCOL_VERSION}")
                continue
            if type(msg) is not wire.StatusRequest and not secrets.compare_digest(secret,
                                                                                 self.endpoints.control_secret):
                tag = type(msg).__struct_config__.tag
                self.refusals.record("control_secret", "refused a control request without the control secret",
                                     request=tag)
                send_error(raw, identity, wire.ErrorCode.UNAUTHORIZED,
                           f"{tag} needs the control secret in "
                           f"{control_secret_file(self.config.daemon.state_dir)}: run the CLI as the daemon's "
                           "user or root, with the daemon's --config",
                           reason="missing_secret" if not secret else "wrong_secret", ref=msg)
                continue
            self.queue.put_nowait([ControlIn(identity, msg)])

    def _count_decode_error(self, kind: wire.ErrorCode) -> None:
        self.metrics.decode_errors.labels(kind.value).inc()

    def handle(self, item: ControlIn, now: float, facts: list[f.Fact], commands: list[Command],
               outbox: Outbox) -> None:
        msg = item.msg
        step_quiet = self.cluster.step_quiet
        match msg:
            case wire.StatusRequest():
                reply = wire.ControlReply(ok=True, message="status", data=self.status())
            case _ if self.cluster.disk_full and type(msg) is not wire.DrainRequest:
                reply = wire.ControlReply(ok=False, message=f"refused: the disk under the event log is full, so "
                                                            f"nothing that would be recorded is accepted "
                                                            f"({self.cluster.disk_full})")
            case wire.PauseRequest():
                step_quiet(ev.PauseRequested(at=now, requested_by="operator", reason=msg.reason), facts, commands)
                reply = wire.ControlReply(ok=True, message="resizing paused")
            case wire.ResumeRequest():
                step_quiet(ev.ResumeRequested(at=now, requested_by="operator"), facts, commands)
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
                self.begin_stop(now, facts, commands)
                reply = wire.ControlReply(ok=True, message="draining: no new resize; the daemon exits when the "
                                                           "resize in flight has finished or rolled back")
            case _:  # pragma: no cover - the decoder admits only the types above
                return
        if item.identity:
            assert self.endpoints.control_sock is not None
            outbox.append((self.endpoints.control_sock, item.identity, wire.encode(reply)))

    def _start_sequence(self, event: ev.Event, started: type[f.Fact], facts: list[f.Fact],
                        commands: list[Command]) -> wire.ControlReply:
        """An operator's resize or regroup: ok when `started` (its start fact) was written; the
        message explains that fact or the guard that refused it."""
        before = len(facts)
        self.cluster.step_quiet(event, facts, commands)
        new = facts[before:]
        text = "; ".join(explain(x) for x in new if isinstance(x, started | f.ProposalRejected))
        return wire.ControlReply(ok=any(isinstance(x, started) for x in new), message=text or "nothing to do")

    def begin_stop(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        if self.stop_deadline is None:
            self.stop_deadline = now + self.config.daemon.drain_timeout_s * self.config.daemon.time_scale
            self.notifier.stopping("draining")
            log.info("draining", resize_in_flight=self.cluster.state.inflight is not None,
                     drain_timeout_s=self.config.daemon.drain_timeout_s)
            self.cluster.step_quiet(ev.ShutdownRequested(at=now), facts, commands)

    def on_tick(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        """Past the drain timeout, roll the resize in flight back (once)."""
        state = self.cluster.state
        if self.stop_deadline is not None and not self._abort_sent and now >= self.stop_deadline \
                and state.inflight is not None:
            self._abort_sent = True
            log.warning("drain timeout: rolling back the resize in flight", resize_id=state.inflight.plan.resize_id)
            self.cluster.step_quiet(ev.AbortRequested(at=now, requested_by="shutdown",
                                                      reason=f"drain_timeout_s={self.config.daemon.drain_timeout_s:g} "
                                                             "passed"), facts, commands)

    def drained(self, now: float) -> bool:
        """Once draining: whether the drain is done (no resize in flight, or one past its time)."""
        state = self.cluster.state
        assert self.stop_deadline is not None
        if state.inflight is None:
            log.info("drained", phase=state.phase.value)
            return True
        if now >= self.stop_deadline + self.config.core.op_timeout_s:
            log.error("drain gave up: the resize in flight is recorded and will be reconciled at next start",
                      resize_id=state.inflight.plan.resize_id, phase=state.phase.value)
            return True
        return False
