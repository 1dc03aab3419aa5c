"""The resize state machine: `Core.step(state, event) -> (state, facts, commands)`.

Which events a phase accepts is data (`TRANSITIONS`); a missing entry raises
`IllegalTransition` naming the phase and the event, and the state is left unchanged. Input
that a phase accepts but that is wrong (unknown device, stale operation) raises `Refused`,
also with the state unchanged: both are the sender's problem, and the shell tells the sender.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
from msgspec.structs import replace

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import guards
from dynaresized.core.idle import step_period_s
from dynaresized.core.policy import (
    EngineTail,
    LoanCosts,
    LoanProposal,
    LoanView,
    ObservedView,
    Policy,
    Proposal,
    ResizeCosts,
    TailCosts,
    TailProposal,
)
from dynaresized.core.state import ClusterState, InFlight, Phase, Progress, derived, grown, mutate, progressed, seen_at
from dynaresized.domain import (
    UNDO,
    ActualState,
    DeviceId,
    Holding,
    OpKind,
    OpSpec,
    PlanKind,
    Pool,
    ResizePlan,
    Split,
    Worker,
    WorkerKind,
    WorkerStatus,
)


class CoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    guards: guards.GuardConfig = guards.GuardConfig()
    heartbeat_timeout_s: float = 10.0
    """A worker silent for longer is declared lost."""
    op_timeout_s: float = 120.0
    """An operation not acknowledged by all its targets in this time fails the resize."""
    steps_total: int | None = None
    """Job length in RL steps, if known: bounds the payback horizon."""
    costs: ResizeCosts = ResizeCosts()
    """Resize cost per device before any resize has been measured."""
    op_resend_s: float | None = None
    """While an op is pending, re-send it to its live targets this often (workers deduplicate by
    op id and answer a repeat from their record), so a lost message never fails a resize.
    None: never (the simulator, where no message is lost)."""
    audit_interval_s: float | None = None
    """Ask every live worker that reports its actual state for it this often. None: never."""
    reconcile_retry_s: float = 30.0
    """A worker that could not be converged is tried again this long after (its devices stay
    out of resize plans meanwhile)."""
    loan_costs: LoanCosts = LoanCosts()
    """What a loan adds to the critical path, for the lending policy's estimate, before any
    loan that way has been measured."""
    learn_loan_costs: bool = False
    """After loans of a direction have landed and come home, their measured seconds (the mean of
    the last `state.LOAN_TIMES_KEPT`) replace the configured way home and landing
    (`LoanCosts.learned`), as the measured resize costs replace `costs`. Only where workers
    acknowledge a loan's ops when they are done (the torch and vLLM backends): verl's
    integration acknowledges a return when verl's own cycle puts the replicas to sleep, so its
    measured way home is verl's schedule, not a cost. False: always the configured ones (and
    the simulator, whose configured costs are the profile's own)."""
    stall_s: float | None = None
    """A tick that comes more than this after the one before means the daemon itself was not
    running (starved of CPU, or waiting on a slow disk): that blind time does not count as the
    workers' silence. None: every gap counts (the simulator and tests, which jump in time)."""
    tail_costs: TailCosts | None = None
    """Regroup a step's tail into a wider engine when the policy predicts it pays (`propose_tail`):
    what that costs and how fast each width decodes. None (the daemon): never, as no backend moves
    a running request's KV cache; the simulator sets it from the profile's `[resize.tail]`."""


class SendOp(msgspec.Struct, frozen=True):
    """Command: ask `worker_id` to perform `op`. Workers deduplicate by `op.op_id`, so a
    command re-sent after a crash is answered, not re-run."""

    worker_id: str
    resize_id: str
    op: OpSpec
    deadline: float
    training: tuple[DeviceId, ...]  # the training pool once the resize commits
    rollout: tuple[DeviceId, ...]  # the rollout pool once the resize commits
    plan: PlanKind = PlanKind.RESIZE  # a loan or its return travels as the same ops
    engine: tuple[DeviceId, ...] = ()
    """An engine worker: the devices of the engine it serves in once this sequence is done (an
    undo: the one it goes back to), when wider than its own device (it leads that engine if its
    device is the first); empty otherwise."""


class QueryState(msgspec.Struct, frozen=True):
    """Command: ask `worker_id` for its actual state (it answers with a state report)."""

    worker_id: str


Command = SendOp | QueryState


class IllegalTransition(Exception):
    def __init__(self, phase: Phase, event: ev.Event) -> None:
        self.phase = phase
        self.event = event
        super().__init__(f"event {type(event).__name__} is not accepted in phase {phase.value!r}")


class Refused(Exception):
    """The event was refused; `code` is stable for programs, `message` is for people."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class _Tx:
    """One step's accumulation: facts are folded as they are emitted."""

    __slots__ = ("state", "facts", "commands")

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.facts: list[f.Fact] = []
        self.commands: list[Command] = []

    def emit(self, fact: f.Fact) -> None:
        self.state = mutate(self.state, fact)
        self.facts.append(fact)


Handler = Callable[["Core", _Tx, ev.Event], None]
_P = TypeVar("_P", LoanProposal, TailProposal)


class Core:
    def __init__(self, config: CoreConfig, policy: Policy) -> None:
        self.config = config
        self.policy = policy

    def step(self, state: ClusterState, event: ev.Event) -> tuple[ClusterState, list[f.Fact], list[Command]]:
        handler = TRANSITIONS[state.phase].get(type(event))
        if handler is None:
            raise IllegalTransition(state.phase, event)
        tx = _Tx(state)
        handler(self, tx, event)
        if type(event) in _HEARD_FROM and tx.state.is_live(event.worker_id):  # type: ignore[attr-defined]
            tx.state = seen_at(tx.state, event.worker_id, event.at)  # type: ignore[attr-defined]
        if tx.state.phase is Phase.STEADY and not tx.state.stopping and (
                type(event) is ev.Tick or (tx.facts and any(type(x) in _RECHECK for x in tx.facts))):
            _reconcile_next(self, tx, event.at)
        # A Tick can declare a worker lost after an earlier loss in the same Tick sent it an undo
        # or commit op; such a command contradicts this step's own facts and nobody could answer it
        # (a hello re-sends what is still pending), so only commands to live workers leave.
        commands = [c for c in tx.commands if tx.state.is_live(c.worker_id)]
        return tx.state, tx.facts, commands

    def step_answers(self, state: ClusterState, answers: Sequence[ev.OpReported]) -> tuple[
            ClusterState, list[f.Fact], list[Command]]:
        """`step` of each of `answers` in order, their facts and commands together: for the
        answers of one op's targets arriving at once (an op to every device of a wide loan).
        Until the last of them the op is owed to a live target that has not answered (the
        last one's worker), so stepping an answer before it only folds its `OpAcked`: that is
        all done for them, and the last is stepped as any event. Anything else (a failure, a
        stale or duplicate answer, a worker not live) is stepped one by one; an answer `step`
        refuses raises as there, and nothing of the batch is kept (the daemon, which answers
        each sender, steps them one by one)."""
        fl = state.inflight
        if len(answers) < 2 or fl is None or TRANSITIONS[state.phase].get(ev.OpReported) is not on_op_reported:
            return self._step_each(state, answers)
        targets, acked, seen = _targets(fl), acked_set(fl), set()
        for a in answers:
            if (not a.ok or a.actual is not None or a.op_id != fl.op.op_id or a.worker_id not in targets
                    or a.worker_id in acked or a.worker_id in seen or not state.is_live(a.worker_id)):
                return self._step_each(state, answers)
            seen.add(a.worker_id)
        facts: list[f.Fact] = []
        for a in answers[:-1]:
            fact = f.OpAcked(at=a.at, op_id=a.op_id, worker_id=a.worker_id, detail=a.detail, actual=None)
            state = seen_at(mutate(state, fact), a.worker_id, a.at)  # as `step` does: an answer is a beat
            facts.append(fact)
        state, last, commands = self.step(state, answers[-1])
        return state, facts + last, commands

    def _step_each(self, state: ClusterState, events: Sequence[ev.Event]) -> tuple[
            ClusterState, list[f.Fact], list[Command]]:
        facts: list[f.Fact] = []
        commands: list[Command] = []
        for event in events:
            state, more, sent = self.step(state, event)
            facts.extend(more)
            commands.extend(sent)
        return state, facts, commands

    # -- views ---------------------------------------------------------------------
    def view(self, state: ClusterState, now: float) -> ObservedView:
        learned = state.cost_per_device_s
        costs = ResizeCosts(
            to_training_s=learned.get("rollout->training", self.config.costs.to_training_s),
            to_rollout_s=learned.get("training->rollout", self.config.costs.to_rollout_s),
        )
        remaining = None
        if self.config.steps_total is not None:
            remaining = max(self.config.steps_total - state.last_step - 1, 0)
        return ObservedView(
            now=now,
            step=state.last_step,
            split=state.split,
            candidates=state.candidates,
            recent=state.recent,
            costs=costs,
            steps_remaining=remaining,
            history=state.step_history,
        )


# -- handlers ------------------------------------------------------------------------


def _require_worker(state: ClusterState, worker_id: str) -> Worker:
    w = state.workers.get(worker_id)
    if w is None:
        raise Refused("unknown_worker", f"worker {worker_id!r} is not registered; send hello first")
    if w.status is not WorkerStatus.LIVE:
        raise Refused("not_registered", f"worker {worker_id!r} is {w.status.value}; send hello again")
    return w


def on_configure(core: Core, tx: _Tx, e: ev.Configure) -> None:
    if tx.state.configured:
        raise Refused("already_configured", "the cluster inventory is already in the log")
    if not e.devices or len(set(e.devices)) != len(e.devices):
        raise Refused("bad_config", "devices must be a non-empty list of distinct ids")
    if len(e.pools) != len(e.devices):
        raise Refused("bad_config", "every device needs an initial pool")
    for c in e.candidates:
        if c.total != len(e.devices) or c.train < 0 or c.rollout < 0:
            raise Refused("bad_config", f"candidate split {c} does not cover the {len(e.devices)} devices")
    tx.emit(f.ClusterConfigured(at=e.at, devices=e.devices, pools=e.pools, candidates=e.candidates))


def on_daemon_started(core: Core, tx: _Tx, e: ev.DaemonStarted) -> None:
    deadline = e.at + core.config.op_timeout_s if tx.state.inflight is not None else None
    tx.emit(f.DaemonRestarted(at=e.at, op_deadline=deadline))


def on_hello(core: Core, tx: _Tx, e: ev.WorkerHello) -> None:
    s = tx.state
    if not e.devices or len(set(e.devices)) != len(e.devices):
        raise Refused("bad_request", "hello must name one or more distinct devices")
    unknown = [d for d in e.devices if d not in s.devices]
    if unknown:
        raise Refused(
            "unknown_device",
            f"device(s) {', '.join(unknown)} are not in this cluster's inventory "
            f"({len(s.devices)} devices configured)",
        )
    for d in e.devices:
        others = sorted(w for w in s.live_owners(d, e.kind) if w != e.worker_id)
        if others:
            raise Refused("device_owned", f"device {d} already has live {e.kind.value} worker {others[0]!r}")
    old = s.workers.get(e.worker_id)
    if old is not None and old.status is WorkerStatus.LIVE and (old.kind, old.devices) != (e.kind, e.devices):
        raise Refused(
            "conflict",
            f"worker {e.worker_id!r} is live as {old.kind.value} on {', '.join(old.devices)}; "
            "use another worker id or stop the old worker",
        )
    if (old is not None and old.status is WorkerStatus.LIVE and old.process and e.process == old.process
            and old.secret_sha256 and e.secret_sha256 != old.secret_sha256):
        # The process value is in the log; the secret is not. Whoever names the live process
        # without its secret is not that process: it gets neither the registration nor a new one.
        raise Refused("not_the_process",
                      f"this hello names worker {e.worker_id!r}'s live process but not its secret; a process "
                      "sends the same secret in every hello (a new process uses a new `process` value)")
    if (e.registered_here and old is not None and old.status is WorkerStatus.LIVE and old.process
            and e.process == old.process):
        _hello_again(core, tx, e)
        return
    if old is not None and old.status is WorkerStatus.LIVE and old.process and e.process != old.process:
        if e.previous_connected:
            raise Refused("duplicate_worker",
                          f"worker {e.worker_id!r} is live in another process whose connection is still open; "
                          "stop that process first, or give this one another worker id")
        # A new process under a live worker's name, the old one's connection gone: the old one
        # died, with whatever it had done for a resize in flight. That is a loss.
        tx.emit(f.WorkerLost(at=e.at, worker_id=e.worker_id, reason="restarted: a new process registered"))
        _after_worker_gone(core, tx, e.worker_id, "restarted", e.at)
        old = tx.state.workers[e.worker_id]
    incarnation = 1 if old is None else old.incarnation + 1
    worker = Worker(e.worker_id, e.kind, e.devices, WorkerStatus.LIVE, e.at, incarnation, e.process, e.actual,
                    e.secret_sha256)
    tx.emit(f.WorkerRegistered(at=e.at, worker=worker))
    _resend_pending_to(tx, e.worker_id)


def _resend_pending_to(tx: _Tx, worker_id: str) -> None:
    """A worker that says hello gets the op in flight again if it has not answered it: its
    answer may have been lost, and it answers from its record (or re-runs it after a restart)."""
    fl = tx.state.inflight
    if fl is not None and worker_id in _targets(fl) and worker_id not in acked_set(fl):
        _send(tx, [worker_id])


def _hello_again(core: Core, tx: _Tx, e: ev.WorkerHello) -> None:
    """The registered process says hello again (no heartbeat answer reached it, or its hellos
    crossed on a slow link): its registration stands. A new one per hello would make the
    token it holds stale, its next message would be refused, and it would say hello again."""
    on_heartbeat(core, tx, ev.Heartbeat(at=e.at, worker_id=e.worker_id))
    if e.actual is not None:
        on_state_reported(core, tx, ev.StateReported(at=e.at, worker_id=e.worker_id, actual=e.actual))
    _resend_pending_to(tx, e.worker_id)


def on_heartbeat(core: Core, tx: _Tx, e: ev.Heartbeat) -> None:
    _require_worker(tx.state, e.worker_id)
    tx.state = seen_at(tx.state, e.worker_id, e.at)


def on_bye(core: Core, tx: _Tx, e: ev.WorkerBye) -> None:
    _require_worker(tx.state, e.worker_id)
    tx.emit(f.WorkerLeft(at=e.at, worker_id=e.worker_id))
    _after_worker_gone(core, tx, e.worker_id, "said goodbye", e.at)


def on_state_reported(core: Core, tx: _Tx, e: ev.StateReported) -> None:
    w = _require_worker(tx.state, e.worker_id)
    # A worker left out as unconverged that now reports what the log says is recorded even when
    # the report repeats the last one (e.g. its converging op "failed" after it had acted).
    agrees_now = e.worker_id in tx.state.unconverged and tx.state.desired(w) == e.actual.holding
    if e.actual != w.actual or agrees_now:
        tx.emit(f.WorkerReported(at=e.at, worker_id=e.worker_id, actual=e.actual))


def _observe_step(core: Core, tx: _Tx, e: ev.StepReported) -> None:
    _require_worker(tx.state, e.worker_id)
    reporter = tx.state.step_reporter
    if reporter and reporter != e.worker_id and tx.state.is_live(reporter):
        # One worker of the job reports the steps: the first that does, for as long as it is live.
        raise Refused("not_the_reporter",
                      f"worker {reporter!r} reports this job's steps (it sent the first step report and is live); "
                      f"a step report from {e.worker_id!r} would count a step twice or out of order")
    t = e.timing
    if t.step <= tx.state.last_step:
        raise Refused("stale_step", f"step {t.step} is not after the last observed step {tx.state.last_step}")
    for name in ("rollout_s", "train_s", "weight_sync_s"):
        value = getattr(t, name)
        if not math.isfinite(value) or value < 0:
            raise Refused("bad_value", f"{name}={value!r} must be a finite number of seconds >= 0")
    tx.emit(f.StepObserved(at=e.at, worker_id=e.worker_id, timing=t))
    _check_outcome(core, tx, e.at)


def on_step_steady(core: Core, tx: _Tx, e: ev.StepReported) -> None:
    _observe_step(core, tx, e)
    if tx.state.tail_due:
        # the tail's engine first (trainers lent into it go home after: `_advance`)
        _tail_back(core, tx, e.at)
        if tx.state.inflight is not None:
            return  # the policy is asked once the engines are back (`_after_tail_back`)
    _boundary(core, tx, e.at, e.timing.step)


def _boundary(core: Core, tx: _Tx, at: float, step: int, why: str = "") -> None:
    """A step boundary's work: lent devices go home, and the policy has its say on step `step`
    (a resize it proposes starts once they are home; paused or stopping, it is not asked)."""
    s = tx.state
    lent = s.lent_devices()
    if s.paused or s.stopping:
        if lent:
            _return_loans(core, tx, at, None, "", why=why)
        return
    view = core.view(s, at)
    proposal = core.policy(view)
    if lent:
        _return_loans(core, tx, at, proposal, core.policy.name, why=why)
        return
    if proposal is None:
        held = getattr(core.policy, "last_reason", "") or "the policy proposed no resize"
        tx.emit(f.PolicyHeld(at=at, source=core.policy.name, step=step, split=s.split, reason=held))
        return
    _decide(core, tx, view, proposal, core.policy.name, hysteresis=core.policy.guarded, at=at)


def on_step_observe(core: Core, tx: _Tx, e: ev.StepReported) -> None:
    _observe_step(core, tx, e)


def on_progress(core: Core, tx: _Tx, e: ev.ProgressReported) -> None:
    _require_worker(tx.state, e.worker_id)
    if not (0 <= e.done <= e.total) or e.tokens < 0 or e.step < 0:
        raise Refused("bad_value", f"progress done={e.done} total={e.total} tokens={e.tokens} is impossible")
    tx.state = progressed(tx.state, e.worker_id, Progress(e.step, e.done, e.total, e.tokens))  # soft: no fact
    # A lending policy that sends its loans home on the rollout's progress (verl's rules go home
    # once enough samples are done) is asked after every report.
    s = tx.state
    ask = getattr(core.policy, "observe_progress", None)
    if ask is None or not _free_to_plan(s):
        return
    why = ask(loan_view(core, s, e.at))
    if why and s.lent_devices():
        _return_loans(core, tx, e.at, None, "", why=why)


def on_resize_requested_steady(core: Core, tx: _Tx, e: ev.ResizeRequested) -> None:
    if tx.state.stopping:
        _reject(tx, e.at, e.requested_by, e.target, "stopping", "the daemon is shutting down")
        return
    view = core.view(tx.state, e.at)
    current = view.split
    proposal = Proposal(target=e.target, reason=e.reason or "requested by operator", predicted_step_s=0.0,
                        predicted_step_s_after=0.0)
    if current == e.target:
        _reject(tx, e.at, e.requested_by, e.target, "candidates", f"the split is already {current}")
        return
    _decide(core, tx, view, proposal, e.requested_by, hysteresis=False, at=e.at)


def on_resize_requested_busy(core: Core, tx: _Tx, e: ev.ResizeRequested | ev.RegroupRequested) -> None:
    s = tx.state
    target = e.target if isinstance(e, ev.ResizeRequested) else None
    if s.phase is Phase.DEGRADED:
        why = f"resizing is suspended ({s.degraded_reason}); run `dynaresized resume` first"
        _reject(tx, e.at, e.requested_by, target, "degraded", why)
        return
    fl = s.inflight
    assert fl is not None
    what = f"reconcile {fl.plan.resize_id} of {fl.reconciling}" if fl.reconciling else f"resize {fl.plan.resize_id}"
    _reject(tx, e.at, e.requested_by, target, "in_flight",
            f"{what} is in flight (phase {s.phase.value}); one operation sequence at a time")


def on_regroup_requested_steady(core: Core, tx: _Tx, e: ev.RegroupRequested) -> None:
    s = tx.state
    if s.stopping or s.paused:
        why = "the daemon is shutting down" if s.stopping else "resizing is paused; run `dynaresized resume` first"
        _reject(tx, e.at, e.requested_by, None, "stopping" if s.stopping else "paused", why)
        return
    plan = plan_regroup(s, e.devices, e.tp)
    if isinstance(plan, str):
        _reject(tx, e.at, e.requested_by, None, "regroup", plan)
        return
    shape = " + ".join("TP-%d engine [%s]" % (len(g), ", ".join(g)) for g in plan.engines)
    tx.emit(f.RegroupStarted(at=e.at, plan=plan, source=e.requested_by,
                             reason=f"{e.reason or 'requested by operator'}: {len(plan.devices)} device(s) "
                                    f"become {shape}",
                             op_deadline=e.at + core.config.op_timeout_s))
    _advance(core, tx, e.at, fresh=True)


def plan_regroup(state: ClusterState, devices: tuple[DeviceId, ...], tp: int, *, lent_ok: bool = False,
                 engines: tuple[tuple[DeviceId, ...], ...] | None = None) -> ResizePlan | str:
    """Drain, release, join, restore and commit that make `devices` (rollout devices, each with
    a live engine worker of its own) serve as engines of `tp` devices each, in device order;
    or why that is impossible now. The devices must hold whole engines: a regroup never
    splits an engine it does not name whole. A tail regroup (`lent_ok`) may take devices lent to
    the rollout, and its way back names the `engines` it restores."""
    devices = tuple(sorted(set(devices)))
    if tp < 1 or not devices or len(devices) % tp:
        return f"{len(devices)} device(s) do not form engines of {tp} device(s) each"
    unknown = [d for d in devices if d not in state.devices]
    if unknown:
        return f"device(s) {', '.join(unknown)} are not in this cluster's inventory"
    lent = set(state.lent_devices())
    held_back = state.held_back()
    for d in devices:
        p = state.devices[d]
        if p.pool is not Pool.ROLLOUT or (not lent_ok and (p.home is not None or d in lent)):
            where = "moving" if p.pool is None else f"lent to {p.pool.value}" if p.home else f"in {p.pool.value}"
            return f"device {d} is {where}: only devices at home in the rollout pool are regrouped"
        if d in held_back:
            return f"device {d} is left out: a worker on it has not converged"
        outside = [x for x in state.engine_of(d) if x not in devices]
        if outside:
            return (f"device {d} serves in the engine [{', '.join(state.engine_of(d))}]: name all of its "
                    f"devices ({', '.join(outside)} missing)")
    live = state.live_workers_by_device()
    workers = []
    for d in devices:
        w = live.get((d, WorkerKind.ROLLOUT_ENGINE))
        if w is None:
            return f"device {d} has no live rollout-engine worker"
        if w.devices != (d,):
            return (f"worker {w.worker_id} holds {', '.join(w.devices)}: only engines of one device's worker "
                    "each are regrouped (a worker of several devices shapes its own engines)")
        workers.append(w.worker_id)
    if engines is None:
        engines = tuple(devices[i:i + tp] for i in range(0, len(devices), tp))
    if all(state.engine_of(g[0]) == g for g in engines):
        return f"devices {', '.join(devices)} already serve as engines of {tp} device(s)"
    rid = f"g{state.regroups_started + 1}"
    ops = tuple(OpSpec(op_id=f"{rid}/{i}-{k.value}", kind=k, devices=devices, targets=tuple(workers),
                       from_pool=Pool.ROLLOUT, to_pool=Pool.ROLLOUT)
                for i, k in enumerate((OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT)))
    split = state.split
    return ResizePlan(resize_id=rid, devices=devices, from_pool=Pool.ROLLOUT, to_pool=Pool.ROLLOUT, ops=ops,
                      before=split, after=split, kind=PlanKind.REGROUP, engines=engines)


def on_pause(core: Core, tx: _Tx, e: ev.PauseRequested) -> None:
    if not tx.state.paused:
        tx.emit(f.ResizingPaused(at=e.at, requested_by=e.requested_by, reason=e.reason))


def on_config_reloaded(core: Core, tx: _Tx, e: ev.ConfigReloaded) -> None:
    tx.emit(f.ConfigReloaded(at=e.at, policy=e.policy, options=e.options, guards_changed=e.guards_changed,
                             restart_only=e.restart_only))


def on_reload_refused(core: Core, tx: _Tx, e: ev.ReloadRefused) -> None:
    tx.emit(f.ReloadRefused(at=e.at, reason=e.reason))


def on_resume(core: Core, tx: _Tx, e: ev.ResumeRequested) -> None:
    degraded = tx.state.phase is Phase.DEGRADED
    if tx.state.paused or degraded:
        tx.emit(f.ResizingResumed(at=e.at, requested_by=e.requested_by))
    s = tx.state
    if degraded and s.lent_devices() and s.inflight is None and not s.stopping:
        # A loan that could neither land nor go back (its undo failed), or whose return failed:
        # its step is over or it never served. Home now, not at a step report that may not come.
        _return_loans(core, tx, e.at, None, "", why="resumed after a failed loan")


def on_shutdown(core: Core, tx: _Tx, e: ev.ShutdownRequested) -> None:
    if not tx.state.stopping:
        tx.emit(f.ShutdownStarted(at=e.at))


def on_abort_requested(core: Core, tx: _Tx, e: ev.AbortRequested) -> None:
    fl = tx.state.inflight
    if fl is None or fl.rolling_back or (fl.index < len(fl.ops) and fl.op.kind is OpKind.COMMIT):
        return  # nothing to abort, or past the point of no return
    reason = f"aborted by {e.requested_by}: {e.reason or 'no reason given'}"
    if fl.reconciling:  # nothing to undo: the worker is converged again when it next reports
        tx.emit(f.ReconcileFinished(at=e.at, resize_id=fl.plan.resize_id, worker_id=fl.reconciling, ok=False,
                                    reason=reason))
        return
    tx.emit(f.OpFailed(at=e.at, op_id=fl.op.op_id, worker_id=None, reason=reason))
    _abort(core, tx, reason, e.at)


def on_tick(core: Core, tx: _Tx, e: ev.Tick) -> None:
    timeout = core.config.heartbeat_timeout_s
    _credit_stall(core, tx, e.at)
    # Only the silent ones are sorted (into worker id order, for determinism): the rest, nearly
    # every worker at every tick, cost one comparison each.
    late = sorted((w, seen) for w, seen in tx.state.last_seen.items() if e.at - seen > timeout)
    for worker_id, seen in late:
        silent = e.at - seen
        if tx.state.is_live(worker_id):
            tx.emit(f.WorkerLost(at=e.at, worker_id=worker_id,
                                 reason=f"no heartbeat for {silent:.1f}s (heartbeat_timeout_s={timeout:g})"))
            _after_worker_gone(core, tx, worker_id, "lost", e.at)
    fl = tx.state.inflight
    if fl is not None and e.at > fl.op_deadline:
        waiting = _pending(tx.state)
        reason = (f"{fl.op.kind.value} timed out after {e.at - fl.op_started_at:.1f}s "
                  f"(op_timeout_s={core.config.op_timeout_s:g}); waiting for {', '.join(waiting) or 'nobody'}")
        tx.emit(f.OpFailed(at=e.at, op_id=fl.op.op_id, worker_id=None, reason=reason))
        _op_failed(core, tx, reason, e.at)
    _resend_pending(core, tx, e.at)
    _audit(core, tx, e.at)


def _credit_stall(core: Core, tx: _Tx, at: float) -> None:
    """After a stall of the daemon, its heartbeat clocks move forward by the time it could not
    watch: messages that waited in its socket meanwhile are read after this tick, and would
    otherwise find every worker already declared lost."""
    s = tx.state
    gap = at - s.last_tick
    if core.config.stall_s is not None and s.last_tick and gap > core.config.stall_s:
        tx.state = replace(s, last_tick=at, seen_base={w: min(at, seen + gap) for w, seen in s.last_seen.items()},
                           seen_recent={})
        fl = tx.state.inflight
        if fl is not None and fl.op_deadline >= s.last_tick:  # the op was still in time when the stall began
            tx.emit(f.DaemonStalled(at=at, seconds=gap, op_deadline=fl.op_deadline + gap))
    else:
        tx.state = replace(s, last_tick=at)


def _resend_pending(core: Core, tx: _Tx, at: float) -> None:
    """A lost command or answer costs one re-send interval, not the resize: the pending op
    goes again to its live targets that have not answered (they answer a repeat from their
    record, or keep running the first copy)."""
    fl, every = tx.state.inflight, core.config.op_resend_s
    if fl is None or every is None or fl.index >= len(fl.ops):
        return
    if at - max(tx.state.last_sent, fl.op_started_at) >= every:
        tx.state = replace(tx.state, last_sent=at)
        _send(tx, None)


def _audit(core: Core, tx: _Tx, at: float) -> None:
    """Now and then, ask every live worker that reports its state what it holds."""
    every = core.config.audit_interval_s
    if every is None or at - tx.state.last_audit < every:
        return
    tx.state = replace(tx.state, last_audit=at)
    for w in sorted(tx.state.workers.values(), key=lambda w: w.worker_id):
        if w.status is WorkerStatus.LIVE and w.actual is not None:
            tx.commands.append(QueryState(worker_id=w.worker_id))


def on_op_reported(core: Core, tx: _Tx, e: ev.OpReported) -> None:
    _require_worker(tx.state, e.worker_id)
    fl = tx.state.inflight
    assert fl is not None
    if e.op_id != fl.op.op_id:  # e.g. a late answer to a re-sent op that has completed
        raise Refused("stale_op", f"operation {e.op_id} is not in flight (current: {fl.op.op_id})")
    if e.worker_id not in _targets(fl):
        raise Refused("not_a_target", f"operation {e.op_id} was not sent to {e.worker_id!r}")
    if e.worker_id in acked_set(fl):
        return  # a duplicate answer: the first one counted
    if e.ok:
        tx.emit(f.OpAcked(at=e.at, op_id=e.op_id, worker_id=e.worker_id, detail=e.detail, actual=e.actual))
        _advance(core, tx, e.at)
        return
    if e.actual is not None and e.actual != tx.state.workers[e.worker_id].actual:
        tx.emit(f.WorkerReported(at=e.at, worker_id=e.worker_id, actual=e.actual))
    reason = f"{fl.op.kind.value} failed on {e.worker_id}: {e.detail or 'no detail'}"
    tx.emit(f.OpFailed(at=e.at, op_id=e.op_id, worker_id=e.worker_id, reason=reason))
    _op_failed(core, tx, reason, e.at)


# -- resize execution ----------------------------------------------------------------


def _reject(tx: _Tx, at: float, source: str, target: Split | None, guard: str, reason: str) -> None:
    tx.emit(f.ProposalRejected(at=at, source=source, target=target, guard=guard, reason=reason,
                               step=tx.state.last_step))


def _decide(core: Core, tx: _Tx, view: ObservedView, proposal: Proposal, source: str, *,
            hysteresis: bool, at: float) -> None:
    rejection = guards.evaluate(view, proposal, core.config.guards, tx.state.history, hysteresis=hysteresis)
    if rejection is not None:
        _reject(tx, at, source, proposal.target, rejection.guard, rejection.reason)
        return
    plan_or_reason = plan_resize(tx.state, proposal.target)
    if isinstance(plan_or_reason, str):
        _reject(tx, at, source, proposal.target, "capacity", plan_or_reason)
        return
    _start_resize(core, tx, view, plan_or_reason, proposal, source, at)


def _start_resize(core: Core, tx: _Tx, view: ObservedView, plan: ResizePlan, proposal: Proposal, source: str,
                  at: float) -> None:
    """Record a resize that passed its guards, with what its outcome will be measured against."""
    if tx.state.outcome is not None:
        _judge(core, tx, at)  # the next resize starts before the window ended: judge what was seen
    predicted = proposal.predicted_step_s_after > 0  # an operator's resize predicts nothing
    measured = [(p, t.response_tokens) for t in view.recent if (p := step_period_s(t)) is not None]
    periods = [p for p, _ in measured]
    per_token = None
    if measured and all(tokens > 0 for _, tokens in measured):
        per_token = sum(periods) / sum(tokens for _, tokens in measured)
    tx.emit(f.ResizeStarted(
        at=at, plan=plan, source=source, reason=proposal.reason,
        op_deadline=at + core.config.op_timeout_s,
        predicted_step_s=proposal.predicted_step_s if predicted else None,
        predicted_step_s_after=proposal.predicted_step_s_after if predicted else None,
        measured_step_s=sum(periods) / len(periods) if periods else None,
        predicted_cost_s=view.costs.for_move(view.split, proposal.target),
        payback_steps=max(guards.payback_horizon(view, core.config.guards), 1),
        measured_s_per_token=per_token))
    _advance(core, tx, at, fresh=True)


# -- owning the outcome: a resize measured against what its decision expected ----------


def _check_outcome(core: Core, tx: _Tx, at: float) -> None:
    """After a step: check the prediction once `verify_steps` steps ran on the new split, and
    judge the resize once its payback window (or the job) is over."""
    o = tx.state.outcome
    if o is None or not o.committed:
        return
    n = len(o.after)
    verify = max(core.config.guards.verify_steps, 1)
    if not o.checked and n >= verify and o.predicted_step_s_after is not None:
        measured = sum(o.after[:verify]) / verify
        tx.emit(f.PredictionChecked(
            at=at, resize_id=o.resize_id, steps=verify, predicted_step_s_after=o.predicted_step_s_after,
            measured_step_s_after=measured, error_s=measured - o.predicted_step_s_after,
            predicted_step_s=o.predicted_step_s, measured_step_s=o.measured_step_s))
    total = core.config.steps_total
    if n >= o.payback_steps or (total is not None and tx.state.last_step >= total - 1):
        _judge(core, tx, at)  # the window is over, or the job is: nothing more will be measured


def _judge(core: Core, tx: _Tx, at: float) -> None:
    """The verdict on the resize being measured, and what the payback guard learns from it."""
    o = tx.state.outcome
    assert o is not None
    cfg, factor = core.config.guards, tx.state.history.payback_factor
    n = len(o.after)
    if not o.committed or n == 0 or o.measured_step_s is None:
        verdict, saved = f.Verdict.UNKNOWN, None
    else:
        # What the old split would have taken for the same steps: scaled by their response
        # tokens when every step reported them (responses grow during RL; a longer step is not
        # the resize's fault), else its mean step period.
        if o.measured_s_per_token is not None and all(t > 0 for t in o.after_tokens):
            expected = o.measured_s_per_token * sum(o.after_tokens)
        else:
            expected = n * o.measured_step_s
        saved = expected - sum(o.after)
        if saved < 0:
            verdict = f.Verdict.WORSE
        elif saved < (o.cost_s or 0.0):
            verdict = f.Verdict.NOT_PAID_BACK
        else:
            verdict = f.Verdict.PAID_BACK
    # A resize that hurt raises the bar; one cut short by the next resize is not held against
    # its policy unless it already measured slower per step.
    if verdict is f.Verdict.WORSE or (verdict is f.Verdict.NOT_PAID_BACK and n >= o.payback_steps):
        factor = min(factor * cfg.payback_backoff, max(cfg.payback_backoff_max, 1.0))
    elif verdict is f.Verdict.PAID_BACK:
        factor = max(factor / cfg.payback_backoff, 1.0) if cfg.payback_backoff > 0 else 1.0
    tx.emit(f.ResizeJudged(at=at, resize_id=o.resize_id, verdict=verdict, steps=n, payback_steps=o.payback_steps,
                           saved_s=saved, cost_s=o.cost_s, payback_factor=factor))


def plan_resize(state: ClusterState, target: Split) -> ResizePlan | str:
    """The ordered operations that take `state` to `target`, or why that is impossible now."""
    before = state.split
    delta = target.train - before.train
    from_pool, to_pool = (Pool.ROLLOUT, Pool.TRAINING) if delta > 0 else (Pool.TRAINING, Pool.ROLLOUT)
    count = abs(delta)
    src_kind, dst_kind = WorkerKind.for_pool(from_pool), WorkerKind.for_pool(to_pool)
    # Highest device ids first: deterministic, and keeps low ids (often the launch ranks) stable.
    # A device lent to `from_pool` is not its own (its home is the other pool, where the split
    # counts it): it goes home at the step boundary and is left out, as held-back ones are.
    held_back = state.held_back()
    lent = set(state.lent_devices())
    live = state.live_workers_by_device()
    usable = {d for d in state.pool_devices(from_pool)
              if (d, dst_kind) in live and d not in held_back and d not in lent}
    eligible, skipped = _whole_engines(state, usable, count)
    if len(eligible) < count:
        notes = [f"{len(held_back)} left out: a worker on them has not converged"] if held_back else []
        if wide := [d for d in skipped if d in state.engines]:
            notes.append(f"{len(wide)} serve in engines of several devices, which move whole: regroup them "
                         "first or move a multiple of their size")
        if lent_here := [d for d in lent if state.devices[d].pool is from_pool]:
            notes.append(f"{len(lent_here)} lent until the step boundary")
        note = f" ({'; '.join(notes)})" if notes else ""
        return (f"only {len(eligible)} device(s) in the {from_pool.value} pool have a live "
                f"{dst_kind.value} worker to take them over{note}; {count} needed for {before} -> {target}")
    devices = tuple(sorted(eligible))
    src = _unique(live.get((d, src_kind)) for d in devices)
    dst = _unique(live.get((d, dst_kind)) for d in devices)
    moved = set(devices)
    after_pool = {d: (to_pool if d in moved else p.pool) for d, p in state.devices.items()}
    committers = _unique(
        live.get((d, WorkerKind.for_pool(pool))) for d, pool in sorted(after_pool.items()) if pool is not None
    )
    resize_id = f"r{state.resizes_started + 1}"
    targets = {OpKind.DRAIN: src, OpKind.RELEASE: src, OpKind.JOIN: dst, OpKind.RESTORE: dst,
               OpKind.COMMIT: committers}
    ops = tuple(
        OpSpec(op_id=f"{resize_id}/{i}-{kind.value}", kind=kind, devices=devices, targets=ts,
               from_pool=from_pool, to_pool=to_pool)
        for i, (kind, ts) in enumerate(targets.items())
    )
    return ResizePlan(resize_id=resize_id, devices=devices, from_pool=from_pool, to_pool=to_pool, ops=ops,
                      before=before, after=target)


def _whole_engines(state: ClusterState, usable: set[DeviceId], count: int) -> tuple[list[DeviceId], list[DeviceId]]:
    """`count` of `usable` devices to move, highest ids first, an engine of several devices
    whole or not at all (fewer when no choice adds up); and the wide engines' devices left out."""
    units: list[tuple[DeviceId, ...]] = []
    seen: set[DeviceId] = set()
    left: list[DeviceId] = []
    for d in sorted(usable, reverse=True):
        if d not in seen:
            unit = state.engine_of(d)
            seen.update(unit)
            if all(x in usable for x in unit):
                units.append(unit)
            else:
                left.extend(unit)  # a wide engine one of whose devices cannot move now
    if all(len(u) == 1 for u in units):  # no wide engine to fit: the highest `count`
        return [u[0] for u in units[:count]], left
    # reach[i]: the device counts units[i:] can add up to (bit n set: n is reachable)
    mask = (1 << (count + 1)) - 1
    reach = [1] * (len(units) + 1)
    for i in range(len(units) - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << len(units[i]))) & mask
    if not (reach[0] >> count) & 1:
        count = max(n for n in range(count + 1) if (reach[0] >> n) & 1)
    taken: list[DeviceId] = []
    for i, unit in enumerate(units):
        rest = count - len(taken) - len(unit)
        if rest >= 0 and (reach[i + 1] >> rest) & 1:
            taken.extend(unit)
        elif len(unit) > 1:
            left.extend(unit)
    return taken, left


def _unique(workers: object) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for w in workers:  # type: ignore[attr-defined]
        if w is not None:
            seen[w.worker_id] = None
    return tuple(seen)


def _targets(fl: InFlight) -> frozenset[str]:
    """The current op's targets as a set (an answer scanned the tuple: quadratic in the targets)."""
    return derived("targets", lambda: frozenset(fl.op.targets), fl.op.targets)


def acked_set(fl: InFlight) -> set[str]:
    """`fl.acked` as a set, for membership: the answers of an op to T targets arrive one at a
    time, each making a tuple one longer, so the set is extended (`state.grown`) instead of
    built again per answer. Read it, never change it."""
    return grown("acked", fl.acked, set, _added)


def _added(members: set[str], more: tuple[str, ...]) -> set[str]:
    members.update(more)
    return members


def _pending(state: ClusterState) -> list[str]:
    fl = state.inflight
    assert fl is not None
    acked = acked_set(fl)
    return [w for w in fl.op.targets if w not in acked and state.is_live(w)]


def _owed(state: ClusterState) -> bool:
    """Whether any live target of the current op has not answered: what `_advance` asks after
    every answer. It stops at the first one found, looking from the last target (answers come
    mostly in the order ops were sent), so the answers of an op to T targets cost about T
    liveness checks in all, where listing the pending ones after each cost T^2 / 2."""
    fl = state.inflight
    assert fl is not None
    acked = acked_set(fl)
    return any(w not in acked and state.is_live(w) for w in reversed(fl.op.targets))


def _current_op_id(state: ClusterState) -> str | None:
    fl = state.inflight
    if fl is None or fl.index >= len(fl.ops):
        return None
    return fl.op.op_id


def _advance(core: Core, tx: _Tx, at: float, *, fresh: bool = False) -> None:
    """Complete every operation with nobody left to answer; end the resize after the last.
    Whenever a new operation begins (or `fresh`: the current one just began), send it."""
    entry = _current_op_id(tx.state)
    while tx.state.inflight is not None:
        fl = tx.state.inflight
        if fl.index < len(fl.ops):
            if _owed(tx.state):
                break
            last = fl.index + 1 >= len(fl.ops)
            tx.emit(f.OpCompleted(at=at, op_id=fl.op.op_id, duration_s=at - fl.op_started_at,
                                  next_deadline=None if last else at + core.config.op_timeout_s))
            continue
        if fl.reconciling:
            _finish_reconcile(tx, fl.plan.resize_id, fl.reconciling, at)
            return
        step = tx.state.last_step
        if fl.rolling_back:
            tx.emit(f.ResizeRolledBack(at=at, resize_id=fl.plan.resize_id, reason=fl.abort_reason, step=step))
        elif fl.plan.kind is PlanKind.REGROUP:
            tx.emit(f.RegroupCommitted(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at, step=step))
        elif fl.plan.kind is not PlanKind.RESIZE:
            _end_loan(core, tx, at)
        else:
            tx.emit(f.ResizeCommitted(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at, step=step))
        _tail_back(core, tx, at)
        if fl.source == "tail" and fl.plan.kind is PlanKind.REGROUP:
            _after_tail_back(core, tx, at)
        return
    current = _current_op_id(tx.state)
    if current is not None and (fresh or current != entry):
        _send(tx, None)


def _pools_after(s: ClusterState, plan: ResizePlan, landing: Pool | None) -> tuple[tuple[DeviceId, ...],
                                                                                   tuple[DeviceId, ...]]:
    """The training and rollout devices an op's workers are told of: the moving devices where
    they land. Remembered per op (`derived`): a hello of each of a resize's targets re-sends it,
    and a pass over every device per hello made a registration storm quadratic."""
    moving = set(plan.devices) if landing is Pool.TRAINING else set()
    training = tuple(sorted(d for d, p in s.devices.items() if p.pool is Pool.TRAINING or d in moving))
    in_training = set(training)  # membership in the tuple made this quadratic in the cluster
    return training, tuple(sorted(d for d in s.devices if d not in in_training))


def _send(tx: _Tx, only: list[str] | None) -> None:
    s = tx.state
    fl = s.inflight
    if fl is None or fl.index >= len(fl.ops):
        return
    plan = fl.plan
    # Where the moving devices land: their destination, or back home once rolling back; a
    # reconcile moves nothing.
    landing = None if fl.reconciling else plan.from_pool if fl.rolling_back else plan.to_pool
    training, rollout = derived(("send_pools", landing is Pool.TRAINING), lambda: _pools_after(s, plan, landing),
                                s.devices, plan.devices)
    # A regroup's engines once it is done going forward; the engines the log holds otherwise.
    new_engines = ({d: g for g in plan.engines for d in g}
                   if plan.kind is PlanKind.REGROUP and not fl.rolling_back and not fl.reconciling else {})
    for w in only if only is not None else _pending(s):
        worker = s.workers.get(w)
        engine: tuple[DeviceId, ...] = ()
        if worker is not None and worker.kind is WorkerKind.ROLLOUT_ENGINE and len(worker.devices) == 1:
            d = worker.devices[0]
            group = new_engines.get(d) or s.engine_of(d)
            engine = group if len(group) > 1 else ()
        tx.commands.append(SendOp(worker_id=w, resize_id=plan.resize_id, op=fl.op, deadline=fl.op_deadline,
                                  training=training, rollout=rollout,
                                  plan=PlanKind.RECONCILE if fl.reconciling else plan.kind, engine=engine))


def _op_failed(core: Core, tx: _Tx, reason: str, at: float) -> None:
    fl = tx.state.inflight
    assert fl is not None
    plan = fl.plan
    if fl.reconciling:
        tx.emit(f.ReconcileFinished(at=at, resize_id=plan.resize_id, worker_id=fl.reconciling, ok=False,
                                    reason=reason))
        tx.emit(f.WorkerUnconverged(at=at, worker_id=fl.reconciling, reason=reason))
        return
    if fl.rolling_back:
        tx.emit(f.Degraded(at=at, resize_id=plan.resize_id, reason=f"rollback failed: {reason}",
                           placed_in=plan.from_pool, step=tx.state.last_step))
    elif fl.op.kind is OpKind.COMMIT:
        tx.emit(f.Degraded(at=at, resize_id=plan.resize_id, reason=f"commit failed: {reason}",
                           placed_in=plan.to_pool, step=tx.state.last_step))
    else:
        _abort(core, tx, reason, at)


def _abort(core: Core, tx: _Tx, reason: str, at: float) -> None:
    fl = tx.state.inflight
    assert fl is not None and not fl.rolling_back
    rid = fl.plan.resize_id
    touched = fl.ops[: fl.index + 1]
    undo = tuple(
        OpSpec(op_id=f"{rid}/undo{i}-{UNDO[op.kind].value}", kind=UNDO[op.kind], devices=op.devices,
               targets=tuple(w for w in op.targets if tx.state.is_live(w)),
               from_pool=op.from_pool, to_pool=op.to_pool)
        for i, op in enumerate(op for op in reversed(touched) if op.kind in UNDO)
    )
    tx.emit(f.ResizeAborted(at=at, resize_id=rid, reason=reason, undo=undo,
                            op_deadline=at + core.config.op_timeout_s if undo else None))
    _advance(core, tx, at, fresh=True)


def _after_worker_gone(core: Core, tx: _Tx, worker_id: str, how: str, at: float) -> None:
    fl = tx.state.inflight
    if fl is None:
        return
    if fl.reconciling == worker_id:  # it is reconciled again when it comes back and says hello
        tx.emit(f.ReconcileFinished(at=at, resize_id=fl.plan.resize_id, worker_id=worker_id, ok=False,
                                    reason=f"worker {worker_id} {how}"))
        return
    # Only the moving devices' workers carry a resize; one that has nothing left to do but
    # acknowledge the commit is simply not waited for (`_pending` skips workers no longer live).
    involved = any(worker_id in op.targets for op in fl.ops[fl.index:] if op.kind is not OpKind.COMMIT)
    if not involved:
        _advance(core, tx, at)
        return
    if fl.rolling_back or fl.op.kind is OpKind.COMMIT:
        # Nothing to undo or commit on a dead process; the rest goes on without it.
        _advance(core, tx, at)
        return
    reason = f"worker {worker_id} {how} during {fl.op.kind.value}"
    tx.emit(f.OpFailed(at=at, op_id=fl.op.op_id, worker_id=worker_id, reason=reason))
    _abort(core, tx, reason, at)


# -- reconciliation -------------------------------------------------------------------

_CONVERGE: dict[tuple[Holding, Holding], tuple[OpKind, ...]] = {
    # (what the log says, what the worker says) -> the ops that take it there, in order. They
    # are the ops a resize and its undo use, from the worker's home pool: every backend knows
    # them, and each is idempotent on a worker already where the op leads.
    (Holding.SERVING, Holding.RELEASED): (OpKind.RECLAIM, OpKind.RESUME),
    (Holding.SERVING, Holding.DRAINED): (OpKind.RESUME,),
    (Holding.RELEASED, Holding.SERVING): (OpKind.DRAIN, OpKind.RELEASE),
    (Holding.RELEASED, Holding.DRAINED): (OpKind.RELEASE,),
    # serving, but as another engine than the log's (it restarted alone, its engine regrouped)
    (Holding.SERVING, Holding.SERVING): (OpKind.DRAIN, OpKind.RELEASE, OpKind.RECLAIM, OpKind.RESUME),
}

_RECHECK = frozenset({f.WorkerRegistered, f.WorkerReported, f.ResizeCommitted, f.ResizeRolledBack,
                      f.ReconcileFinished, f.ResizingResumed, f.RegroupCommitted})
"""Facts after which a live worker may disagree with the log: the core looks for one then (and
at every tick, which is when a worker that could not converge is tried again)."""


def divergence(state: ClusterState, worker: Worker, now: float, retry_s: float) -> tuple[Holding, Holding] | None:
    """(desired, actual) when `worker` reports a state the log disagrees with and ops can
    converge it now; None when it agrees, does not say, or nothing is to be converged now."""
    if worker.status is not WorkerStatus.LIVE or worker.actual is None:
        return None
    stuck = state.unconverged.get(worker.worker_id)
    if stuck is not None and (now - stuck.at < retry_s or worker.actual.holding is Holding.FAILED):
        return None  # tried lately, or it cannot act at all: wait for it to report something else
    want, have = state.desired(worker), worker.actual.holding
    if want is None or have is Holding.DONE or _left_with_its_loan(state, worker):
        return None
    if _agrees(state, worker, want, have):
        return None
    return want, have


def _agrees(state: ClusterState, worker: Worker, want: Holding, have: Holding) -> bool:
    """The worker holds what the log says, and (serving) runs the engine the log says."""
    return have is want and (want is not Holding.SERVING or not wrong_engine(state, worker))


def wrong_engine(state: ClusterState, worker: Worker) -> bool:
    """An engine worker that says which engine it runs (`ActualState.engine`), and it is not
    the one the log says its device serves in."""
    if worker.kind is not WorkerKind.ROLLOUT_ENGINE or worker.actual is None or len(worker.devices) != 1:
        return False
    says = worker.actual.engine or worker.devices
    return tuple(says) != state.engine_of(worker.devices[0])


def _left_with_its_loan(state: ClusterState, worker: Worker) -> bool:
    """A trainer on a device lent to the training step leaves the group by itself once the
    step's last mini-batch is done; the loan's return at the step report releases the device.
    Converging it back into the group before then would undo the step's end."""
    mb = state.mini_batch
    return (worker.kind is WorkerKind.TRAINER_RANK and worker.actual is not None
            and worker.actual.holding in (Holding.DRAINED, Holding.RELEASED)
            and all(d in state.devices and state.devices[d].home is Pool.ROLLOUT for d in worker.devices)
            and mb is not None and mb.total > 0 and mb.done >= mb.total)


def _reconcile_next(core: Core, tx: _Tx, at: float) -> None:
    """Level-triggered: start converging the first live worker whose actual state differs from
    what the log says (one at a time, serialized with resizes)."""
    retry_s = core.config.reconcile_retry_s
    # This runs at every tick: only the workers that diverge (rarely any) are sorted. A fact the
    # loop emits (WorkerUnconverged) changes its own worker's divergence only, so these are the
    # workers a walk over all of them in id order would stop at.
    diverging = sorted((w for w in tx.state.workers.values()
                        if w.actual is not None and divergence(tx.state, w, at, retry_s) is not None),
                       key=lambda w: w.worker_id)
    for w in diverging:
        gap = divergence(tx.state, w, at, retry_s)
        if gap is None:
            continue
        want, have = gap
        if have is Holding.FAILED:
            detail = w.actual.detail if w.actual is not None else ""
            tx.emit(f.WorkerUnconverged(at=at, worker_id=w.worker_id,
                                        reason=f"it reports failed{': ' + detail if detail else ''}"))
            continue
        s = tx.state
        rid = f"c{s.reconciles_started + 1}"
        home = w.kind.pool
        ops = tuple(OpSpec(op_id=f"{rid}/{i}-{kind.value}", kind=kind, devices=w.devices, targets=(w.worker_id,),
                           from_pool=home, to_pool=home.other)
                    for i, kind in enumerate(_CONVERGE[(want, have)]))
        plan = ResizePlan(resize_id=rid, devices=w.devices, from_pool=home, to_pool=home.other, ops=ops,
                          before=s.split, after=s.split)
        tx.emit(f.ReconcileStarted(at=at, plan=plan, worker_id=w.worker_id, desired=want, actual=have,
                                   op_deadline=at + core.config.op_timeout_s))
        _send(tx, None)
        return


def _finish_reconcile(tx: _Tx, resize_id: str, worker_id: str, at: float) -> None:
    """Every converging op was acknowledged: the worker agrees with the log now, unless what it
    reported with its answers still says otherwise (then no op can help: it is left out)."""
    w = tx.state.workers[worker_id]
    want = tx.state.desired(w)
    have = w.actual.holding if w.actual is not None else None
    if have is None or want is None or _agrees(tx.state, w, want, have):
        tx.emit(f.ReconcileFinished(at=at, resize_id=resize_id, worker_id=worker_id, ok=True))
        return
    reason = f"its converging ops succeeded, but it still reports {have.value} (the log says {want.value})"
    if have is want:
        reason = (f"its converging ops succeeded, but it still runs the engine [{', '.join(w.actual.engine or w.devices)}] "
                  f"(the log says [{', '.join(tx.state.engine_of(w.devices[0]))}])")
    tx.emit(f.ReconcileFinished(at=at, resize_id=resize_id, worker_id=worker_id, ok=False, reason=reason))
    tx.emit(f.WorkerUnconverged(at=at, worker_id=worker_id, reason=reason))
# -- loans ---------------------------------------------------------------------------


def on_engine_queue_empty(core: Core, tx: _Tx, e: ev.EngineQueueEmpty) -> None:
    w = _require_worker(tx.state, e.worker_id)
    if w.kind is not WorkerKind.ROLLOUT_ENGINE:
        raise Refused("bad_request", f"worker {e.worker_id!r} is a {w.kind.value}; only engines report their queue")
    if e.step < 0 or e.running < 0 or e.tokens_left < 0:
        raise Refused("bad_value", f"step={e.step} running={e.running} tokens_left={e.tokens_left} is impossible")
    if e.step <= tx.state.last_step:
        # Late: that step's report already arrived (it cleared the idle engines); recorded, the
        # engine would look lendable while it serves the next step.
        return
    fl = tx.state.inflight
    if fl is not None and not set(w.devices).isdisjoint(fl.plan.devices):
        # Sent before the engine heard of the resize, regroup or loan now moving its devices
        # (it drains first): what it ran dry in is over for it. Recorded, a regrouped engine
        # would look dry before it served a step.
        return
    tx.emit(f.EngineQueueEmptyObserved(at=e.at, worker_id=e.worker_id, device=w.devices[0], step=e.step,
                                       running=e.running, tokens_left=e.tokens_left))
    _consider_tail(core, tx, e.at)
    _consider_loan(core, tx, e.at)


def on_mini_batch_done(core: Core, tx: _Tx, e: ev.MiniBatchDone) -> None:
    w = _require_worker(tx.state, e.worker_id)
    if w.kind is not WorkerKind.TRAINER_RANK:
        raise Refused("bad_request", f"worker {e.worker_id!r} is a {w.kind.value}; only trainers report mini-batches")
    if e.step < 0 or not (0 <= e.done <= e.total):
        raise Refused("bad_value", f"mini-batch {e.done} of {e.total} in step {e.step} is impossible")
    tx.emit(f.MiniBatchObserved(at=e.at, worker_id=e.worker_id, step=e.step, done=e.done, total=e.total))
    s = tx.state
    lent_out = [d for d in s.lent_devices() if s.devices[d].pool is Pool.ROLLOUT]
    if e.done < e.total and lent_out and s.phase is Phase.STEADY and s.inflight is None and not _tail_open(s):
        # The training step begins while its trainers serve the rollout (lent in the window
        # with nothing to train, which ends without a step report): they go home first.
        _return_loans(core, tx, e.at, None, "", why=f"training step {e.step} begins")
        return
    _consider_loan(core, tx, e.at)


def loan_view(core: Core, state: ClusterState, now: float) -> LoanView:
    """What the lending policy sees: idle engines of the rollout step in progress, trainers
    whose part of the step is done (after its last mini-batch, or with nothing to train yet),
    and the trainer's measured mini-batch pace."""
    mb = state.mini_batch
    done = mb is not None and mb.done >= mb.total
    # One-step off-policy: while the trainer trains step s the rollout generates s + 1; with
    # nothing to train (0 of 0) it waits for the rollout of step s itself.
    if mb is None:
        rollout_step = state.last_step + 2
    else:
        rollout_step = mb.step if mb.total == 0 else mb.step + 1
    idle, trainers = state.lendable()
    # no rollout step left to serve (the run's last training step): no trainer is free to lend
    last = core.config.steps_total is not None and rollout_step >= core.config.steps_total
    free = trainers if done and not last else ()
    samples_done, samples_total = state.samples(rollout_step)
    view = LoanView(
        now=now,
        split=state.split,
        idle_engines=idle,
        free_trainers=free,
        training_devices=len(state.pool_devices(Pool.TRAINING)),
        mini_batch_done=mb.done if mb is not None else 0,
        mini_batch_total=mb.total if mb is not None else 0,
        mini_batch_s=mb.last_s if mb is not None else 0.0,
        queue_empty=state.dry_step >= rollout_step,
        costs=_loan_costs(core, state, Pool.TRAINING),
        rollout_costs=_loan_costs(core, state, Pool.ROLLOUT),
        recent=state.recent,
        rollout_step=rollout_step,
        samples_done=samples_done,
        samples_total=samples_total,
    )
    if core.config.tail_costs is None:
        return view  # the daemon: no tail regroups, and no scan of every device for lent ones per report
    return msgspec.structs.replace(
        view,
        tails=tuple(EngineTail(devices=state.engine_of(d), running=n, tokens_left=left, at=t)
                    for d, n, left, t in state.tails if state.dry_step == rollout_step),
        tail_costs=core.config.tail_costs,
        lent_to_rollout=tuple(d for d in state.lent_devices() if state.devices[d].pool is Pool.ROLLOUT),
        tail_open=_tail_open(state),
    )


def _loan_costs(core: Core, state: ClusterState, to_pool: Pool) -> LoanCosts:
    """Configured, or learned from the last loans to `to_pool` (`CoreConfig.learn_loan_costs`)."""
    if not core.config.learn_loan_costs:
        return core.config.loan_costs
    return core.config.loan_costs.learned(state.loan_times, to_pool)


def _free_to_plan(s: ClusterState) -> bool:
    """Steady, nothing in flight, neither paused nor stopping: a loan or a tail regroup may start."""
    return s.phase is Phase.STEADY and s.inflight is None and not s.paused and not s.stopping


def _consider_loan(core: Core, tx: _Tx, at: float) -> None:
    """Ask the lending policy whether to lend idle devices to the other stage for the rest of the
    step (`propose_loan`), and start the loan when its guard lets it."""
    proposal = _proposed(core, tx, at, getattr(core.policy, "propose_loan", None), guards.check_loan)
    if proposal is None:
        return
    plan = plan_loan(tx.state, proposal.devices, Pool(proposal.to_pool), PlanKind.LOAN)
    if isinstance(plan, str):
        _reject(tx, at, core.policy.name, None, "capacity", plan)
        return
    tx.emit(f.LoanStarted(at=at, plan=plan, source=core.policy.name, reason=proposal.reason,
                          op_deadline=at + core.config.op_timeout_s, saves_s=proposal.saves_s,
                          cost_s=proposal.cost_s))
    _advance(core, tx, at, fresh=True)


def _consider_tail(core: Core, tx: _Tx, at: float) -> None:
    """An engine reported its queue empty: ask the policy whether to regroup a busy engine and
    idle ones into one wider engine for the rest of the step (`propose_tail`), and start that
    regroup when the guard lets it (its saving over its cost, as a loan's)."""
    if core.config.tail_costs is None or _tail_open(tx.state):
        return
    proposal = _proposed(core, tx, at, getattr(core.policy, "propose_tail", None), guards.check_tail)
    if proposal is None:
        return
    s = tx.state
    undo = tuple(dict.fromkeys(s.engine_of(d) for d in proposal.devices))
    plan = plan_regroup(s, proposal.devices, len(proposal.devices), lent_ok=True)
    if isinstance(plan, str):
        _reject(tx, at, core.policy.name, None, "regroup", plan)
        return
    tx.emit(f.RegroupStarted(at=at, plan=plan, source=core.policy.name, reason=proposal.reason,
                             op_deadline=at + core.config.op_timeout_s, undo=undo))
    _advance(core, tx, at, fresh=True)


def _proposed(core: Core, tx: _Tx, at: float, propose: Callable[[LoanView], _P | None] | None,
              check: Callable[[LoanView, _P, guards.GuardConfig], guards.Rejection | None]) -> _P | None:
    """What the lending policy's `propose` (its `propose_loan` or `propose_tail`; None: it has
    none) proposes on what it sees now, where a loan or tail regroup may start and the proposal
    passes its guard `check`; None otherwise (a proposal the guard refuses is recorded so)."""
    if propose is None or not _free_to_plan(tx.state):
        return None
    view = loan_view(core, tx.state, at)
    proposal = propose(view)
    if proposal is None:
        return None
    rejection = check(view, proposal, core.config.guards)
    if rejection is not None:
        _reject(tx, at, core.policy.name, None, rejection.guard, rejection.reason)
        return None
    return proposal


def _after_tail_back(core: Core, tx: _Tx, at: float) -> None:
    """The step boundary's work, put off while the tail's engine was undone (`_boundary`)."""
    if tx.state.inflight is None:
        _boundary(core, tx, at, tx.state.last_step, why="the tail's engine is undone")


def _tail_open(s: ClusterState) -> bool:
    """A tail regroup's engine has not become the engines it was made of again."""
    return bool(s.tail_undo) and not all(s.engine_of(g[0]) == g for g in s.tail_undo)


def _tail_back(core: Core, tx: _Tx, at: float) -> None:
    """After the step boundary, the engine a tail regroup made becomes the engines it was made of
    again (a regroup of source "tail"), once nothing else is in flight."""
    s = tx.state
    if not s.tail_due or s.inflight is not None or s.phase is not Phase.STEADY or s.stopping:
        return
    if not _tail_open(s):
        return  # already those engines (the tail regroup was rolled back)
    undo = s.tail_undo
    devices = tuple(d for group in undo for d in group)
    plan = plan_regroup(s, devices, len(undo[0]), lent_ok=True, engines=undo)
    if isinstance(plan, str):
        _reject(tx, at, "tail", None, "regroup", f"the tail's engine cannot be regrouped back yet: {plan}")
        return
    sizes = " + ".join(str(len(g)) for g in undo)
    tx.emit(f.RegroupStarted(at=at, plan=plan, source="tail", op_deadline=at + core.config.op_timeout_s,
                             reason=f"the step is over: back to engines of {sizes} device(s)"))
    _advance(core, tx, at, fresh=True)


def plan_loan(state: ClusterState, devices: tuple[DeviceId, ...], to_pool: Pool, kind: PlanKind) -> ResizePlan | str:
    """Drain, release and join `devices` into `to_pool`: a loan, or (kind RETURN) its way home.
    No commit: a loan lasts until the step boundary, where its return is the next sequence."""
    from_pool = to_pool.other
    devices = tuple(sorted(devices))
    live = state.live_workers_by_device()
    src = _unique(live.get((d, WorkerKind.for_pool(from_pool))) for d in devices)
    dst = _unique(live.get((d, WorkerKind.for_pool(to_pool))) for d in devices)
    # One worker may serve several of the devices (verl's rollout worker holds every hybrid slot).
    if kind is PlanKind.LOAN and any((d, WorkerKind.for_pool(to_pool)) not in live for d in devices):
        return f"not every device of {', '.join(devices)} has a live {WorkerKind.for_pool(to_pool).value} worker"
    named = set(devices)
    if kind is PlanKind.LOAN and (part := [d for d in devices if not named.issuperset(state.engine_of(d))]):
        return (f"device(s) {', '.join(part)} serve in engines of several devices whose other devices are not "
                "lent with them: a loan takes whole engines")
    resize_id = f"l{state.loans_started + 1}" if kind is PlanKind.LOAN else f"l{state.loans_started}-home{state.version}"
    targets = {OpKind.DRAIN: src, OpKind.RELEASE: src, OpKind.JOIN: dst}
    ops = tuple(
        OpSpec(op_id=f"{resize_id}/{i}-{k.value}", kind=k, devices=devices, targets=ts,
               from_pool=from_pool, to_pool=to_pool)
        for i, (k, ts) in enumerate(targets.items())
    )
    split = state.split
    return ResizePlan(resize_id=resize_id, devices=devices, from_pool=from_pool, to_pool=to_pool, ops=ops,
                      before=split, after=split, kind=kind)


def _return_loans(core: Core, tx: _Tx, at: float, proposal: Proposal | None, source: str, why: str = "") -> None:
    """Step boundary: every lent device goes home. A resize the policy proposes at the same
    boundary is checked by the guards now and starts once the devices are home."""
    s = tx.state
    then: Split | None = None
    if proposal is not None:
        view = core.view(s, at)
        rejection = guards.evaluate(view, proposal, core.config.guards, s.history, hysteresis=core.policy.guarded)
        if rejection is not None:
            _reject(tx, at, source, proposal.target, rejection.guard, rejection.reason)
        else:
            then = proposal.target
    lent = s.lent_devices()
    # One sequence per direction; the rare boundary with loans both ways returns rollout first.
    by_pool = {p: tuple(d for d in lent if s.devices[d].pool is p) for p in (Pool.TRAINING, Pool.ROLLOUT)}
    pool = Pool.TRAINING if by_pool[Pool.TRAINING] else Pool.ROLLOUT
    plan = plan_loan(s, by_pool[pool], pool.other, PlanKind.RETURN)
    assert not isinstance(plan, str)
    reason = f"{why or f'step {s.last_step} done'}: {len(plan.devices)} lent device(s) go home to {pool.other.value}"
    tx.emit(f.LoanReturnStarted(at=at, plan=plan, reason=reason, op_deadline=at + core.config.op_timeout_s,
                                then=then, then_source=source if then is not None else "",
                                then_reason=proposal.reason if then is not None and proposal else "",
                                then_predicted_step_s=proposal.predicted_step_s if then is not None and proposal else 0.0,
                                then_predicted_step_s_after=(proposal.predicted_step_s_after
                                                             if then is not None and proposal else 0.0)))
    _advance(core, tx, at, fresh=True)


def _end_loan(core: Core, tx: _Tx, at: float) -> None:
    fl = tx.state.inflight
    assert fl is not None
    if fl.plan.kind is PlanKind.LOAN:
        tx.emit(f.LoanLanded(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at))
        s = tx.state
        if s.last_step > fl.step and not s.paused and not s.stopping:
            # A step was reported while the loan ran (a trainer lent to the rollout's last
            # requests): that boundary's work, the policy's say and the way home, is done now.
            _return_loans(core, tx, at, core.policy(core.view(s, at)), core.policy.name)
        elif fl.plan.to_pool is Pool.ROLLOUT:
            _consider_tail(core, tx, at)  # trainers lent for the tail join its engine
        return
    tx.emit(f.LoanReturned(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at))
    s = tx.state
    if s.lent_devices():  # loans the other way round go home next
        _return_loans(core, tx, at, None, "")
        return
    if fl.then is None or s.paused or s.stopping or s.split == fl.then:
        return
    plan = plan_resize(s, fl.then)
    if isinstance(plan, str):
        _reject(tx, at, fl.then_source, fl.then, "capacity", plan)
        return
    proposal = Proposal(target=fl.then, reason=fl.then_reason, predicted_step_s=fl.then_predicted_step_s,
                        predicted_step_s_after=fl.then_predicted_step_s_after)
    _start_resize(core, tx, core.view(s, at), plan, proposal, fl.then_source, at)


_HEARD_FROM: frozenset[type] = frozenset({
    ev.ProgressReported, ev.EngineQueueEmpty, ev.MiniBatchDone, ev.StepReported, ev.OpReported, ev.StateReported,
})
"""A worker's accepted messages that prove it alive as a heartbeat does (a worker that reports
needs no heartbeat beside: docs/protocol.md, "Stay registered")."""

_ALWAYS: dict[type, Handler] = {
    ev.Tick: on_tick,
    ev.DaemonStarted: on_daemon_started,
    ev.WorkerHello: on_hello,
    ev.Heartbeat: on_heartbeat,
    ev.WorkerBye: on_bye,
    ev.StateReported: on_state_reported,
    ev.ProgressReported: on_progress,
    ev.PauseRequested: on_pause,
    ev.ResumeRequested: on_resume,
    ev.ShutdownRequested: on_shutdown,
    ev.AbortRequested: on_abort_requested,
    ev.EngineQueueEmpty: on_engine_queue_empty,
    ev.MiniBatchDone: on_mini_batch_done,
    ev.ConfigReloaded: on_config_reloaded,
    ev.ReloadRefused: on_reload_refused,
}  # type: ignore[dict-item]

_RESIZING: dict[type, Handler] = {
    **_ALWAYS,
    ev.StepReported: on_step_observe,
    ev.OpReported: on_op_reported,
    ev.ResizeRequested: on_resize_requested_busy,
    ev.RegroupRequested: on_resize_requested_busy,
}  # type: ignore[dict-item]

TRANSITIONS: dict[Phase, dict[type, Handler]] = {
    Phase.STEADY: {
        **_ALWAYS,
        ev.Configure: on_configure,
        ev.StepReported: on_step_steady,
        ev.ResizeRequested: on_resize_requested_steady,
        ev.RegroupRequested: on_regroup_requested_steady,
    },  # type: ignore[dict-item]
    Phase.DRAINING: _RESIZING,
    Phase.RELEASING: _RESIZING,
    Phase.JOINING: _RESIZING,
    Phase.RESTORING: _RESIZING,
    Phase.COMMITTING: _RESIZING,
    Phase.ROLLING_BACK: _RESIZING,
    Phase.RECONCILING: _RESIZING,
    Phase.DEGRADED: {
        **_ALWAYS,
        ev.StepReported: on_step_observe,
        ev.ResizeRequested: on_resize_requested_busy,
        ev.RegroupRequested: on_resize_requested_busy,
    },  # type: ignore[dict-item]
}
"""Phase x event type -> handler. Anything missing is an IllegalTransition."""
