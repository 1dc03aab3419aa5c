"""The verl job's two dynaresized workers and the loan decision cycle they serve, whichever verl
trainer drives it: the fully-async trainer's dynamic-schedule policy (`policy.py`) and the V1
separate-async trainer (`v1.py`). No verl import: the trainers hand in what verl says.

Inside verl's trainer process two workers attach (`BlockingWorkerClient`s): `verl-trainer`
(trainer rank on the hybrid slots; it reports every step and its training boundaries) and
`verl-rollout` (rollout engine on the hybrid and standalone slots). Keys are the same files as
every worker's (`DYNARESIZED_KEY_DIR`, `DYNARESIZED_SERVER_KEY`, docs/verl.md).

After each training step the trainer asks `LoanDecisions.decide`: while the daemon answers, its
loan (or none) decides whether verl activates its hybrid replicas until the next step; while it
does not (not yet reached, refused, or lost mid-job) verl's own rule decides, and one log line
says so at each change of who decides.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from dynaresized.client import BlockingWorkerClient, CurveKeys, DaemonRejected, DaemonUnavailable, OpRequest
from dynaresized.core import cycles
from dynaresized.domain import OpKind, PlanKind, StepTiming, WorkerKind
from dynaresized.integrations.verl.layout import ROLLOUT_WORKER, TRAINER_WORKER, WORKERS, VerlLayout, hybrid_wanted

log = structlog.get_logger("dynaresized.verl")

_OP_MARGIN_S = 0.5  # answer a little before the daemon's deadline, with our own reason
DECISION_WAIT_S = 1.0
"""How long verl's trainer waits, after a training step, for the daemon's loan before it goes on
without one (DYNARESIZED_VERL_DECISION_WAIT_S). The daemon decides within milliseconds of the
report; a step without a loan pays the whole wait."""


def curve_keys(env: dict[str, str] | os._Environ[str] | None = None) -> dict[str, CurveKeys] | None:
    """Each worker's CURVE keys, from the files `dynaresized keygen` writes: DYNARESIZED_KEY_DIR
    holds `verl-trainer.key_secret` and `verl-rollout.key_secret`, DYNARESIZED_SERVER_KEY names the
    daemon's public key file. None when neither is set (a loopback daemon without CURVE)."""
    env = os.environ if env is None else env
    key_dir, server = env.get("DYNARESIZED_KEY_DIR", ""), env.get("DYNARESIZED_SERVER_KEY", "")
    if not key_dir and not server:
        return None
    if not key_dir or not server:
        raise ValueError("set DYNARESIZED_KEY_DIR and DYNARESIZED_SERVER_KEY both or neither "
                         f"(DYNARESIZED_KEY_DIR={key_dir!r}, DYNARESIZED_SERVER_KEY={server!r})")
    if not Path(server).is_file():
        raise ValueError(f"DYNARESIZED_SERVER_KEY={server}: no such file (the daemon's public key, "
                         "`dynaresized keygen server --dir DIR` writes DIR/server.key)")
    keys = {}
    for worker in WORKERS:
        secret = Path(key_dir) / f"{worker}.key_secret"
        if not secret.is_file():
            raise ValueError(f"DYNARESIZED_KEY_DIR={key_dir}: no {secret.name} (`dynaresized keygen {worker} "
                             f"--dir {key_dir}` writes it; its {worker}.key goes into the daemon's authorized_keys_dir)")
        try:
            keys[worker] = CurveKeys(secret, server)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the CURVE keys of {worker}: {exc}") from None
    return keys


class Cycle:
    """verl's hybrid state as the op handlers (client threads) and verl's thread share it: what
    verl last said the replicas are, and the loan offered for the decision verl is waiting on."""

    def __init__(self) -> None:
        self.active = False  # verl starts with its hybrid replicas asleep
        self.step = 0
        self.deciding: int | None = None  # the step whose activation verl is deciding now
        self.offer: str | None = None  # the loan's drain op id, while verl decides
        self.accepted: set[str] = set()
        self.return_pending: str | None = None  # a return whose rollout side has begun (its resize id)
        self.return_join: tuple[str, str] | None = None  # (resize id, op id) of a return's trainer join
        self._changed = threading.Condition()

    def observe(self, active: bool, step: int) -> None:
        with self._changed:
            self.active, self.step = active, step
            self._changed.notify_all()

    def wait(self, active: bool, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.active == active, timeout=timeout_s)

    # -- the loan decision: verl's thread opens it, the trainer's drain handler answers it
    def open(self, step: int) -> None:
        with self._changed:
            self.deciding, self.offer = step, None

    def decide(self, timeout_s: float) -> bool:
        """verl's thread: a loan came within `timeout_s` (it is accepted), or verl goes on without."""
        with self._changed:
            self._changed.wait_for(lambda: self.offer is not None, timeout=timeout_s)
            if self.offer is not None:
                self.accepted.add(self.offer)
            self.deciding = None
            self._changed.notify_all()
            return self.offer is not None

    def lend(self, op_id: str, timeout_s: float) -> int:
        """A handler: offer the loan whose drain is `op_id` to the decision in progress; the step
        it was accepted for, or ValueError when verl decided without it."""
        with self._changed:
            if op_id in self.accepted:
                return self.step
            if self.deciding is None:
                raise ValueError(f"verl decided step {self.step}'s activation before this loan came; "
                                 "it can lend the hybrid replicas after its next training step")
            step = self.deciding
            self.offer = op_id
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.deciding is None, timeout=timeout_s)
            if op_id not in self.accepted:
                raise ValueError(f"verl decided step {step}'s activation before this loan came")
            return step


class VerlWorkers:
    """The verl job's two dynaresized workers, attached in the background and kept attached."""

    def __init__(self, endpoint: str, layout: VerlLayout, cycle: Cycle, *, keys: dict[str, CurveKeys] | None,
                 retry_s: float = 2.0, fallback: str = "verl's default policy") -> None:
        self.endpoint = endpoint
        self.fallback = fallback  # who decides while the daemon does not, as the log lines name it
        self.layout = layout
        self.cycle = cycle
        self.keys = keys
        self.retry_s = retry_s
        self.trainer: BlockingWorkerClient | None = None
        self.rollout: BlockingWorkerClient | None = None
        self.refused = ""  # why the daemon refused the job for good ("" if it did not)
        self.last_error = ""  # why the last attempt to attach failed
        self._reports: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=10_000)
        self._stop = threading.Event()
        threading.Thread(target=self._attach, name="dynaresized-verl-attach", daemon=True).start()
        threading.Thread(target=self._report, name="dynaresized-verl-report", daemon=True).start()
        atexit.register(self.close)  # verl has no teardown for policies or trainers: say goodbye at exit

    @property
    def answering(self) -> bool:
        """The daemon answers both workers the job needs now."""
        need = [self.trainer] + ([self.rollout] if self.layout.standalone > 0 else [])
        return all(c is not None and c.client.registered for c in need)

    def report_step(self, timing: StepTiming) -> None:
        self._put(("step", timing))

    def report_mini_batch(self, step: int, done: int, total: int) -> None:
        self._put(("mini_batch", (step, done, total)))

    def _put(self, item: tuple[str, Any]) -> None:
        """Queue one report; never blocks verl (a full queue drops the oldest)."""
        while True:
            try:
                self._reports.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._reports.get_nowait()
                except queue.Empty:
                    pass

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for client in (self.trainer, self.rollout):
            if client is not None:
                try:
                    client.close(reason="verl job ended")
                except Exception as exc:  # the job is ending; the daemon may be gone
                    log.warning("closing the dynaresized client failed", error=str(exc))

    # -- background threads ----------------------------------------------------------
    def _attach(self) -> None:
        """Register both workers, retrying until the daemon answers. Once registered, the
        client re-registers by itself after a daemon restart or a lost connection."""
        while not self._stop.is_set():
            try:  # a worker that registered stays registered while the other one retries
                if self.trainer is None:
                    self.trainer = self._start(TRAINER_WORKER, WorkerKind.TRAINER_RANK,
                                               self.layout.trainer_worker_devices, self._trainer_op)
                if self.rollout is None and self.layout.standalone > 0:
                    self.rollout = self._start(ROLLOUT_WORKER, WorkerKind.ROLLOUT_ENGINE,
                                               self.layout.rollout_worker_devices, self._rollout_op)
                self.last_error = ""
                return
            except DaemonRejected as exc:
                self.refused = str(exc)
                log.error(f"dynaresized refused the verl job; {self.fallback} decides for the rest of it",
                          endpoint=self.endpoint, error=str(exc))
                return
            except DaemonUnavailable as exc:
                self.last_error = str(exc)
                self._stop.wait(self.retry_s)
            except Exception as exc:  # a bug or a broken endpoint: say so, keep verl going, retry
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("attaching to dynaresized failed", error=self.last_error, retry_in_s=self.retry_s)
                self._stop.wait(self.retry_s)

    def _start(self, worker_id: str, kind: WorkerKind, devices: tuple[str, ...],
               handler: object) -> BlockingWorkerClient:
        curve = self.keys[worker_id] if self.keys else None
        client = BlockingWorkerClient(self.endpoint, worker_id, kind, devices, curve=curve)
        for op in OpKind:
            client.on(op, handler)  # type: ignore[arg-type]
        try:
            client.start()
        except BaseException:
            client.close()
            raise
        return client

    def _report(self) -> None:
        while not self._stop.is_set():
            try:
                kind, what = self._reports.get(timeout=1.0)
            except queue.Empty:
                continue
            client = self.trainer
            if client is None or not client.client.registered:
                continue  # the daemon does not answer: its view starts again from the next report
            try:
                if kind == "step":
                    client.report_step(what)
                else:
                    client.report_mini_batch(*what)
            except Exception as exc:  # verl must not die of it; the next step reports again
                log.warning("report to dynaresized failed", report=kind, error=str(exc))

    # -- op handlers (client threads) ------------------------------------------------
    def _check_devices(self, op: OpRequest) -> None:
        if op.plan is PlanKind.RESIZE:
            hybrid_wanted(op.kind, op.plan, op.to_pool)  # raises: verl never resizes
        fixed = [d for d in op.devices if d not in self.layout.hybrid_devices]
        if fixed:
            raise ValueError(f"verl cannot lend {', '.join(fixed)}: only hybrid replicas change roles")
        if op.plan is PlanKind.LOAN and set(op.devices) != set(self.layout.hybrid_devices):
            raise ValueError(f"verl activates all {self.layout.hybrid} hybrid replicas together, not "
                             f"{len(op.devices)}")

    def _trainer_op(self, op: OpRequest) -> str:
        self._check_devices(op)
        if op.plan is PlanKind.LOAN and op.kind is OpKind.DRAIN:
            step = self.cycle.lend(op.op_id, max(op.timeout_s - _OP_MARGIN_S, 0.1))
            return f"verl activates its hybrid replicas after training step {step}"
        if op.plan is PlanKind.RETURN and op.kind is OpKind.JOIN:
            self.cycle.return_join = (op.resize_id, op.op_id)
            return f"verl's trainer has its GPUs back for step {self.cycle.step + 1}"
        # verl's FSDP group keeps every trainer GPU whatever the hybrid replicas do
        return f"{op.kind.value}: verl's trainer keeps its FSDP group on all trainer GPUs"

    def _rollout_op(self, op: OpRequest) -> str:
        self._check_devices(op)
        if op.plan is PlanKind.RETURN and op.kind is OpKind.DRAIN:
            self.cycle.return_pending = op.resize_id
        want = hybrid_wanted(op.kind, op.plan, op.to_pool)
        if want is None:
            if op.kind in (OpKind.RESUME, OpKind.RECLAIM):
                return (f"{op.kind.value}: verl's hybrid replicas sleep through every training step; "
                        "only a new loan after it activates them")
            return f"{op.kind.value}: nothing to do in verl"
        state = "active" if want else "asleep"
        started = time.monotonic()
        if not self.cycle.wait(want, max(op.timeout_s - _OP_MARGIN_S, 0.1)):
            raise TimeoutError(f"verl did not make its hybrid replicas {state} within {op.timeout_s:.1f}s "
                               "(verl acts at its training step boundaries; raise core.op_timeout_s above one "
                               "verl step)")
        return f"verl hybrid replicas {state} at step {self.cycle.step} (waited {time.monotonic() - started:.2f}s)"


def cycle_timing(step: int, layout: VerlLayout, **cycle: Any) -> StepTiming:
    """`core.cycles.cycle_timing` for verl's layout (its standalone and hybrid GPUs)."""
    return cycles.cycle_timing(step, layout.standalone, layout.hybrid, **cycle)


class LoanDecisions:
    """A verl trainer's side of the daemon: the workers, attached once verl knows its layout,
    and after each training step who decides whether the hybrid replicas are lent until the
    next one. Configured through the environment (the Ray runtime_env): DYNARESIZED_ENDPOINT,
    DYNARESIZED_VERL_DECISION_WAIT_S, and for CURVE DYNARESIZED_KEY_DIR and DYNARESIZED_SERVER_KEY."""

    def __init__(self, fallback: str, *, endpoint: str | None = None) -> None:
        self.fallback = fallback  # verl's own rule, as the log lines name it
        self.endpoint = endpoint or os.environ.get("DYNARESIZED_ENDPOINT", "tcp://127.0.0.1:5555")
        self.decision_wait_s = float(os.environ.get("DYNARESIZED_VERL_DECISION_WAIT_S", DECISION_WAIT_S))
        self.keys = curve_keys()  # a bad key setting stops the job here, before any step
        self.cycle = Cycle()
        self.layout: VerlLayout | None = None
        self.workers: VerlWorkers | None = None
        self.observe_only = False  # verl cannot lend: the daemon sees the steps, verl's rule decides
        self._deciding = "nobody"  # who the last log line said decides ("daemon" or "default")
        self.decided_by = "default"  # who decided the last activation

    def attach(self, layout: VerlLayout, *, observe_only: bool = False) -> None:
        """Start the workers for `layout` (once). `observe_only`: verl's own cycle cannot lend the
        hybrid replicas (the caller logs why); the daemon records the steps, verl decides."""
        if self.workers is None:
            self.layout, self.observe_only = layout, observe_only
            self.workers = VerlWorkers(self.endpoint, layout, self.cycle, keys=self.keys, fallback=self.fallback)

    def training_begins(self, step: int) -> None:
        """Training step `step` begins: anything lent goes home (verl sleeps its hybrid replicas)."""
        if self.workers is not None and not self.observe_only:
            self.workers.report_mini_batch(step, 0, 1)

    def decider(self, step: int) -> str:
        """Who decides this step's activation: the daemon while it answers, else verl's own rule.
        One line whenever that changes."""
        workers = self.workers
        who = "daemon" if workers is not None and workers.answering and not self.observe_only else "default"
        self.decided_by = who
        if who == "default" and self._deciding == "nobody" and workers is not None and not (
                workers.last_error or workers.refused or self.observe_only):
            return who  # the first hello is still on its way: nothing to say yet
        if who != self._deciding:
            if who == "daemon":
                log.info("dynaresized answers; it decides verl's hybrid activations", endpoint=self.endpoint,
                         step=step)
            elif self._deciding == "daemon":
                log.warning(f"dynaresized stopped answering; {self.fallback} decides until it is back",
                            endpoint=self.endpoint, step=step)
            elif not self.observe_only and workers is not None:
                why = workers.refused or workers.last_error
                log.warning(f"dynaresized is unreachable; {self.fallback} decides until it answers",
                            endpoint=self.endpoint, step=step, error=why or "no answer yet")
            self._deciding = who
        return who

    def decide(self, step: int, active: bool, report: Callable[[], StepTiming | None], *,
               can_lend: bool = True) -> bool | None:
        """After training step `step`, before verl's weight sync: True to lend the hybrid replicas
        (the daemon's loan came), False to keep them asleep (it did not), None when verl's own rule
        decides. `report` gives the cycle's timing, sent before the daemon is asked. `can_lend`
        False (verl has no next step to lend for): the step is reported and no loan is asked for."""
        self.cycle.observe(active, step)  # asleep: a return's ops are answered
        who = self.decider(step)
        if who == "default" or self.workers is None:
            self._report(report)
            return None
        if not can_lend:
            self._report(report)
            return False
        self._await_return()
        self._report(report)
        self.cycle.open(step)
        self.workers.report_mini_batch(step, 1, 1)  # the training step is done: lend?
        return self.cycle.decide(self.decision_wait_s)

    def _report(self, report: Callable[[], StepTiming | None]) -> None:
        timing = report()
        if timing is not None and self.workers is not None:
            self.workers.report_step(timing)

    def _await_return(self) -> None:
        """Before the next loan: the return of the last one finished at the daemon (its trainer
        join answered), or the daemon, still busy with it, would not consider a new one."""
        workers = self.workers
        deadline = time.monotonic() + self.decision_wait_s
        while workers is not None and workers.trainer is not None and time.monotonic() < deadline:
            pending, join = self.cycle.return_pending, self.cycle.return_join
            if pending is None or (join is not None and join[0] == pending and workers.trainer.client.answered(join[1])):
                self.cycle.return_pending = None
                return
            time.sleep(0.005)
