"""Chaos runs: the real daemon, real worker processes, a network that loses, repeats, delays,
reorders and fails messages, and SIGKILLs of the daemon and of workers at random points of
resizes. After each run it checks the invariants and prints one JSON object.

    python benchmarks/chaos.py --runs 1000            # the acceptance run (--jobs runs at once)
    python benchmarks/chaos.py --runs 1 --seed 17     # replay one run: a violation names its seed

Each run is a process of its own (this script with `--one SEED DIR`): its proxy, its checks and
its event loop share nothing with the runs beside it.

Each run: a daemon (`dynaresized serve`, its own log in a temporary directory) and one worker
process per device (4 devices, 2:2; each process hosts the device's rollout engine and trainer
rank through the real `WorkerClient`, says what it holds, and records it in a file). Workers
reach the daemon through a fault-injecting proxy in this process: per message it drops,
duplicates, delays (which reorders) or, for op results, turns success into failure. The run
forces resizes and regroups (two devices' engines into one engine of both, or back) at random
moments while it SIGKILLs and restarts the daemon and SIGKILLs workers (restarted as fresh
processes holding nothing). In half the runs (`faults.loans`) the workers
also run a job that reports mini-batches, idle engines and steps, and the daemon's hysteresis
policy lends idle engines to the training step and idle trainers to the rollout, so faults hit
loans and their returns as well as resizes. Then the faults stop and the run waits for the
cluster to settle (an operator's `resume` if it is degraded) and checks:

* DESIGN.md §4: every device in exactly one pool or moving, moving only during a resize, at most
  one operation sequence in flight (checked after every fact of the log); nothing left in flight;
* every worker's real state (its own record, not the daemon's belief) equals the log's desired
  state, and every serving engine runs the engine the log says (its own device's, or the wide
  engine it leads); no worker left unconverged;
* replay of the log equals the live state; `python -m dynaresized.store check` passes.

A degraded outcome is counted by cause; one in a run whose only faults were lost, repeated,
delayed or reordered messages is a violation. Recovery time runs from the moment the faults
stop (every process up again) to the moment the cluster has settled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import functools
import heapq
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

DEVICES = ("node0:cpu0", "node0:cpu1", "node0:cpu2", "node0:cpu3")
SPLITS = ((1, 3), (2, 2), (3, 1))
PAIRS = (DEVICES[:2], DEVICES[2:], DEVICES[1:3])  # what a regroup asks for: a TP-2 engine of a pair, or back
REGROUP_SHARE = 0.5  # of the operator's requests in a run: regroups; the rest are resizes
CHAOS_S = 3.0  # how long faults are injected in a run
SETTLE_LIMIT_S = 30.0
START_LIMIT_S = 60.0  # startup is not what is measured: under load, Python processes start slowly
HERE = Path(__file__).resolve()

# -- the worker process -------------------------------------------------------------------------


def worker_main(endpoint: str, device: str, pool: str, record: Path, loans: bool = False,
                curve_dir: Path | None = None, hello_timeout_s: float = 1.0) -> int:
    """One device's process: its engine and its trainer, holding what `pool` says at launch
    ("none": a restarted process, holding nothing). With `loans`, also the job's reports that
    make the daemon lend (`job_reports`). With `curve_dir`, over CURVE: each worker's key pair
    `<worker_id>.key_secret` and the daemon's `server.key` are there."""
    from dynaresized.backends.sim import after_op
    from dynaresized.client import CurveKeys, OpRequest, WorkerClient
    from dynaresized.domain import ActualState, Holding, OpKind, WorkerKind

    holding = {kind: Holding.SERVING if kind.pool.value == pool else Holding.RELEASED for kind in WorkerKind}
    runs: list[tuple[str, ...]] = [()]  # the wider engine this device's engine runs (regroups); (): its own

    def save() -> None:
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({**{kind.value: h.value for kind, h in holding.items()}, "engine": list(runs[0])}))
        os.replace(tmp, record)

    async def main() -> None:
        rng = random.Random()
        clients = []
        for kind in WorkerKind:
            name = worker_name(kind, device)

            async def handle(op: OpRequest, kind: WorkerKind = kind) -> str:
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                before = (holding[kind], runs[0])
                holding[kind], engine = after_op(op, device, kind, holding[kind], runs[0])
                if kind is WorkerKind.ROLLOUT_ENGINE:
                    runs[0] = engine
                if (holding[kind], runs[0]) != before:
                    save()
                return f"{op.kind.value} on {device}"

            curve = None if curve_dir is None else CurveKeys(curve_dir / f"{name}.key_secret",
                                                             curve_dir / "server.key")
            client = WorkerClient(endpoint, name, kind, (device,), hello_timeout_s=hello_timeout_s, curve=curve,
                                  actual=lambda kind=kind: ActualState(
                                      holding=holding[kind],
                                      engine=runs[0] if kind is WorkerKind.ROLLOUT_ENGINE else ()))
            client.on_all({k: handle for k in OpKind})
            clients.append(client)
        save()
        for client in clients:
            while True:  # the hello itself may be lost on the way
                try:
                    await client.start()
                    break
                except TimeoutError:
                    await asyncio.sleep(0.1)
        if loans:
            engine, trainer = (c for k in (WorkerKind.ROLLOUT_ENGINE, WorkerKind.TRAINER_RANK)
                               for c in clients if c.kind is k)
            await job_reports(device, engine, trainer, lambda: holding[WorkerKind.ROLLOUT_ENGINE] is Holding.SERVING,
                              record.parent)
        await asyncio.Event().wait()

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and errors
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the run asks when settling fails
    asyncio.run(main())
    return 0


STEP_S = 0.8  # the job's RL step, in the runs with loans
MINI_BATCHES = 8


async def job_reports(device: str, engine: Any, trainer: Any, serving: Any, run_dir: Path) -> None:
    """What a job tells the daemon, so that it lends (the runs with loans): the first device's
    trainer reports the training step's mini-batches and, at every step's end, the step; every
    engine that serves says its queue is empty once a quarter of the step has gone. Steps are
    numbered by the wall clock, so a restarted process (or daemon) continues the count. When the
    run's faults stop (`quiet` exists) the job stops lending: it reports a step every step time
    until the daemon's status shows no device lent and nothing in flight (a step report brings
    loans home; one sent while the daemon was down is lost, and a return that rolled back leaves
    the devices lent: a running job's next step makes up for either)."""
    from dynaresized import wire
    from dynaresized.control import control_request
    from dynaresized.domain import StepTiming

    reporter = device == DEVICES[0]
    quiet, control = run_dir / "quiet", f"ipc://{run_dir}/control.sock"
    last_step, last_done, dry_step, quiet_step, checked = -1, -1, -1, -1, False
    while True:
        now = time.time()
        step, into = int(now / STEP_S), (now % STEP_S) / STEP_S
        done = min(int(into * MINI_BATCHES) + 1, MINI_BATCHES)
        try:
            if quiet.exists():
                if not reporter:
                    return
                if step != quiet_step:
                    quiet_step, checked = step, False
                    await trainer.report_step(StepTiming(step=step, rollout_s=STEP_S / 4, train_s=STEP_S))
                if not checked and into >= 0.5:  # once a step, halfway: the settle check polls too
                    checked = True
                    with contextlib.suppress(TimeoutError, RuntimeError):  # the daemon is down: try again
                        st = (await asyncio.to_thread(control_request, control, wire.StatusRequest(), 1.0)).data
                        if not st["lent"] and st["in_flight"] is None:
                            return
                await asyncio.sleep(STEP_S / 8)
                continue
            if reporter and step != last_step and last_step >= 0:
                await trainer.report_step(StepTiming(step=last_step, rollout_s=STEP_S / 4, train_s=STEP_S))
            if reporter and (step, done) != (last_step, last_done):
                await trainer.report_mini_batch(step, done, MINI_BATCHES)
            if serving() and into >= 0.25 and dry_step != step:
                await engine.report_queue_empty(step + 1, running=0)
                dry_step = step
        except Exception:  # not registered just now (a restart, a loss): the next step tries again
            pass
        last_step, last_done = step, done
        await asyncio.sleep(STEP_S / MINI_BATCHES / 2)


def worker_name(kind: Any, device: str) -> str:
    prefix = "eng-" if kind.value == "rollout-engine" else "tr-"
    return prefix + device.replace(":", "-")


# -- the network --------------------------------------------------------------------------------


class Faults(msgspec.Struct):
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    fail: float = 0.0
    daemon_kills: int = 0
    worker_kills: int = 0
    loans: bool = False  # the job reports and the policy lends (hysteresis, lending on)
    partition: str = ""  # the network fault of a run across hosts (`HostRun`), one of PARTITIONS

    @property
    def messages_only(self) -> bool:
        return self.fail == 0 and self.daemon_kills == 0 and self.worker_kills == 0 and not self.partition


class Proxy:
    """Workers connect here; each routing id gets its own DEALER to the daemon with the same id,
    so the daemon sees the worker's own identity. Faults apply per message, both ways.

    The proxy is one thread with its own ZeroMQ context and plain sockets, which only that
    thread touches (a dealer is closed there too, when its worker dies): runs side by side share
    no socket, no file descriptor and no event loop."""

    def __init__(self, daemon_endpoint: str, faults: Faults, seed: int) -> None:
        self.daemon_endpoint = daemon_endpoint
        self.faults = faults
        self.rng = random.Random(seed)  # its own: the run's generator belongs to the run's thread
        self.on = False
        self.counts = {"dropped": 0, "duplicated": 0, "delayed": 0, "failed": 0}
        self.error = ""
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.bind(daemon_endpoint.replace("workers.sock", "proxy.sock"))
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dealers: dict[bytes, zmq.Socket] = {}
        self._cuts: queue.SimpleQueue[tuple[str, ...]] = queue.SimpleQueue()
        self._later: list[tuple[float, int, bool, bytes, bytes]] = []  # (due, n, upstream, identity, payload)
        self._n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"proxy-{seed}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def cut(self, prefixes: tuple[str, ...]) -> None:
        """A worker process died: its connections to the daemon close too (as the kernel's would)."""
        self._cuts.put(prefixes)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                while not self._cuts.empty():
                    prefixes = self._cuts.get()
                    for identity in [i for i in self.dealers if i.split(b"#")[0].decode(errors="replace") in prefixes]:
                        dealer = self.dealers.pop(identity)
                        poller.unregister(dealer)
                        dealer.close(0)
                wait_ms = 20.0
                if self._later:
                    wait_ms = max(0.0, min(wait_ms, (self._later[0][0] - time.monotonic()) * 1000))
                for sock, _ in poller.poll(wait_ms):
                    self._drain(poller, sock)
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, _, upstream, identity, payload = heapq.heappop(self._later)
                    self._send(upstream, identity, payload)
        except Exception:  # the run reports it as a harness violation
            self.error = traceback.format_exc()
        finally:
            for dealer in self.dealers.values():
                dealer.close(0)
            self.router.close(0)

    def _drain(self, poller: zmq.Poller, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.router:
                identity, payload = frames[0], frames[-1]
                if identity not in self.dealers:
                    dealer = self.ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.IDENTITY, identity)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(self.daemon_endpoint)
                    self.dealers[identity] = dealer
                    poller.register(dealer, zmq.POLLIN)
                self._deliver(True, identity, self._maybe_fail(payload))
            else:
                identity = sock.getsockopt(zmq.IDENTITY)
                self._deliver(False, identity, frames[-1])

    def _maybe_fail(self, payload: bytes) -> bytes:
        if not self.on or not self.faults.fail or self.rng.random() >= self.faults.fail:
            return payload
        try:
            msg = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            return payload
        if isinstance(msg, dict) and msg.get("type") == "op_result" and msg.get("ok"):
            self.counts["failed"] += 1
            return msgspec.msgpack.encode({**msg, "ok": False, "detail": "injected failure"})
        return payload

    def _deliver(self, upstream: bool, identity: bytes, payload: bytes) -> None:
        f, rng = self.faults, self.rng
        copies = 1
        if self.on:
            if rng.random() < f.drop:
                self.counts["dropped"] += 1
                return
            if rng.random() < f.duplicate:
                self.counts["duplicated"] += 1
                copies = 2
            if rng.random() < f.delay:  # later messages overtake it: a reorder
                self.counts["delayed"] += 1
                due = time.monotonic() + rng.uniform(0.02, 0.4)
                for _ in range(copies):
                    self._n += 1
                    heapq.heappush(self._later, (due, self._n, upstream, identity, payload))
                return
        for _ in range(copies):
            self._send(upstream, identity, payload)

    def _send(self, upstream: bool, identity: bytes, payload: bytes) -> None:
        """To the daemon on the worker's dealer, or to the worker through the router. A message
        for a connection that has closed since is lost, as it would be."""
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            if upstream:
                dealer = self.dealers.get(identity)
                if dealer is not None:
                    dealer.send(payload, zmq.NOBLOCK)
            else:
                self.router.send_multipart([identity, payload], zmq.NOBLOCK)

    async def close(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join)
        self.ctx.term()


# -- one run --------------------------------------------------------------------------------------


def config_text(state_dir: Path, worker_ep: str, control_ep: str, loans: bool = False) -> str:
    # With loans: the hysteresis policy, lending both ways (the sim workers take every loan),
    # loans that cost next to nothing, so that it lends whenever an engine is idle.
    policy = ('name = "hysteresis"\noptions = { lending = true, lend_trainers = true }\n'
              '[loan_costs]\nto_training_s = 0.01\nreturn_s = 0.01\nlead_s = 0.0\nto_rollout_s = 0.01'
              if loans else 'name = "static"')
    return f"""
[daemon]
state_dir = "{state_dir}"
worker_endpoint = "{worker_ep}"
control_endpoint = "{control_ep}"
metrics_port = 0
tick_interval_s = 0.05
heartbeat_interval_s = 0.2
drain_timeout_s = 2.0
log_format = "json"
log_level = "info"

[cluster]
devices = {json.dumps(list(DEVICES))}
training = {json.dumps(list(DEVICES[:2]))}

[policy]
{policy}

[core]
heartbeat_timeout_s = 1.5
op_timeout_s = 4.0
op_resend_s = 0.3
audit_interval_s = 1.0
reconcile_retry_s = 1.0

[guards]
cooldown_steps = 0
min_dwell_s = 0.0
"""


class Run:
    def __init__(self, seed: int, root: Path, *, kills: bool = True) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.dir = root / f"run-{seed}"
        self.dir.mkdir(parents=True)
        # ipc sockets in the run's own directory: runs side by side never race for a TCP port
        self.worker_ep = f"ipc://{self.dir}/workers.sock"
        self.control_ep = f"ipc://{self.dir}/control.sock"
        self.config = self.dir / "config.toml"
        self.config_written = False
        self.daemon: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.violations: list[dict[str, Any]] = []
        self.degraded: list[str] = []
        rng = self.rng
        self.faults = Faults(
            drop=rng.choice((0.0, 0.03, 0.08)), duplicate=rng.choice((0.0, 0.05)), delay=rng.choice((0.0, 0.1)),
            fail=rng.choice((0.0, 0.0, 0.05)), daemon_kills=rng.choice((0, 0, 1, 2)),
            worker_kills=rng.choice((0, 0, 1, 2)))
        if not kills:
            self.faults = msgspec.structs.replace(self.faults, daemon_kills=0, worker_kills=0)
        # drawn apart, so that a seed's other faults and its kill times are what they were
        self.faults = msgspec.structs.replace(self.faults, loans=random.Random(seed * 31 + 7).random() < 0.5)

    def violate(self, invariant: str, detail: str) -> None:
        self.violations.append({"seed": self.seed, "invariant": invariant, "detail": detail[-700:]})

    # -- processes
    def start_daemon(self) -> None:
        if not self.config_written:
            self.config.write_text(config_text(self.dir / "state", self.worker_ep, self.control_ep, self.faults.loans))
            self.config_written = True
        log = (self.dir / "daemon.log").open("ab")
        self.daemon = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config",
                                        str(self.config)], stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self, device: str, pool: str) -> None:
        record = self.dir / f"{device.replace(':', '-')}.json"
        log = (self.dir / f"{device.replace(':', '-')}.log").open("ab")
        self.workers[device] = subprocess.Popen(
            [sys.executable, str(HERE), "--worker", self.proxy.endpoint, device, pool, str(record)]
            + (["--loans"] if self.faults.loans else []),
            stdout=log, stderr=subprocess.STDOUT)

    def kill_worker(self, device: str) -> None:
        proc = self.workers[device]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.proxy.cut(tuple(worker_name(k, device) for k in _kinds()))

    async def status(self, timeout_s: float = 1.0) -> dict[str, Any] | None:
        from dynaresized import wire
        from dynaresized.control import control_request

        try:
            reply = await asyncio.to_thread(control_request, self.control_ep, wire.StatusRequest(), timeout_s)
        except (TimeoutError, RuntimeError):
            return None
        return reply.data

    async def control(self, request: Any) -> None:
        """An operator's request, with the control secret the daemon keeps in its state dir."""
        from dynaresized.control import control_request, read_control_secret

        secret = read_control_secret(self.dir / "state")
        with contextlib.suppress(TimeoutError, RuntimeError):
            await asyncio.to_thread(functools.partial(control_request, self.control_ep, request, 1.0, secret=secret))

    async def wait_status(self, predicate: Any, limit_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            st = await self.status()
            if st is not None and predicate(st):
                return st
            await asyncio.sleep(0.1)
        return None

    # -- the run
    async def run(self) -> dict[str, Any]:
        self.proxy = Proxy(self.worker_ep, self.faults, self.seed * 7919 + 1)
        recovery = None
        try:
            recovery = await self.start_and_check()
        finally:
            for proc in [*self.workers.values(), self.daemon]:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
            await self.proxy.close()
            if self.proxy.error:  # the network died with it: what else failed follows from this
                self.violate("harness", f"the proxy failed: {self.proxy.error}")
        return self.result(recovery)

    async def start_and_check(self) -> float | None:
        """Start the daemon and a worker process per device, run the faults, let the cluster settle and
        check every invariant: the recovery time, or None where it never started or never settled."""
        self.start_daemon()
        for i, d in enumerate(DEVICES):
            self.start_worker(d, "training" if i < 2 else "rollout")
        ready = await self.wait_status(lambda st: sum(w["status"] == "live" for w in st["workers"]) == 8,
                                       START_LIMIT_S)
        if ready is None:
            self.violate("start", f"the workers did not all register within {START_LIMIT_S:g} s")
            return None
        await self.chaos()
        settled_from = time.monotonic()
        st = await self.settle()
        recovery = time.monotonic() - settled_from if st is not None else None
        if st is not None:
            self.check_workers(st)
        await self.stop_and_check(st)
        return recovery

    async def chaos(self) -> None:
        from dynaresized import wire

        rng, f = self.rng, self.faults
        end = time.monotonic() + CHAOS_S
        kills = ["daemon"] * f.daemon_kills + ["worker"] * f.worker_kills
        at = sorted(rng.uniform(0.2, CHAOS_S - 0.3) for _ in kills)
        plan = sorted(zip(at, rng.sample(kills, len(kills)), strict=True))
        self.proxy.on = True
        dead: dict[str, float] = {}  # device -> when to restart it
        daemon_back: float | None = None
        next_resize = time.monotonic() + rng.uniform(0.0, 0.3)
        start = time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            if plan and now - start >= plan[0][0]:
                _, what = plan.pop(0)
                if what == "daemon" and daemon_back is None:
                    assert self.daemon is not None
                    self.daemon.send_signal(signal.SIGKILL)
                    self.daemon.wait()
                    daemon_back = now + rng.uniform(0.0, 0.5)
                elif what == "worker":
                    device = rng.choice([d for d in DEVICES if d not in dead])
                    self.kill_worker(device)
                    dead[device] = now + rng.uniform(0.1, 0.8)
            if daemon_back is not None and now >= daemon_back:
                self.start_daemon()
                daemon_back = None
            for device, when in list(dead.items()):
                if now >= when:
                    self.start_worker(device, "none")  # a fresh process holds nothing
                    del dead[device]
            if now >= next_resize:
                if rng.random() < REGROUP_SHARE:  # two devices' engines become one, or back
                    devices, tp = await self.regroup_target()
                    await self.control(wire.RegroupRequest(devices=devices, tp=tp, reason="chaos"))
                else:
                    train, rollout = rng.choice(SPLITS)
                    await self.control(wire.ResizeRequest(train=train, rollout=rollout, reason="chaos"))
                next_resize = now + rng.uniform(0.2, 0.8)
            await asyncio.sleep(0.02)
        self.proxy.on = False
        (self.dir / "quiet").touch()  # the job's last report: loans go home
        if daemon_back is not None:
            self.start_daemon()
        for device in dead:
            self.start_worker(device, "none")

    async def regroup_target(self) -> tuple[tuple[str, ...], int]:
        """What an operator would regroup now: a wide engine back to one-device engines, or two
        rollout devices into one engine (as the status says; a pair at random without one)."""
        rng = self.rng
        st = await self.status(0.5)
        if st is None:
            return rng.choice(PAIRS), rng.choice((1, 2))
        if st.get("engines") and rng.random() < 0.5:
            return tuple(rng.choice(st["engines"])), 1
        rollout = [d for d, p in sorted(st["devices"].items()) if p == "rollout"]
        pairs = [p for p in PAIRS if all(d in rollout for d in p)] or list(PAIRS)
        return rng.choice(pairs), 2

    def truth(self) -> dict[str, dict[str, str]]:
        out = {}
        for d in DEVICES:
            path = self.dir / f"{d.replace(':', '-')}.json"
            with contextlib.suppress(OSError, ValueError):
                out[d] = json.loads(path.read_text())
        return out

    def disagreement(self, st: dict[str, Any]) -> str:
        """Why the cluster has not settled yet ("" once it has)."""
        if st["phase"] != "steady" or st["in_flight"] is not None:
            return f"phase {st['phase']}, in flight {st['in_flight']}"
        moving = [d for d, p in st["devices"].items() if "moving" in p]
        if moving:
            return f"moving: {moving}"
        if st["lent"]:  # the job reports steps until its loans are home (see job_reports)
            return f"lent: {st['lent']}"
        workers = st["workers"]
        if len(workers) != 8:
            return f"{len(workers)} workers registered"
        for w in workers:
            if w["status"] != "live" or w["unconverged"]:
                return f"{w['id']} is {w['status']}" + (f", unconverged: {w['unconverged']}" if w["unconverged"] else "")
            if w["actual"] != w["desired"]:
                return f"{w['id']} reports {w['actual']}, the log says {w['desired']}"
        truth = self.truth()
        for w in workers:
            (device,) = w["devices"]
            real = truth.get(device, {}).get(w["kind"])
            if real != w["desired"]:
                return f"{w['id']} really holds {real}, the log says {w['desired']}"
        return self.wrong_engine(st, truth)

    def wrong_engine(self, st: dict[str, Any], truth: dict[str, dict[str, Any]]) -> str:
        """An engine that serves, but as another engine than the log's ("" if none)."""
        groups = {d: g for g in st.get("engines", []) for d in g}
        for w in st["workers"]:
            (device,) = w["devices"]
            if w["kind"] == "rollout-engine" and w["desired"] == "serving":
                want = groups.get(device, [])
                have = truth.get(device, {}).get("engine", [])
                if have != want:
                    return f"{w['id']} runs the engine {have or 'of its own device'}, the log says {want}"
        return ""

    async def settle(self) -> dict[str, Any] | None:
        from dynaresized import wire

        deadline = time.monotonic() + SETTLE_LIMIT_S
        why = "the daemon never answered"
        while time.monotonic() < deadline:
            st = await self.status()
            if st is not None:
                if st["phase"] == "degraded":
                    self.degraded.append(st["degraded_reason"])
                    await self.control(wire.ResumeRequest())  # what an operator does
                    continue
                why = self.disagreement(st)
                if not why:
                    return st
            await asyncio.sleep(0.1)
        proxy = "alive" if self.proxy.alive else f"dead: {self.proxy.error[-300:]}"
        self.violate("settle", f"not settled within {SETTLE_LIMIT_S:g}s: {why} (proxy {proxy})")
        # Where everything waits: this process's threads (the proxy's among them) in stacks.txt,
        # each worker process's in its own log.
        with (self.dir / "stacks.txt").open("w") as out:
            faulthandler.dump_traceback(file=out, all_threads=True)
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        await asyncio.sleep(0.5)
        return None

    def check_workers(self, st: dict[str, Any]) -> None:
        truth = self.truth()
        for w in st["workers"]:
            (device,) = w["devices"]
            real = truth.get(device, {}).get(w["kind"])
            if real != w["desired"]:
                self.violate("worker_vs_log", f"{w['id']} holds {real}, the log says {w['desired']}")
        if wrong := self.wrong_engine(st, truth):
            self.violate("engine_vs_log", wrong)

    async def stop_and_check(self, live: dict[str, Any] | None) -> None:
        from dynaresized.core import facts as fx
        from dynaresized.core.state import ClusterState, mutate
        from dynaresized.daemon.service import status_of
        from dynaresized.store import open_recorder

        assert self.daemon is not None
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.daemon.wait, 20)
            except subprocess.TimeoutExpired:
                self.violate("drain", "the daemon did not exit within 20 s of SIGTERM")
                self.daemon.kill()
        path = self.dir / "state" / "events.sqlite"
        check = subprocess.run([sys.executable, "-m", "dynaresized.store", "check", str(path)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            self.violate("store_check", check.stderr or check.stdout)
            return
        recorder = open_recorder(path, read_only=True)
        try:
            facts = [fx.decode_fact(e.data) for e in recorder.read_all()]
        finally:
            recorder.close()
        state = ClusterState()
        at_settle: ClusterState | None = None  # the log folded as far as the settled status had seen
        for i, fact in enumerate(facts):
            if live is not None and state.version == live["facts"]:
                at_settle = state
            starting = isinstance(fact, fx.ResizeStarted | fx.ReconcileStarted | fx.RegroupStarted)
            if starting and state.inflight is not None:
                self.violate("one_in_flight", f"fact {i + 1} starts a sequence while {state.inflight.plan.resize_id} "
                                              "is in flight")
            state = mutate(state, fact)
            if state.configured and len(state.devices) != len(DEVICES):
                self.violate("devices", f"after fact {i + 1}: {len(state.devices)} devices")
            moving = {d for d, p in state.devices.items() if p.is_moving}
            planned = set(state.inflight.plan.devices) if state.inflight and not state.inflight.reconciling else set()
            if moving - planned:
                self.violate("moving", f"after fact {i + 1}: {sorted(moving - planned)} moving outside a resize")
        self.facts = facts
        if state.inflight is not None:
            self.violate("in_flight", f"{state.inflight.plan.resize_id} still in flight at the end")
        if live is not None and state.version == live["facts"]:
            at_settle = state
        if live is not None and at_settle is None:
            self.violate("replay", f"the live daemon had folded {live['facts']} facts, the log holds {len(facts)}")
        elif live is not None and at_settle is not None:
            # The status taken at settle against the log folded to the same fact: later facts
            # (a heartbeat lost while stopping, the stop itself) are not the replay's business.
            replayed = status_of(at_settle)
            for key in ("devices", "split", "resizes", "phase", "engines", "regroups"):
                if replayed[key] != live[key]:
                    self.violate("replay", f"{key}: replayed {replayed[key]} != live {live[key]}")
            strip = lambda ws: sorted((w["id"], w["status"], w["incarnation"], w["actual"]) for w in ws)  # noqa: E731
            if strip(replayed["workers"]) != strip(live["workers"]):
                self.violate("replay", "workers differ between replay and the live daemon")

    def result(self, recovery: float | None) -> dict[str, Any]:
        from dynaresized.core import facts as fx

        facts = getattr(self, "facts", [])
        count = lambda t: sum(isinstance(x, t) for x in facts)  # noqa: E731
        if self.degraded and self.faults.messages_only:
            for reason in self.degraded:
                self.violate("degraded_by_messages", reason)
        return {
            "seed": self.seed, "faults": msgspec.to_builtins(self.faults), "violations": self.violations,
            "degraded": self.degraded, "recovery_s": recovery, "injected": self.proxy.counts,
            "committed": count(fx.ResizeCommitted), "rolled_back": count(fx.ResizeRolledBack),
            "reconciles": count(fx.ReconcileStarted),
            "converged": sum(isinstance(x, fx.ReconcileFinished) and x.ok for x in facts),
            "daemon_restarts": count(fx.DaemonRestarted), "workers_lost": count(fx.WorkerLost),
            "loans_started": count(fx.LoanStarted), "loans_returned": count(fx.LoanReturned),
            "regroups_started": count(fx.RegroupStarted), "regroups_committed": count(fx.RegroupCommitted),
        }


# -- partitions between hosts ----------------------------------------------------------------------

# The network faults of a run across hosts (`--partitions`): one per run, `PARTITIONS[seed % 8]`,
# so that any 8 consecutive seeds cover all of them; the host, the moment and the loss are drawn.
PARTITIONS = ("partition_short", "partition_long", "one_way_to_daemon", "one_way_from_daemon", "delay", "loss",
              "heal_mid_resize", "heal_mid_loan")
FULL_PARTITIONS = ("partition_short", "partition_long", "heal_mid_resize", "heal_mid_loan")
WORKER_HOSTS = (1, 2)  # host 0 runs the daemon; each worker host runs two devices' processes
HOST_OF = {d: WORKER_HOSTS[i // 2] for i, d in enumerate(DEVICES)}
DAEMON_PORT, RELAY_PORT = 5555, 5600
HEARTBEAT_TIMEOUT_S = 3.0
OP_TIMEOUT_S = 1.5
DELAY_S = 1.0  # each way: an op's round trip (2 s) is longer than the op timeout, a heartbeat's is not lost
HOSTS_CHAOS_S = 8.0
# An op that reached a worker before its link went down (in its socket, or running: the sim
# handlers take up to 50 ms) still runs; what the worker holds after that must not change.
CUT_GRACE_S = 0.5
# The client's default. A start() that timed out opens a new connection with the same identity,
# which the daemon parks while it still holds the previous one (no ROUTER_HANDOVER); under heavy
# load, with the relay between, a 1 s timeout made a worker's retries chase their own predecessors.
HELLO_TIMEOUT_S = 5.0


class Partition(msgspec.Struct):
    kind: str
    host: int  # the worker host it hits
    start_s: float  # into the chaos window (the mid-resize and mid-loan kinds wait for one instead)
    duration_s: float
    loss: float = 0.0


def draw_partition(seed: int, rng: random.Random) -> Partition:
    kind = PARTITIONS[seed % len(PARTITIONS)]
    host = rng.choice(WORKER_HOSTS)
    start = rng.uniform(0.5, 2.0)
    duration = {
        "partition_short": HEARTBEAT_TIMEOUT_S / 3,  # under the heartbeat timeout: nobody is lost
        "partition_long": HEARTBEAT_TIMEOUT_S * 1.5,  # over it: the host's workers are lost, then return
        "one_way_to_daemon": HEARTBEAT_TIMEOUT_S * 1.3,
        "one_way_from_daemon": HEARTBEAT_TIMEOUT_S * 1.3,
        "delay": 3.0,
        "loss": HOSTS_CHAOS_S - start,
        "heal_mid_resize": rng.choice((HEARTBEAT_TIMEOUT_S / 3, HEARTBEAT_TIMEOUT_S * 1.5)),
        "heal_mid_loan": rng.choice((HEARTBEAT_TIMEOUT_S / 3, HEARTBEAT_TIMEOUT_S * 1.5)),
    }[kind]
    return Partition(kind=kind, host=host, start_s=start, duration_s=duration,
                     loss=rng.choice((0.05, 0.15, 0.3)) if kind == "loss" else 0.0)


def host_config_text(state_dir: Path, keys: Path, control_ep: str, loans: bool) -> str:
    """What an operator writes for a daemon on 10.77.0.1 serving workers on other hosts: a
    non-loopback bind, CURVE (the daemon's key, the directory of allowed worker keys), a local
    control endpoint. Times are shorter than production's so a run takes seconds."""
    text = config_text(state_dir, f"tcp://10.77.0.1:{DAEMON_PORT}", control_ep, loans)
    text = (text.replace("heartbeat_timeout_s = 1.5", f"heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}")
            .replace("op_timeout_s = 4.0", f"op_timeout_s = {OP_TIMEOUT_S}"))
    return text + f"""
[security]
server_secret_key = "{keys / 'server.key_secret'}"
authorized_keys_dir = "{keys / 'authorized'}"
"""


class HostRun(Run):
    """A chaos run across hosts: the daemon on host 0 (a network namespace), two worker hosts of
    two devices each, CURVE over TCP, one network fault (`Partition`) while resizes are forced
    (and, with loans, while the job lends), then the same settling and checks as `Run`.

    Each worker host reaches the daemon through its own `hosts.Relay` on host 0 (delay 0 but
    during a `delay` fault): links, routes and the loss rule act on the path between the hosts."""

    def __init__(self, seed: int, root: Path) -> None:
        super().__init__(seed, root, kills=False)
        rng = random.Random(seed * 104729 + 3)
        self.partition = draw_partition(seed, rng)
        loans = self.partition.kind == "heal_mid_loan" or rng.random() < 0.5
        self.faults = Faults(loans=loans, partition=self.partition.kind)
        self.proxy = _NoProxy()
        self.applied_at: float | None = None
        self.healed = False
        self.cut_off_record: dict[str, dict[str, str]] = {}
        self.cut_off_recorded = False
        self.unavailable = ""  # why the fault could not be applied on this machine

    def start_daemon(self) -> None:
        if not self.config_written:
            self.config.write_text(host_config_text(self.dir / "state", self.dir / "keys", self.control_ep,
                                                    self.faults.loans))
            self.config_written = True
        log = (self.dir / "daemon.log").open("ab")
        self.daemon = self.net.popen(0, [sys.executable, "-m", "dynaresized.cli", "serve", "--config",
                                         str(self.config)], stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self, device: str, pool: str) -> None:
        record = self.dir / f"{device.replace(':', '-')}.json"
        log = (self.dir / f"{device.replace(':', '-')}.log").open("ab")
        host = HOST_OF[device]
        endpoint = f"tcp://10.77.0.1:{RELAY_PORT + host}"
        self.workers[device] = self.net.popen(
            host, [sys.executable, str(HERE), "--worker", endpoint, device, pool, str(record),
                   "--curve", str(self.dir / "keys"), "--hello-timeout", str(HELLO_TIMEOUT_S)]
            + (["--loans"] if self.faults.loans else []),
            stdout=log, stderr=subprocess.STDOUT)

    def make_keys(self) -> None:
        from dynaresized.daemon.security import keygen

        keys = self.dir / "keys"
        keygen(keys, "server")
        for device in DEVICES:
            for kind in _kinds():
                public, _ = keygen(keys, worker_name(kind, device))
                (keys / "authorized").mkdir(exist_ok=True)
                (keys / "authorized" / public.name).write_bytes(public.read_bytes())

    async def run(self) -> dict[str, Any]:
        sys.path.insert(0, str(HERE.parent))
        from hosts import Hosts

        self.make_keys()
        recovery = None
        with Hosts(3, tag=str(self.seed)) as self.net:
            for host in WORKER_HOSTS:
                (self.dir / f"delay-{host}").write_text("0")
                self.net.popen(0, [sys.executable, str(HERE.parent / "hosts.py"), "relay", "10.77.0.1",
                                   str(RELAY_PORT + host), "10.77.0.1", str(DAEMON_PORT),
                                   str(self.dir / f"delay-{host}")])
            recovery = await self.start_and_check()
        return self.result(recovery)

    def apply(self) -> None:
        p, net = self.partition, self.net
        if p.kind in FULL_PARTITIONS:
            net.cut(p.host)
        elif p.kind == "one_way_to_daemon":
            net.block(p.host, 0)
        elif p.kind == "one_way_from_daemon":
            net.block(0, p.host)
        elif p.kind == "delay":
            (self.dir / f"delay-{p.host}").write_text(str(DELAY_S))
        elif p.kind == "loss":
            from hosts import nft_available

            if not nft_available():  # the run goes on without it, and says so
                self.unavailable = "packet loss needs nftables (`nft`), which is not installed"
                return
            net.loss(p.host, p.loss)

    def record_cut_off(self) -> None:
        """What the cut-off workers hold once the ops that reached them before the cut have run
        (`CUT_GRACE_S`): nothing may change it until the link heals."""
        self.cut_off_record = {d: rec for d, rec in self.truth().items() if HOST_OF[d] == self.partition.host}
        self.cut_off_recorded = True

    def heal(self) -> None:
        p = self.partition
        if p.kind in FULL_PARTITIONS and self.cut_off_recorded:
            now = {d: rec for d, rec in self.truth().items() if HOST_OF[d] == p.host}
            if now != self.cut_off_record:
                self.violate("cut_off", f"host {p.host}'s workers changed what they hold while cut off from the "
                                        f"daemon: {self.cut_off_record} -> {now}")
        (self.dir / f"delay-{p.host}").write_text("0")
        self.net.heal(p.host)
        self.healed = True

    async def ready_to_apply(self, elapsed: float) -> bool:
        kind = self.partition.kind
        if kind not in ("heal_mid_resize", "heal_mid_loan"):
            return elapsed >= self.partition.start_s
        st = await self.status(0.5)
        fl = None if st is None else st["in_flight"]
        if fl is None:
            return False
        rid = fl["resize_id"]
        return rid.startswith("r") if kind == "heal_mid_resize" else (rid.startswith("l") and "home" not in rid)

    async def chaos(self) -> None:
        from dynaresized import wire

        rng = self.rng
        start = time.monotonic()
        next_resize = start + rng.uniform(0.0, 0.3)
        while True:
            now = time.monotonic()
            elapsed = now - start
            if self.applied_at is None and elapsed < HOSTS_CHAOS_S and await self.ready_to_apply(elapsed):
                self.apply()
                self.applied_at = time.monotonic()
            if (self.applied_at is not None and not self.cut_off_recorded and self.partition.kind in FULL_PARTITIONS
                    and now - self.applied_at >= CUT_GRACE_S):
                self.record_cut_off()
            if self.applied_at is not None and not self.healed and now - self.applied_at >= self.partition.duration_s:
                self.heal()
            if elapsed >= HOSTS_CHAOS_S and (self.applied_at is None or self.healed):
                break
            # mid-loan runs lend while nothing is forced: a forced resize would take the loan's place
            if now >= next_resize and elapsed < HOSTS_CHAOS_S and self.partition.kind != "heal_mid_loan":
                train, rollout = rng.choice(SPLITS)
                await self.control(wire.ResizeRequest(train=train, rollout=rollout, reason="chaos"))
                next_resize = now + rng.uniform(0.3, 1.0)
            await asyncio.sleep(0.05)
        (self.dir / "quiet").touch()

    def result(self, recovery: float | None) -> dict[str, Any]:
        out = super().result(recovery)
        out["partition"] = {**msgspec.to_builtins(self.partition),
                            "applied": self.applied_at is not None and not self.unavailable,
                            "unavailable": self.unavailable}
        return out


class _NoProxy:
    """What `Run` asks of its proxy, for runs whose network is real (`HostRun`)."""

    counts: dict[str, int] = {}
    alive = True
    error = ""


def _kinds() -> Any:
    from dynaresized.domain import WorkerKind

    return WorkerKind


def cause_of(reason: str) -> str:
    if "injected failure" in reason:
        return "injected op failure"
    if "timed out" in reason:
        return "op timeout"
    if "lost" in reason or "restarted" in reason:
        return "worker lost"
    return "other"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_one(seed: int, root: Path, kills: bool, partitions: bool = False) -> dict[str, Any]:
    """One run, in this process (its own event loop, proxy thread and checks)."""
    run = HostRun(seed, root) if partitions else Run(seed, root, kills=kills)

    async def go() -> dict[str, Any]:
        try:
            return await run.run()
        except Exception:  # a harness bug is reported against its seed
            run.violate("harness", traceback.format_exc())
            return run.result(None)

    return asyncio.run(go())


async def run_all(seeds: list[int], jobs: int, root: Path, kills: bool = True,
                  partitions: bool = False) -> list[dict[str, Any]]:
    """Each run in a process of its own (this script with --one): runs side by side share no
    interpreter, so one run's checks never hold up another's proxy."""
    sem = asyncio.Semaphore(jobs)
    done = 0

    async def one(seed: int) -> dict[str, Any]:
        nonlocal done
        async with sem:
            argv = [sys.executable, str(HERE), "--one", str(seed), str(root)] + ([] if kills else ["--no-kills"]) \
                + (["--partitions"] if partitions else [])
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
        try:
            result = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {"seed": seed, "faults": {}, "degraded": [], "recovery_s": None, "injected": {},
                      "committed": 0, "rolled_back": 0, "reconciles": 0, "converged": 0, "daemon_restarts": 0,
                      "workers_lost": 0, "violations": [{"seed": seed, "invariant": "harness",
                                                         "detail": f"exit {proc.returncode}: {err.decode()[-700:]}"}]}
        done += 1
        with contextlib.suppress(OSError):  # beside the run's logs, when --keep keeps them
            (root / f"run-{seed}" / "result.json").write_text(json.dumps(result, indent=1))
        if result["violations"]:
            print(f"seed {seed}: {len(result['violations'])} violation(s)", file=sys.stderr, flush=True)
        if done % 50 == 0:
            print(f"{done}/{len(seeds)} runs", file=sys.stderr, flush=True)
        return result

    return await asyncio.gather(*(one(s) for s in seeds))


def partition_summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per network fault (runs across hosts): runs, how many applied it (the mid-resize and
    mid-loan ones wait for one), violations, and recovery p50 / max."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        p = r.get("partition")
        if not p:
            continue
        o = out.setdefault(p["kind"], {"runs": 0, "applied": 0, "violations": 0, "workers_lost": 0, "recovery_s": []})
        o["runs"] += 1
        o["applied"] += int(p["applied"])
        o["violations"] += len(r["violations"])
        o["workers_lost"] += r["workers_lost"]
        if r["recovery_s"] is not None:
            o["recovery_s"].append(r["recovery_s"])
    for o in out.values():
        rec = o.pop("recovery_s")
        o["recovery_s_p50"] = round(percentile(rec, 0.5), 2) if rec else None
        o["recovery_s_max"] = round(max(rec), 2) if rec else None
    return out


def summarize(results: list[dict[str, Any]], wall_s: float, jobs: int) -> dict[str, Any]:
    violations = [v for r in results for v in r["violations"]]
    degraded: dict[str, int] = {}
    for r in results:
        for reason in r["degraded"]:
            degraded[cause_of(reason)] = degraded.get(cause_of(reason), 0) + 1
    recovery = [r["recovery_s"] for r in results if r["recovery_s"] is not None]
    injected: dict[str, int] = {}
    for r in results:
        for k, v in r["injected"].items():
            injected[k] = injected.get(k, 0) + v
    p = lambda q: None if not recovery else round(percentile(recovery, q), 3)  # noqa: E731
    return {
        "runs": len(results),
        "violations": len(violations),
        "violation_list": violations[:50],
        "degraded_by_cause": degraded,
        "degraded_messages_only": sum(1 for v in violations if v["invariant"] == "degraded_by_messages"),
        "recovery_s": {"p50": p(0.5), "p95": p(0.95), "max": p(1.0),
                       "mean": round(statistics.fmean(recovery), 3) if recovery else None},
        "slowest_recoveries": [{"seed": r["seed"], "recovery_s": round(r["recovery_s"], 3), "faults": r["faults"]}
                               for r in sorted((r for r in results if r["recovery_s"] is not None),
                                               key=lambda r: -r["recovery_s"])[:5]],
        "resizes_committed": sum(r["committed"] for r in results),
        "resizes_rolled_back": sum(r["rolled_back"] for r in results),
        "reconciles": sum(r["reconciles"] for r in results),
        "reconciles_converged": sum(r["converged"] for r in results),
        "daemon_restarts": sum(r["daemon_restarts"] for r in results),
        "workers_lost": sum(r["workers_lost"] for r in results),
        "runs_with_loans": sum(1 for r in results if r["faults"].get("loans")),
        "partitions": partition_summary(results),
        "loans_started": sum(r.get("loans_started", 0) for r in results),
        "loans_returned": sum(r.get("loans_returned", 0) for r in results),
        "regroups_started": sum(r.get("regroups_started", 0) for r in results),
        "regroups_committed": sum(r.get("regroups_committed", 0) for r in results),
        "messages_injected": injected,
        "operator_resumes": sum(len(r["degraded"]) for r in results),
        "jobs": jobs,
        "wall_s": round(wall_s, 1),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        endpoint, device, pool, record = sys.argv[2:6]
        rest = sys.argv[6:]
        curve = Path(rest[rest.index("--curve") + 1]) if "--curve" in rest else None
        hello = float(rest[rest.index("--hello-timeout") + 1]) if "--hello-timeout" in rest else 1.0
        return worker_main(endpoint, device, pool, Path(record), loans="--loans" in rest, curve_dir=curve,
                           hello_timeout_s=hello)
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--one":
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        print(json.dumps(run_one(int(sys.argv[2]), Path(sys.argv[3]), kills="--no-kills" not in sys.argv,
                                 partitions="--partitions" in sys.argv)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="first seed; run i uses seed + i")
    parser.add_argument("--jobs", type=int, default=4, help="runs at once (each is mostly waiting)")
    parser.add_argument("--keep", help="keep every run's logs under this directory")
    parser.add_argument("--no-kills", action="store_true", help="message faults only: no SIGKILLs")
    parser.add_argument("--partitions", action="store_true",
                        help="runs across hosts (network namespaces, CURVE over TCP; needs root): one network "
                             "partition, one-way cut, delay or loss per run (PARTITIONS[seed %% 8])")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints where a stuck run waits
    seeds = [args.seed + i for i in range(args.runs)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dynaresized-chaos-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        results = asyncio.run(run_all(seeds, args.jobs, root, kills=not args.no_kills, partitions=args.partitions))
    print(json.dumps(summarize(results, time.monotonic() - started, args.jobs), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
