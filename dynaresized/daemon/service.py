"""The daemon: starts up (bind, replay), composes its parts and runs them as root tasks.

Its parts: endpoints.py (sockets), ingress.py (worker frames in), control.py (operator requests),
reactor.py (the one task that steps the state cluster.py holds), commit.py (facts durable before
anything leaves), status.py, reload.py. Root tasks are guarded: one that ends unexpectedly stops
the daemon with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import structlog

from dynaresized import wire
from dynaresized.core import Command, Core
from dynaresized.core import events as ev
from dynaresized.core.policy import Policy
from dynaresized.core.state import Phase
from dynaresized.daemon.cluster import Cluster
from dynaresized.daemon.commit import GroupCommit
from dynaresized.daemon.config import Config, config_warnings
from dynaresized.daemon.control import Control
from dynaresized.daemon.endpoints import CONNECTIONS_PER_IO_THREAD, Endpoints, Outbox, io_threads_for
from dynaresized.daemon.ingress import WorkerIngress
from dynaresized.daemon.intake import Intake
from dynaresized.daemon.metrics import Metrics
from dynaresized.daemon.notify import Notifier
from dynaresized.daemon.preflight import (
    EVENTS_FILE,
    LOG_ERRORS,
    StartupError,
    check_startup,
    held_by,
    configured_policy,
    inventory_problem,
    log_problem,
    raise_open_files,
)
from dynaresized.daemon.reactor import ControlIn, Items, Reactor, ReloadIn, TickIn
from dynaresized.daemon.reload import PolicyReload
from dynaresized.daemon.security import Refusals, make_state_dir
from dynaresized.daemon.status import idle_status, observe, outcome_status, status_of
from dynaresized.store import DiskFull, FactLog, open_recorder

log = structlog.get_logger("dynaresized")


class Daemon:
    def __init__(self, config: Config, *, policy: Policy | None = None, clock: Callable[[], float] | None = None,
                 notifier: Notifier | None = None, config_path: str | Path | None = None) -> None:
        self.scale = config.daemon.time_scale
        self.clock = clock or scaled_clock(self.scale)
        policy = policy or configured_policy(config)
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        self.refusals = Refusals(self.metrics.security_refusals)
        self.boot_id = uuid.uuid4().hex[:12]
        self.queue: asyncio.Queue[Items] = asyncio.Queue()
        self.cluster = Cluster(Core(config.core_config(), policy))
        self.endpoints = Endpoints(config, self.metrics, self.refusals)
        intake = Intake(config.daemon.junk_budget, config.daemon.junk_window_s, self.metrics.connections_cut)
        self.ingress = WorkerIngress(config, self.endpoints, self.queue, intake,
                                     Refusals(self.metrics.decode_errors))
        self.control = Control(config, self.cluster, self.endpoints, self.queue, status=self.status,
                               notifier=self.notifier, metrics=self.metrics, refusals=self.refusals)
        self.reloads = PolicyReload(config, policy, config_path, self.cluster, self.notifier)
        self.commit = GroupCommit(self.metrics, self.endpoints, self.cluster)
        self.reactor = Reactor(config, self.cluster, self.queue, endpoints=self.endpoints, commit=self.commit,
                               control=self.control, reload=self.reloads, clock=self.clock, metrics=self.metrics,
                               notifier=self.notifier, boot_id=self.boot_id, intake=intake)
        self._ready = asyncio.Event()

    # What the parts hold, by the names the daemon's users know (read-only)
    config = property(attrgetter("reloads.config"), doc="In force: [policy] and [guards] as last reloaded")
    policy = property(attrgetter("reloads.policy"))
    state = property(attrgetter("cluster.state"))
    ctx = property(attrgetter("endpoints.ctx"))
    workers_sock = property(attrgetter("endpoints.workers_sock"))
    control_sock = property(attrgetter("endpoints.control_sock"))
    worker_endpoint = property(attrgetter("endpoints.worker_endpoint"), doc="As bound (tcp port 0: the real one)")
    control_endpoint = property(attrgetter("endpoints.control_endpoint"))

    def status(self) -> dict[str, Any]:
        """The status the CLI shows, as plain data."""
        return status_of(self.state, self)

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
            self.commit.factlog = FactLog(recorder, snapshot_every=self.config.daemon.snapshot_every,
                                          retention=self.config.store.retention())  # compacts after each snapshot
            self.cluster.state = self.commit.factlog.replay()
        except LOG_ERRORS as exc:
            raise StartupError(log_problem(path, exc)) from None
        if problem := inventory_problem(self.config, self.state):
            raise StartupError(problem)

    def _start_log(self) -> None:
        """The start's first fact: the cluster configured, or the daemon started again."""
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
        self.cluster.state, facts, commands = self.cluster.core.step(self.state, event)
        try:
            problem = self.commit.persist(facts, self.state)
        except DiskFull as exc:  # written once there is space: the daemon serves meanwhile
            self.commit.held(facts, self.state)
            self.commit.full(str(exc))
            return commands
        self.commit.durable(self.state, problem)
        observe(self.metrics, facts, self.state)
        return commands

    def _bind(self) -> None:
        self.endpoints.bind()

    # -- run -------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        d = self.config.daemon
        try:
            # Everything that can refuse the start comes before the log's first write: a refused
            # start leaves the log as it was (or absent), so fixing the configuration is enough.
            # A state directory another daemon holds is refused before anything is bound: binding an
            # ipc:// control endpoint re-creates its socket file, and the running daemon's CLI
            # would lose it. (The log's lock, taken when it opens, settles a start that races this.)
            check_startup(self.config, read_log=False, policy=False)
            if held := held_by(self.config):
                raise StartupError(held)
            self._bind()
            if d.metrics_port:
                self.metrics.serve(d.metrics_host, d.metrics_port)
            self._open_log()
            self._start_log()
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
            asyncio.create_task(self.reactor.run(), name="reactor"),
            asyncio.create_task(self.commit.run(), name="log-writer"),
            asyncio.create_task(self.ingress.run(), name="ingress-workers"),
            asyncio.create_task(self.control.serve(), name="ingress-control"),
            asyncio.create_task(self._ticker(), name="ticker"),
            asyncio.create_task(self.endpoints.watch_worker_connections(self.cluster.live_workers),
                                name="watch-worker-connections"),
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
        self.queue.put_nowait([ControlIn(identity=b"", msg=wire.DrainRequest())])

    def request_reload(self) -> None:
        self.queue.put_nowait([ReloadIn()])

    def _send_replies(self, outboxes: list[Outbox]) -> None:
        self.endpoints.send_replies(outboxes)

    def _close(self) -> None:
        self.commit.stop()
        self.endpoints.close()
        self.commit.close_log()

    async def _ticker(self) -> None:
        interval = self.config.daemon.tick_interval_s
        while True:
            await asyncio.sleep(interval)
            self.queue.put_nowait([TickIn()])


def scaled_clock(scale: float) -> Callable[[], float]:
    """Wall-clock seconds, or with `scale` != 1 a clock that runs `scale` times faster from now
    (daemon.time_scale: the demo's daemon then lives in simulated time, and so does its log)."""
    if scale == 1.0:
        return time.time
    origin = time.time()
    return lambda: origin + (time.time() - origin) * scale


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


__all__ = ["CONNECTIONS_PER_IO_THREAD", "EVENTS_FILE", "Daemon", "StartupError", "io_threads_for", "idle_status",
           "outcome_status", "run_daemon", "scaled_clock", "status_of", "Phase"]
