"""The reactor: one task owns the cluster state and reads one queue. For each batch it turns
worker messages into events (after their token checks), steps the core, and hands the facts,
replies and commands to the group commit, which lets them out once the facts are durable."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import zmq

from dynaresized import wire
from dynaresized.core import Command, QueryState
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.daemon.cluster import Cluster, Reply
from dynaresized.daemon.config import Config
from dynaresized.daemon.endpoints import Endpoints, Outbox, send_to
from dynaresized.daemon.intake import Intake, ReportRate
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.notify import Notifier
from dynaresized.daemon.security import Refusals, secret_digest

if TYPE_CHECKING:
    from dynaresized.daemon.commit import GroupCommit
    from dynaresized.daemon.control import Control
    from dynaresized.daemon.reload import PolicyReload

log = structlog.get_logger("dynaresized")

BATCH = 512  # queue items the reactor steps at once; messages the worker ingress takes at once

# Reports that write facts: rate-bounded per worker (daemon.report_rate)
_FACT_REPORTS = frozenset({wire.QueueEmpty, wire.MiniBatchDone, wire.StepReport, wire.StateReport})
# Core refusals of messages that no registered worker sent: they count against the connection's
# junk budget (daemon.junk_budget), as malformed frames do
_NOBODY = frozenset({"unknown_worker", "not_registered"})


class WorkerIn(msgspec.Struct):
    identity: bytes
    msg: Any  # a wire.WorkerMessage


class ControlIn(msgspec.Struct):
    identity: bytes
    msg: Any  # a wire.ControlRequest


class TickIn(msgspec.Struct):
    pass


class ReloadIn(msgspec.Struct):
    """SIGHUP: re-read [policy] and [guards] from the configuration file."""


Items = list[WorkerIn | ControlIn | TickIn | ReloadIn]  # what the reactor's queue holds


class Reactor:
    def __init__(self, config: Config, cluster: Cluster, queue: asyncio.Queue[Items], *, endpoints: Endpoints,
                 commit: GroupCommit, control: Control, reload: PolicyReload, clock: Callable[[], float],
                 metrics: Metrics, notifier: Notifier, boot_id: str, intake: Intake) -> None:
        self.config, self.clock, self.boot_id = config, clock, boot_id
        self.scale = config.daemon.time_scale
        self.cluster = cluster
        self._step = cluster.step  # bound once: the per-message path finds it on the instance
        self.queue, self.intake = queue, intake  # what comes in, and the junk budget of who sent it
        self.control, self.reload = control, reload  # where operator requests and SIGHUP go
        self.endpoints, self.commit = endpoints, commit  # what goes out, once durable
        self.metrics, self.notifier = metrics, notifier
        self.report_rate = ReportRate(config.daemon.report_rate, config.daemon.report_burst)
        # core refusals: every one counted, a log line per reason every 10 s
        self.core_refusals = Refusals(metrics.refusals)
        self._last_watchdog = 0.0
        # Per-registration tokens and routing ids, in memory only: a restarted daemon knows none,
        # so every worker says hello again (its messages are refused as `stale_token` until then).
        self._tokens: dict[str, str] = {}
        self._routes: dict[str, bytes] = {}

    async def run(self) -> None:
        """Step what the queue holds, a batch at a time, until a drain is done and durable."""
        control = self.control
        while True:
            items = await self.queue.get()
            while len(items) < BATCH:
                try:
                    items.extend(self.queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            facts: list[f.Fact] = []
            commands: list[Command] = []
            outbox: Outbox = []
            for item in items:
                self._handle(item, facts, commands, outbox)
            encoded: dict[tuple[object, ...], bytes] = {}  # an op goes to every target as the same bytes
            for command in commands:
                self._queue_op(command, outbox, encoded)
            if commands:
                self._log_ops(commands)
            await self.commit.add(facts, self.cluster.state, outbox)
            if control.stop_deadline is not None and control.drained(self.clock()):
                await self.commit.flush()
                return

    def _handle(self, item: Any, facts: list[f.Fact], commands: list[Command], outbox: Outbox) -> None:
        now = self.clock()
        if type(item) is not WorkerIn:
            if isinstance(item, TickIn):
                if self.cluster.disk_full:  # no loss declared, no op timed out or re-sent meanwhile
                    self._on_tick(now, facts, commands)
                    return
                self._step(ev.Tick(at=now), facts, commands)
                self._on_tick(now, facts, commands)
            elif isinstance(item, ControlIn):
                self.control.handle(item, now, facts, commands, outbox)
            elif isinstance(item, ReloadIn):
                self.reload.apply(now, facts, commands)
            return
        sock = self.endpoints.workers_sock
        assert sock is not None
        msg = item.msg
        self.metrics.message(type(msg))
        try:
            if type(msg) is not wire.Hello:
                self._check_token(msg)
                if type(msg) in _FACT_REPORTS and not self.report_rate.take(msg.worker_id, now):
                    raise Reply(wire.ErrorCode.REFUSED,
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
                        raise Reply(wire.ErrorCode.BAD_VERSION,
                                    f"protocol {msg.protocol} not supported; this daemon speaks "
                                    f"{wire.PROTOCOL_VERSION}")
                    state = self.cluster.state
                    before = state.workers.get(msg.worker_id)
                    here = (msg.worker_id in self._tokens and before is not None and bool(msg.process)
                            and before.process == msg.process)
                    self._step(ev.WorkerHello(at=now, worker_id=msg.worker_id, kind=msg.kind,
                                              devices=tuple(msg.devices), process=msg.process, actual=msg.actual,
                                              previous_connected=self._still_connected(msg, item.identity),
                                              registered_here=here, secret_sha256=secret_digest(msg.secret)),
                               facts, commands)
                    state = self.cluster.state  # as the hello left it
                    worker = state.workers[msg.worker_id]
                    if here and before is not None and before.incarnation == worker.incarnation:
                        token = self._tokens[msg.worker_id]  # the same registration: its token stands
                    else:
                        token = self._tokens[msg.worker_id] = secrets.token_hex(16)
                    self._routes[msg.worker_id] = item.identity
                    outbox.append((sock, item.identity, wire.encode(wire.Welcome(
                        protocol=wire.PROTOCOL_VERSION, worker_id=msg.worker_id, incarnation=worker.incarnation,
                        boot_id=self.boot_id, heartbeat_interval_s=self.config.daemon.heartbeat_interval_s,
                        heartbeat_timeout_s=self.config.core.heartbeat_timeout_s,
                        candidates=state.candidates, token=token,
                        pool=state.pool_of(worker), desired=state.desired(worker)))))
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
        except Reply as r:
            self.core_refusals.record(r.reason or r.code.value, "refused", worker=getattr(msg, "worker_id", ""),
                                      type=type(msg).__struct_config__.tag, code=r.code.value, error=r.message)
            if r.reason in _NOBODY and self.intake.refused(item.identity, None, r.reason):
                return  # messages of no registered worker, past the budget: dropped for the rest of the window
            outbox.append((sock, item.identity, wire.encode(wire.Error(
                code=r.code, message=r.message, reason=r.reason, ref_type=type(msg).__struct_config__.tag,
                token=getattr(msg, "token", "")))))

    def _on_tick(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        mono = time.monotonic()  # the watchdog is about wall time, whatever daemon.time_scale says
        if self.notifier.watchdog_interval_s is not None and mono - self._last_watchdog >= \
                self.notifier.watchdog_interval_s:
            self.notifier.watchdog()  # sent by the reactor itself: a stuck reactor gets restarted
            self._last_watchdog = mono
        self.control.on_tick(now, facts, commands)

    def _check_token(self, msg: Any) -> None:
        """Every message after hello carries the token of the registration it belongs to."""
        worker_id = msg.worker_id
        token = self._tokens.get(worker_id)
        if token is None:
            if self.cluster.state.is_live(worker_id):  # live in the log, not yet registered with this boot
                raise Reply(wire.ErrorCode.REFUSED,
                            f"the daemon restarted (boot {self.boot_id}) since worker {worker_id!r} registered; "
                            "say hello again", "stale_token")
            return  # unknown or lost: the core says so (unknown_worker, not_registered)
        if msg.token != token:
            if not msg.token:
                raise Reply(wire.ErrorCode.REFUSED,
                            f"messages of worker {worker_id!r} must carry the token its welcome gave "
                            f"(protocol {wire.PROTOCOL_VERSION})", "missing_token")
            raise Reply(wire.ErrorCode.REFUSED,
                        f"the token does not belong to worker {worker_id!r}'s current registration (another "
                        "process registered under this id since, or this one was re-registered): say hello again",
                        "stale_token")

    def _still_connected(self, msg: wire.Hello, identity: bytes) -> bool:
        """Whether a hello from a new process finds the live registration's connection still open
        (a duplicate process started by mistake, or someone claiming its id) rather than gone
        (the old process died). Before the old process has said hello to this daemon start, its
        connection is the one its identity names (`<worker_id>#<process>`, see
        WorkerIngress._authenticate): its DEALER reconnects to a restarted daemon by itself."""
        state = self.cluster.state
        old = state.workers.get(msg.worker_id)
        if old is None or not state.is_live(msg.worker_id) or not old.process or old.process == msg.process:
            return False
        route = self._routes.get(msg.worker_id, f"{msg.worker_id}#{old.process}".encode())
        if route == identity:
            return False
        endpoints = self.endpoints
        assert endpoints.workers_sock is not None
        try:
            send_to(endpoints.raw[id(endpoints.workers_sock)], route,
                    wire.encode(wire.HeartbeatAck(seq=0, boot_id=self.boot_id)))
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: nobody holds that routing id any more
        finally:
            endpoints.rearm_workers()  # the reactor's send: see Endpoints.rearm_workers
        return True

    def _queue_op(self, command: Command, outbox: Outbox, encoded: dict[tuple[object, ...], bytes]) -> None:
        sock = self.endpoints.workers_sock
        assert sock is not None
        route = self._routes.get(command.worker_id, command.worker_id.encode())
        if isinstance(command, QueryState):
            outbox.append((sock, route, wire.encode(wire.StateQuery(boot_id=self.boot_id))))
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
        outbox.append((sock, route, data))

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

