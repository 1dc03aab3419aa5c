"""The three pipeline modes in virtual time: colocated, static disaggregated, dynamic.

Disaggregated modes are one-step off-policy: window w runs the rollout of step w on the
rollout pool and the training of step w-1 on the training pool, side by side, then weights
sync; a window lasts `max(rollout, training) + sync`. (Rollout w needs the weights of step
w-2 and training w needs rollout w, so no schedule can start either earlier.) Colocated runs
every step's rollout on all devices, switches, then trains on all devices.

The dynamic mode drives the daemon's own sans-IO core (`Core.step`) and policy: it feeds
Configure, WorkerHello, Tick, StepReported and OpReported events stamped with virtual time,
and executes each `SendOp` the core returns by acknowledging it after the operation's
simulated duration. Resize costs are charged the way DESIGN.md §5 says they fall:

* pipelined (default): the moving devices serve neither pool from the boundary where the
  resize starts until the step boundary where it commits; drain, release, join and restore
  run during that window (a commit slips to a later boundary when they do not fit); at
  commit the training pool pays `commit_s` (its data-parallel group changes in either
  direction) and the destination pool pays `first_step_s` on its first step. With the pull
  router, devices moving to the rollout pull the window's queue once their ops and warm-up are
  done (our router admits an engine mid-step), and pay no warm-up after the commit.
* naive: the pipeline stops for the whole resize (teardown, fresh communicators, state
  reload, restart) and resumes on the new split.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import msgspec
import numpy as np

from dynaresized.core import ClusterState, Core, CoreConfig, Phase, SendOp
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import Policy, ResizeCosts
from dynaresized.core.policy import LoanCosts, TailCosts
from dynaresized.domain import FORWARD_ORDER, OpKind, PlanKind, Pool, ResizePlan, Split, StepTiming, WorkerKind
from dynaresized.sim.profile import ProfileError
from dynaresized.sim.stages import EngineSchedule, StageModel, busy_s, contexts

Progress = Callable[[int, int], None]

Layout = Callable[[int, int], "tuple[int, str] | None"]
"""A layout advisor: given the last step generated and the rollout engines' size now, the
engine size to regroup the rollout pool into, and why; None to keep it (`plan.Replanner`)."""

PROGRESS_POINTS = 128
"""Engines report their sample counts this many times per rollout step (at every 1/128 of its
samples), to a policy that reads progress: fine enough for verl's rules (verl polls its queue
once a second), coarse enough to keep a run to seconds."""


class Window(msgspec.Struct, frozen=True, array_like=True):
    """One pipeline window: rollout of step `window` and training of step `window - 1`."""

    window: int
    start_s: float
    end_s: float
    rollout_devices: int
    train_devices: int
    moving: int
    rollout_s: float  # 0 in the last window (nothing left to generate)
    train_s: float  # 0 in the first window (nothing generated yet)
    lent: int = 0  # idle devices lent to the other pool during the window (either way)


def static_windows(model: StageModel, split: Split) -> np.ndarray:
    """Durations of the K+1 windows of a fixed split."""
    k = model.steps
    rollout = model.rollout_table(split.rollout)
    train = model.train_table(split.train)
    sync = model.weight_sync_s
    out = np.empty(k + 1)
    out[0] = rollout[0]
    if k > 1:
        out[1:k] = np.maximum(rollout[1:], train[:-1]) + sync
    out[k] = train[k - 1] + sync
    return out


def static_total(model: StageModel, split: Split) -> float:
    return float(static_windows(model, split).sum())


def splits_of(model: StageModel, gpus: int) -> list[Split]:
    """Every split of `gpus` devices whose rollout pool holds at least one engine."""
    return [Split(train=t, rollout=gpus - t) for t in range(1, gpus) if model.engines(gpus - t) >= 1]


def best_static(model: StageModel, gpus: int) -> tuple[Split, float]:
    """The fixed split with the least total time (hindsight), the smallest training pool among
    equals. Exact without simulating every split: splits are simulated in increasing order of
    `static_floor` (a total no run of the split beats) until the floor exceeds the best total
    found, so on a cluster of hundreds of devices a few dozen are (docs/simulator.md)."""
    splits = splits_of(model, gpus)
    if not splits:
        raise ValueError(f"no split of {gpus} devices leaves room for one rollout engine")
    best: tuple[float, int] | None = None
    for floor, train in sorted((static_floor(model, s), s.train) for s in splits):
        if best is not None and floor > best[0]:
            break
        total = static_total(model, Split(train, gpus - train))
        if best is None or (total, train) < best:
            best = (total, train)
    assert best is not None
    return Split(best[1], gpus - best[1]), best[0]


def oracle_total(model: StageModel, gpus: int) -> float:
    """The per-step oracle: every window on its own best split (hindsight, free resizes), the
    sum over windows of the least window time over splits. Exact without simulating every
    split: a split is simulated only where its window floors (`static_floor_windows`) are
    below the best window times found so far somewhere, lowest total floor first."""
    splits = splits_of(model, gpus)
    floors = [(static_floor_windows(model, s), s) for s in splits]
    floors.sort(key=lambda fs: (float(fs[0].sum()), fs[1].train))
    best = np.full(model.steps + 1, np.inf)
    for floor, split in floors:
        if bool(np.all(floor >= best)):
            continue
        best = np.minimum(best, static_windows(model, split))
    return float(best.sum())


def static_floor_windows(model: StageModel, split: Split) -> np.ndarray:
    """Per window, a time no run of `split` on `model`'s engines beats: `static_windows` with
    each step's rollout at its floor (its work over the devices, and at least its longest
    request decoded alone); training is exact already."""
    k = model.steps
    rollout = _own_floor(model, split.rollout)
    train = model.train_table(split.train)
    sync = model.weight_sync_s
    out = np.empty(k + 1)
    out[0] = rollout[0]
    if k > 1:
        out[1:k] = np.maximum(rollout[1:], train[:-1]) + sync
    out[k] = train[k - 1] + sync
    return out


def static_floor(model: StageModel, split: Split) -> float:
    """A total no run of `split` on `model`'s engines beats: what the static searches prune
    with before simulating a split."""
    return float(static_floor_windows(model, split).sum())


def _own_floor(model: StageModel, devices: int) -> np.ndarray:
    """Per step, the least rollout seconds on `devices` devices of this model's engine size."""
    engines = model.engines(devices)
    if engines < 1:
        return np.full(model.steps, np.inf)
    return np.maximum(model.rollout_work_table() / (engines * model.profile.rollout.gpus_per_engine),
                      model.longest_request_s)


class StaticConfig(msgspec.Struct, frozen=True):
    """A fixed configuration: the split and the devices of each rollout engine."""

    split: Split
    tp: int
    total_s: float


def best_static_config(model: StageModel, gpus: int) -> tuple[StaticConfig, StaticConfig]:
    """The best fixed (split x engine size) with hindsight, and the best split on the profile's
    own engine size (`best_static`). Engine sizes come from `RolloutSpec.engine_sizes`, each
    only where it divides the rollout pool. Every split of the profile's own size is simulated;
    another size's split is simulated only while its `static_floor` is below the best total so
    far (in increasing order of floor), so the search is exact and simulates few of them."""
    split, total = best_static(model, gpus)
    own = StaticConfig(split, model.profile.rollout.gpus_per_engine, total)
    best = own
    pending: list[tuple[float, int, int]] = []
    for m in model.variants(gpus - 1):
        k = m.profile.rollout.gpus_per_engine
        if m is model:
            continue
        for rollout in range(k, gpus, k):
            pending.append((static_floor(m, Split(gpus - rollout, rollout)), k, rollout))
    for floor, k, rollout in sorted(pending):
        if floor >= best.total_s:
            break
        candidate = Split(gpus - rollout, rollout)
        total = static_total(model.at_tp(k), candidate)
        if total < best.total_s:
            best = StaticConfig(candidate, k, total)
    return best, own


def colocated_steps(model: StageModel, gpus: int) -> np.ndarray:
    """Per-step seconds of the colocated (verl default) mode: generate, switch, train."""
    return model.rollout_table(gpus) + model.colocated_switch_s + model.train_table(gpus)


def colocated_total(model: StageModel, gpus: int) -> float:
    return float(colocated_steps(model, gpus).sum())


def device_ids(gpus: int, per_node: int) -> tuple[str, ...]:
    return tuple(f"node{i // per_node}:gpu{i % per_node}" for i in range(gpus))


def engine_id(index: int) -> str:
    return f"engine-{index}"


def trainer_id(index: int) -> str:
    return f"trainer-{index}"


class DynamicRun(msgspec.Struct, frozen=True):
    total_time_s: float
    windows: tuple[Window, ...]
    facts: tuple[f.Fact, ...]
    final_split: Split
    state: ClusterState
    """The core's state at the end; folding `facts` from an empty state gives it back."""
    held: tuple[tuple[int, str], ...]
    """(step, reason) whenever the policy proposed nothing, if it says why (`last_reason`)."""


class _Ack(msgspec.Struct, frozen=True, order=True, array_like=True):
    at: float
    seq: int
    worker_id: str
    op_id: str


class _Tail:
    """One window's rollout request by request, for tail regroups. When an engine runs dry, every
    engine still decoding first says how many requests it runs and how many tokens the longest
    has left (the router knows every engine's requests); when the core then starts a tail
    regroup (`propose_tail`), the busy engine's running requests decode from then on one wider
    engine of its devices and the idle engines', after the switch, and the window's rollout
    ends when the slowest engine does. Before any engine runs dry nothing is reported, as
    without tail regroups, so that a run where none pays is the run without them."""

    def __init__(self, pipe: DynamicPipeline, w: int, start: float, finish: np.ndarray,
                 groups: dict[int, list[str]], late: np.ndarray, idle_at: list[tuple[float, int]]) -> None:
        self.pipe, self.w, self.start, self.finish, self.groups = pipe, w, start, finish, groups
        self.idle_at = idle_at  # the window's engines by when they run dry (shared with it)
        model = pipe.model
        self.penalty = pipe._penalty[Pool.ROLLOUT]
        self.schedule, self.start_s, self.pace, self.queue_empty_s = model.pull_timeline(w, len(groups), late)
        self.lengths = model.trace.steps[w].response_tokens.astype(np.float64)
        self.prompts = model.trace.steps[w].prompt_tokens.astype(np.float64)
        self.wide: set[int] = set()  # engines a tail regroup made: their requests are priced apart
        self.lent: tuple[int, float] = (0, 0.0)  # (devices, seconds into the window) lent into the tail's engine

    def _running(self, e: int, at: float) -> np.ndarray:
        """Requests engine e runs at `at` (seconds into the window, before the penalty)."""
        s = self.schedule
        return (s.placement == e) & (self.start_s <= at) & (s.done_s > at)

    def refresh(self, at: float) -> None:
        """Every engine still decoding at `at` (seconds into the window) reports it."""
        pipe = self.pipe
        now = at - self.penalty
        if now < self.queue_empty_s:
            return  # requests are still queued: no engine says its queue is empty
        for e in sorted(self.groups):
            if e in self.wide or self.finish[e] <= at:
                continue
            run = self._running(e, now)
            if not run.any():
                continue
            left = int(math.ceil(float(((self.schedule.done_s[run] - now) / self.pace[e]).max())))
            pipe._queue_empty(self.start + at, self.groups[e], self.w, int(run.sum()), left)

    def apply(self, at: float) -> None:
        """If the core just started a tail regroup: price the rest of the busy engine's requests
        on the wider engine (its ops are answered at once; the switch is charged here)."""
        pipe = self.pipe
        if not pipe._tail_pending:
            return
        plan, undo = pipe._tail_pending.pop(0)
        leader = {g[0]: e for e, g in self.groups.items()}
        if undo[0][0] not in leader:
            return
        b = leader[undo[0][0]]
        merged = [leader[g[0]] for g in undo[1:] if g[0] in leader]  # the rest: trainers lent for the tail
        pipe._ack_until(self.start + at)  # the regroup commits: the core knows the wide engine
        profile = pipe.model.profile
        now = at - self.penalty
        run = self._running(b, now)
        if run.any():
            r = (self.schedule.done_s[run] - now) / self.pace[b]  # tokens left, each running request
            g = self.lengths[run] - r
            p = self.prompts[run] + g
            wide = profile.rollout.at_tp(len(plan.devices))
            tail = profile.resize.tail
            prefill = 0.0 if tail.kv_moved else float(p.sum())
            seconds = float(busy_s(wide, np.array(float(r.max())), np.array(float(r.sum())),
                                   np.array(float(contexts(p, r).sum())), np.array(prefill)))
            new = at + tail.switch_s + seconds
            pipe.tail_regroups.append((self.w, float(self.finish[b]) - new))
            self.finish[b] = new
        self.groups[b] = sorted(plan.devices, key=pipe.index.__getitem__)
        for e in merged:
            del self.groups[e]
        self.idle_at[:] = sorted([(t, e) for t, e in self.idle_at if e != b] + [(float(self.finish[b]), b)])
        self.wide.add(b)

    def rollout_s(self) -> float:
        return float(max(self.finish[e] for e in self.groups))

    def served(self, rollout_s: float, home_devices: int) -> float:
        """Device-seconds that served the rollout: the home pool's, and the trainers lent into
        the tail's engine from when they landed."""
        devices, landed = self.lent
        return rollout_s * home_devices + devices * max(rollout_s - landed, 0.0)


class DynamicPipeline:
    """One dynamic run: the core and a policy move devices while the pipeline runs."""

    def __init__(
        self,
        model: StageModel,
        policy: Policy,
        *,
        guards: GuardConfig,
        naive: bool = False,
        progress: Progress | None = None,
        layout: Layout | None = None,
    ) -> None:
        profile = model.profile
        if layout is not None and naive:
            raise ValueError("regroups are simulated pipelined only: drop --naive or the layout advisor")
        gpe = profile.rollout.gpus_per_engine
        if profile.initial_split.rollout < gpe:
            raise ProfileError(f"profile {profile.name}: the initial rollout pool of {profile.initial_split.rollout} "
                               f"device(s) is smaller than one engine of {gpe}; start with a larger rollout "
                               f"pool or smaller engines")
        self.model = model
        self.policy = policy
        self.naive = naive
        self.progress = progress
        self.layout = layout
        self.gpus = profile.cluster.gpus
        self.devices = device_ids(self.gpus, profile.cluster.gpus_per_node)
        self.index = {d: i for i, d in enumerate(self.devices)}
        config = CoreConfig(
            guards=guards,
            heartbeat_timeout_s=math.inf,  # simulated workers never die; nothing sends heartbeats
            op_timeout_s=profile.resize.op_timeout_s,
            steps_total=model.steps,
            costs=ResizeCosts(
                to_training_s=self._estimated_cost(Pool.TRAINING),
                to_rollout_s=self._estimated_cost(Pool.ROLLOUT),
            ),
        )
        self.lending = bool(getattr(policy, "lends", False))
        if self.lending:
            loan = profile.loan
            to_training = (loan.group_change_s + loan.trainer_first_step_s if not naive
                           else sum(profile.loan_op_seconds(k, Pool.TRAINING, naive=True) for k in FORWARD_ORDER))
            back = (loan.trainer_leave_s + loan.engine_wake_s if not naive
                    else sum(profile.loan_op_seconds(k, Pool.ROLLOUT, naive=True) for k in FORWARD_ORDER))
            lead = sum(profile.loan_op_seconds(k, Pool.TRAINING, naive=naive) for k in FORWARD_ORDER)
            # The profile's own loan costs, exact: the core does not re-learn them from the
            # loans' op seconds (`learn_loan_costs`; the daemon does, from real loans).
            config = msgspec.structs.replace(config, loan_costs=LoanCosts(
                to_training_s=to_training, to_rollout_s=to_training, return_s=back, lead_s=lead),
                learn_loan_costs=False)
        # Tail regroups (`propose_tail`): request by request, with the pull router only.
        self.tails = bool(getattr(policy, "regroups_tails", False)) and model.router == "pull" and not naive
        if self.tails:
            config = msgspec.structs.replace(config, tail_costs=self._tail_costs())
        self.core = Core(config, policy)
        self._late: dict[str, float] = {}  # device -> seconds its engine starts late next window
        self._joins: list[SendOp] = []  # loan JOIN ops waiting for a mini-batch boundary
        self._joined: list[tuple[float, int]] = []  # (time, devices) of loans that joined
        self._charged: set[str] = set()  # return ops whose cost is charged
        self.state = ClusterState()
        self.facts: list[f.Fact] = []
        self._acks: list[_Ack] = []
        self._seq = 0
        self._commits: list[SendOp] = []
        self._penalty = {Pool.ROLLOUT: 0.0, Pool.TRAINING: 0.0}
        self._served_early: set[str] = set()  # resizes to the rollout whose engines pulled before commit
        # A policy that reads the rollout's progress (verl's rules) gets the engines' sample
        # counts (`ProgressReported`); others do not need them, and the run is faster without.
        self.tracks_progress = hasattr(policy, "observe_progress")
        self._mid_window = False  # a return of lent devices now happens inside a window
        self._early_home: tuple[float, float] | None = None  # (when, seconds) of such a return
        self._home_engines: list[str] = []  # the window's home engines, by engine index
        self._schedule_w: EngineSchedule | None = None  # the window's rollout on them, request by request
        self._arrived: list[tuple[str, ...]] = []  # devices resizes brought to the rollout, engines to form
        self._tail_in: set[str] = set()  # tail regroups (the policy's, inside a step)
        self._tail_pending: list[tuple[ResizePlan, tuple[tuple[str, ...], ...]]] = []  # started, not yet priced
        self._tail_out: set[str] = set()  # their ways back at the step boundary
        self.tail_regroups: list[tuple[int, float]] = []  # (window, seconds its rollout ended sooner)
        self._tail_landed: float | None = None  # seconds into the window the last loan to the rollout landed

    def _tail_costs(self) -> TailCosts:
        """What the policy estimates a tail regroup with: the profile's switch and way back, and
        per allowed engine width a decode iteration's cost, per running request at the context
        of the trace's long responses (mean prompt and 95th-percentile response)."""
        profile = self.model.profile
        steps = self.model.trace.steps
        ctx = float(np.mean([b.prompt_tokens.mean() for b in steps])
                    + np.percentile(np.concatenate([b.response_tokens for b in steps]), 95))
        widths = tuple(k for k in profile.rollout.engine_sizes() if k <= self.gpus)
        specs = [profile.rollout.at_tp(k) for k in widths]
        tail = profile.resize.tail
        return TailCosts(switch_s=tail.switch_s, back_s=tail.back_s, widths=widths,
                         base_s=tuple(r.iter_base_s for r in specs),
                         per_request_s=tuple(r.iter_per_seq_s + r.iter_per_ctx_token_s * ctx for r in specs))

    def _estimated_cost(self, to_pool: Pool) -> float:
        """Critical-path seconds per moved device before the core has measured one."""
        return sum(self.model.profile.op_seconds(k, to_pool, naive=self.naive) for k in FORWARD_ORDER)

    # -- feeding the core ----------------------------------------------------------------
    def _feed(self, event: ev.Event) -> None:
        self._took(*self.core.step(self.state, event), event.at)

    def _feed_answers(self, answers: list[ev.OpReported]) -> None:
        """One op's answers in turn (`Core.step_answers`: as fed one by one)."""
        if answers:
            self._took(*self.core.step_answers(self.state, answers), answers[-1].at)

    def _took(self, state: ClusterState, facts: list[f.Fact], commands: list[SendOp], at: float) -> None:
        self.state = state
        self.facts.extend(facts)
        costs = self.model.profile.resize
        for fact in facts:
            if isinstance(fact, f.RegroupStarted) and fact.undo:
                self._tail_in.add(fact.plan.resize_id)
                self._tail_pending.append((fact.plan, fact.undo))
            elif isinstance(fact, f.RegroupStarted) and fact.source == "tail":
                self._tail_out.add(fact.plan.resize_id)
            if isinstance(fact, f.ResizeCommitted) and self.model.profile.rollout.gpus_per_engine > 1:
                plan = self.facts_plan(fact.resize_id)
                if plan.kind is PlanKind.RESIZE and plan.to_pool is Pool.ROLLOUT:
                    self._arrived.append(plan.devices)
            if isinstance(fact, f.ResizeCommitted) and not self.naive:
                plan = self.facts_plan(fact.resize_id)
                c = costs.to_training if plan.to_pool is Pool.TRAINING else costs.to_rollout
                self._penalty[Pool.TRAINING] += c.commit_s
                if fact.resize_id not in self._served_early:
                    self._penalty[plan.to_pool] += c.first_step_s
        for command in commands:
            self._schedule(command, at)

    def facts_plan(self, resize_id: str) -> ResizePlan:
        for fact in reversed(self.facts):
            if isinstance(fact, f.ResizeStarted) and fact.plan.resize_id == resize_id:
                return fact.plan
        raise KeyError(resize_id)

    def _schedule(self, command: SendOp, now: float) -> None:
        op = command.op
        kind = self.state.inflight.plan.kind if self.state.inflight is not None else PlanKind.RESIZE
        rid = self.state.inflight.plan.resize_id if self.state.inflight is not None else ""
        if kind is PlanKind.REGROUP and (rid in self._tail_in or rid in self._tail_out):
            # a tail regroup's switch is charged where the window prices its tail
            # (`_window_with_loans`); its way back makes the next rollout start late there
            if rid in self._tail_out and op.kind is OpKind.DRAIN and op.op_id not in self._charged:
                self._charged.add(op.op_id)
                back = self.model.profile.resize.tail.back_s
                for d in op.devices:
                    self._late[d] = self._late.get(d, 0.0) + back
            self._seq += 1
            heapq.heappush(self._acks, _Ack(now, self._seq, command.worker_id, op.op_id))
            return
        if kind is PlanKind.REGROUP:
            # one op after the other on every device of the pool; what the pool loses meanwhile
            # was charged when the regroup started (`_regroup`)
            self._seq += 1
            heapq.heappush(self._acks, _Ack(now + self.model.profile.resize.regroup.op_s(op.kind), self._seq,
                                            command.worker_id, op.op_id))
            return
        if kind is not PlanKind.RESIZE:
            self._schedule_loan(command, now, kind)
            return
        if op.kind is OpKind.COMMIT and not self.naive:
            self._commits.append(command)  # acknowledged at the next step boundary
            return
        done = now + self.model.profile.op_seconds(op.kind, op.to_pool, naive=self.naive)
        self._seq += 1
        heapq.heappush(self._acks, _Ack(done, self._seq, command.worker_id, op.op_id))

    def _schedule_loan(self, command: SendOp, now: float, kind: PlanKind) -> None:
        op = command.op
        seconds = self.model.profile.loan_op_seconds(op.kind, op.to_pool, naive=self.naive)
        if kind is PlanKind.RETURN:
            # The way home is answered at the boundary; its seconds are charged where they
            # fall: the engine starts the next rollout that late (the trainer leaving first),
            # and the training group shrinks back once.
            if op.op_id not in self._charged and self._mid_window and op.to_pool is Pool.TRAINING:
                # Trainers lent to the rollout go home inside the window (the rule's sample
                # count reached): their way home is paid only where it outlasts the window.
                self._charged.add(op.op_id)
                extra = self.model.profile.loan.group_change_s if op.kind is OpKind.DRAIN and not self.naive else 0.0
                at, paid = self._early_home or (now, 0.0)
                self._early_home = (at, paid + seconds + extra)
            if op.op_id not in self._charged:
                self._charged.add(op.op_id)
                if op.to_pool is Pool.TRAINING:  # trainers lent to the rollout: the step starts late
                    self._penalty[Pool.TRAINING] += seconds
                for d in op.devices if op.to_pool is Pool.ROLLOUT else ():
                    self._late[d] = self._late.get(d, 0.0) + seconds
                if op.kind is OpKind.DRAIN and not self.naive:
                    self._penalty[Pool.TRAINING] += self.model.profile.loan.group_change_s
            seconds = 0.0
        elif op.kind is OpKind.JOIN and op.to_pool is Pool.TRAINING:
            self._joins.append(msgspec.structs.replace(command, deadline=now + seconds))
            return
        self._seq += 1
        heapq.heappush(self._acks, _Ack(now + seconds, self._seq, command.worker_id, op.op_id))

    def _queue_empty(self, at: float, devices: list[str], step: int, running: int = 0, tokens_left: int = 0) -> None:
        """The engine on `devices` (each device's engine worker) says step `step`'s queue is empty,
        with `running` requests still decoding (0: it has run dry)."""
        for d in devices:
            self._feed(ev.EngineQueueEmpty(at=at, worker_id=engine_id(self.index[d]), step=step, running=running,
                                           tokens_left=tokens_left))

    def _ack_until(self, until: float) -> None:
        while self._acks and self._acks[0].at <= until:
            ack = heapq.heappop(self._acks)
            answers = [ev.OpReported(at=ack.at, worker_id=ack.worker_id, op_id=ack.op_id, ok=True)]
            while self._acks and self._acks[0].at <= until and self._acks[0].op_id == ack.op_id:
                more = heapq.heappop(self._acks)  # the op's other targets, answering in turn
                answers.append(ev.OpReported(at=more.at, worker_id=more.worker_id, op_id=more.op_id, ok=True))
            self._feed_answers(answers)

    def _commit_at_boundary(self, now: float) -> None:
        fl = self.state.inflight
        if fl is None or not self._commits or fl.op.kind is not OpKind.COMMIT:
            return
        commits, self._commits = self._commits, []
        self._feed_answers([ev.OpReported(at=now, worker_id=c.worker_id, op_id=c.op.op_id, ok=True)
                            for c in commits if c.op.op_id == fl.op.op_id])

    def _stop_the_world(self, now: float) -> float:
        """Naive mode: nothing runs until the resize in flight has finished."""
        while self.state.inflight is not None:
            if not self._acks:
                raise RuntimeError(f"resize {self.state.inflight.plan.resize_id} waits for an op nobody runs")
            now = max(now, self._acks[0].at)
            self._ack_until(now)
        return now

    def _reporter(self) -> str:
        """The trainer rank that reports: the first device whose home is the training pool."""
        training = sorted((d for d, p in self.state.devices.items() if (p.home or p.pool) is Pool.TRAINING),
                          key=self.index.__getitem__)
        return trainer_id(self.index[training[0]])

    # -- loans inside a window -----------------------------------------------------------
    def _finish_joins(self, at: float) -> None:
        """A lent trainer whose join is done enters the group at this mini-batch boundary."""
        ready = [c for c in self._joins if c.deadline <= at]
        self._joins = [c for c in self._joins if c.deadline > at]
        fl = self.state.inflight
        if fl is None:
            return
        op = fl.op  # only its joins are answered: a join of another op has nobody waiting for it
        answers = [ev.OpReported(at=at, worker_id=c.worker_id, op_id=op.op_id, ok=True)
                   for c in ready if c.op.op_id == op.op_id]
        if answers:
            self._feed_answers(answers)
            if self.state.inflight is None or self.state.inflight.op.op_id != op.op_id:
                self._joined.append((at, len(op.devices)))

    def _land_loan(self, end: float) -> float:
        """A loan still on its way when the step ends lands before the boundary: the boundary
        waits for it (the lent device is idle anyway; the policy avoids this by estimating the
        loan's lead time). Returns the boundary's time."""
        while self.state.inflight is not None and self.state.inflight.plan.kind is PlanKind.LOAN:
            if self._acks:
                end = max(end, self._acks[0].at)
                self._ack_until(end)
            elif self._joins:
                end = max(end, min(c.deadline for c in self._joins))
                self._finish_joins(end)
            else:
                raise RuntimeError(f"loan {self.state.inflight.plan.resize_id} waits for an op nobody runs")
        self._joined = []
        return end

    def _rollout_loan_landed(self) -> tuple[float, tuple[str, ...]] | None:
        """A loan of trainers to the rollout just started: its ops run now (the router admits
        an engine mid-step). Returns (when it landed, its devices), or None without one."""
        fl = self.state.inflight
        if fl is None or fl.plan.kind is not PlanKind.LOAN or fl.plan.to_pool is not Pool.ROLLOUT:
            return None
        rid, at = fl.plan.resize_id, fl.started_at
        while self.state.inflight is not None and self.state.inflight.plan.resize_id == rid:
            if not self._acks:
                raise RuntimeError(f"loan {rid} waits for an op nobody runs")
            at = max(at, self._acks[0].at)
            self._ack_until(at)
        return at, fl.plan.devices

    def _window_with_loans(self, w: int, start: float, split: Split) -> tuple[float, float, int, float]:
        """Window w with idle engines lent to training step w-1 at its mini-batch boundaries,
        and trainers with nothing to train (window 0, or after the last mini-batch) lent to the
        rollout while its queue lasts. Engines report when they run dry, the trainer when its
        step begins and after every mini-batch; the core and the policy decide; a loan's JOIN
        to training lands at the first boundary after its ops are done, one to the rollout
        pulls queued requests once its ops are done. Returns (rollout seconds, training
        seconds, devices lent, device-seconds that served the rollout)."""
        model, profile = self.model, self.model.profile
        mbs = profile.training.mini_batches_per_step
        if self.tracks_progress and w < model.steps:
            # The step's requests are queued: each engine says it has done none of them yet.
            total = int(model.samples[w])
            gpe = profile.rollout.gpus_per_engine
            home = sorted((d for d, p in self.state.devices.items() if (p.home or p.pool) is Pool.ROLLOUT),
                          key=self.index.__getitem__)
            for d in home[::gpe][:model.engines(len(home))]:
                self._feed(ev.ProgressReported(at=start, worker_id=engine_id(self.index[d]), step=w, done=0,
                                               total=total))
        # The trainer says its step begins (window 0: that it has nothing to train yet); its
        # devices lent to the rollout in window 0 come home first, and the step pays their way.
        self._feed(ev.MiniBatchDone(at=start, worker_id=self._reporter(), step=max(w - 1, 0), done=0,
                                    total=0 if w == 0 else mbs))
        self._ack_until(start)
        rollout_devs = sorted(self.state.pool_devices(Pool.ROLLOUT), key=self.index.__getitem__)
        engines = model.engines(len(rollout_devs))
        late = np.array([self._late.get(d, 0.0) for d in rollout_devs[:engines]])
        self._late.clear()
        gpe = profile.rollout.gpus_per_engine
        self._home_engines = [engine_id(self.index[d]) for d in rollout_devs[::gpe][:engines]]
        self._schedule_w = None
        if w < model.steps:
            finish = model.engine_finish(w, engines, late) + self._penalty[Pool.ROLLOUT]
            if self.tracks_progress:
                self._schedule_w = model.engine_schedule(w, engines, late)
        else:
            finish = late.copy()  # the last window only trains: every engine is idle at once
        rollout_s = float(finish.max()) if w < model.steps else 0.0
        served = rollout_s * len(rollout_devs)
        if w == 0:
            rollout_s, served, lent = self._lend_to_rollout(w, start, rollout_s, len(rollout_devs), late, 0.0)
            return rollout_s, 0.0, lent, served
        idle_at = sorted((float(finish[e]), e) for e in range(engines))
        groups = {e: rollout_devs[e * gpe:(e + 1) * gpe] for e in range(engines)}
        self._tail_pending.clear()
        tail = (_Tail(self, w, start, finish, groups, late, idle_at) if self.tails and w < model.steps and engines >= 1
                else None)
        idle_devices: set[str] = set()

        def dry(until: float) -> None:
            """Engines that run dry by `until` report it, in time order (with tail regroups,
            each after the engines still decoding said how far they are)."""
            while idle_at and idle_at[0][0] <= until:
                at, e = idle_at.pop(0)
                self._ack_until(start + at)
                if tail is not None:
                    tail.refresh(at)
                idle_devices.update(groups[e])
                self._queue_empty(start + at, groups[e], w)
                if tail is not None:
                    tail.apply(at)

        per_mb = model.train_work(w - 1) / mbs
        eff = model.dp_efficiency
        loan = profile.loan
        n = split.train
        t = profile.training.step_overhead_s + self._penalty[Pool.TRAINING]
        self._joined = []
        lent = 0
        reporter = self._reporter()
        first_fact = len(self.facts)
        for j in range(1, mbs + 1):
            t_end = t + per_mb / (n * eff(n))
            dry(t_end)  # engines that run dry before this mini-batch ends report it, in time order
            self._ack_until(start + t_end)
            if j == mbs and self._schedule_w is not None:
                # what verl's rule reads after training: the samples of the next batch done
                self._report_progress(w, start, self._home_engines, self._schedule_w,
                                      self._penalty[Pool.ROLLOUT], -math.inf, t_end, snapshot=True)
            if j == mbs and w < model.steps and tail is not None:
                tail.refresh(t_end)  # the engines still decoding say how far they are
            self._feed(ev.MiniBatchDone(at=start + t_end, worker_id=reporter, step=w - 1, done=j, total=mbs))
            if j == mbs and w < model.steps:  # training done: its trainers may serve the rollout
                if tail is not None:
                    rollout_s = tail.rollout_s()
                rollout_s, served, more = self._lend_to_rollout(w, start, rollout_s, len(rollout_devs), late,
                                                                t_end)
                lent += more
                if more and tail is not None:
                    landed = self._tail_landed
                    if landed is not None and landed - tail.penalty >= tail.queue_empty_s:
                        # lent for the tail, into an empty queue: they pulled nothing, and join it
                        tail.apply(landed)
                        tail.lent = (more, landed)
                    else:
                        tail = None  # trainers pull the step's queue now: the tail's timeline no longer holds
            self._ack_until(start + t_end)
            if j < mbs:
                self._finish_joins(start + t_end)
            joined = sum(k for _, k in self._joined)
            self._joined = []
            t = t_end
            if joined:
                lent += joined
                n += joined
                t += loan.group_change_s + loan.trainer_first_step_s if not self.naive else 0.0
        for fact in self.facts[first_fact:]:
            # A device serves one pool at a time: only an engine that has run dry is lent.
            if (isinstance(fact, f.LoanStarted) and fact.plan.to_pool is Pool.TRAINING
                    and not set(fact.plan.devices) <= idle_devices):
                raise RuntimeError(f"loan {fact.plan.resize_id} lent busy devices {fact.plan.devices}")
        if tail is not None:
            # the rollout outlasts the training step: its engines still run dry, and a tail may
            # still be regrouped, until it ends
            dry(math.inf)
            rollout_s = tail.rollout_s()
            served = tail.served(rollout_s, len(rollout_devs))
        train_s = t
        return rollout_s, train_s, lent, served

    def _lend_to_rollout(self, w: int, start: float, rollout_s: float, home_devices: int,
                         late: np.ndarray, since: float) -> tuple[float, float, int]:
        """If the core just lent trainers to rollout w, their engines pull the step's queued
        requests from when the loan lands (only the pull router hands them any). A policy that
        reads progress hears the engines' sample counts from `since` (seconds into the window)
        on, and may send the lent trainers home once enough are done: from then they pull
        nothing more (what they run they finish). Returns the rollout's seconds, the
        device-seconds that served it, and the devices lent."""
        served = rollout_s * home_devices
        penalty = self._penalty[Pool.ROLLOUT]
        self._tail_landed = None
        landed = self._rollout_loan_landed()
        if landed is None:
            self._report_rest(w, start, self._home_engines, self._schedule_w, penalty, since)
            return rollout_s, served, 0
        at, devices = landed
        model = self.model
        ready = at - start
        self._tail_landed = ready  # read by a tail regroup the landing started (`_window_with_loans`)
        extra = model.engines(len(devices))
        gpe = model.profile.rollout.gpus_per_engine
        lent_engines = [engine_id(self.index[d]) for d in devices[::gpe][:extra]]
        if model.router != "pull" or extra == 0 or ready >= rollout_s:
            # the lent engines get nothing; the home engines' progress may still send them home
            home_engines = self._home_engines
            if self._report_progress(w, start, home_engines, self._schedule_w, penalty, -math.inf, ready,
                                     snapshot=True, watch=True) is None:
                self._report_rest(w, start, home_engines, self._schedule_w, penalty, ready, watch=True)
            else:
                self._report_rest(w, start, home_engines, self._schedule_w, penalty, ready)
            return rollout_s, served, len(devices)
        home = len(late)
        offsets = np.concatenate([late, np.full(extra, ready)])
        stops = None
        if self.tracks_progress:
            # verl's rules: `rebalances` (verl-default's request_rebalance) redistributes every
            # running request once the lent engines are in; going home aborts what they run
            # (partial rollout: the home engines resume it)
            workers = self._home_engines + lent_engines
            rebalance = ready if getattr(self.policy, "rebalances", False) else None
            schedule = model.engine_schedule(w, home + extra, offsets, rebalance_at_s=rebalance)
            # what was done by the time they are in, then as it comes
            back = self._report_progress(w, start, workers, schedule, penalty, -math.inf, ready, snapshot=True,
                                         watch=True)
            if back is None:
                back = self._report_progress(w, start, workers, schedule, penalty, ready, math.inf, watch=True)
            if back is not None:
                stops = frozenset(range(home, home + extra))
                schedule = model.engine_schedule(w, home + extra, offsets, rebalance_at_s=rebalance,
                                                 stop_at_s=back - penalty, stopping=stops)
                self._report_rest(w, start, workers, schedule, penalty, back)
                lent_done = start + float(schedule.finish_s[home:].max()) + penalty
                at_home, paid = self._early_home or (start + back, 0.0)
                self._early_home = (max(at_home, lent_done), paid)
            finish = schedule.finish_s
        else:
            finish = model.engine_finish(w, home + extra, offsets)
        finish = finish + penalty
        busy = finish[home:] > ready + penalty
        rollout_s = float(max(finish[:home].max(), finish[home:][busy].max() if busy.any() else 0.0))
        until = rollout_s if stops is None else float(finish[home:].max())
        served = rollout_s * home_devices + (len(devices) * (until - ready) if busy.any() else 0.0)
        return rollout_s, served, len(devices)

    def _report_progress(self, w: int, start: float, workers: list[str], schedule: EngineSchedule | None,
                         offset: float, since: float, until: float, *, snapshot: bool = False,
                         watch: bool = False) -> float | None:
        """The engines report how many of step w's samples each has done, at every
        `1 / PROGRESS_POINTS` of the step's samples done in (since, until] (seconds into the
        window; `offset` shifts the schedule), or once at `until` (`snapshot`). With `watch`,
        stops at the first report on which the core starts sending lent devices home, and
        returns its time (their ops answered at once: the way home is charged by the window)."""
        if schedule is None:
            return None
        done = schedule.done_s + offset
        total = int(done.shape[0])
        engines = len(workers)
        reported = np.full(engines, -1, dtype=np.int64)

        def report(at: float, counts: np.ndarray) -> bool:
            self._mid_window = watch
            for e in np.flatnonzero(counts != reported):
                self._feed(ev.ProgressReported(at=start + at, worker_id=workers[e], step=w, done=int(counts[e]),
                                               total=total))
            self._mid_window = False
            reported[:] = counts
            fl = self.state.inflight
            if not (watch and fl is not None and fl.plan.kind is PlanKind.RETURN):
                return False
            self._ack_until(start + at)
            return True

        if snapshot:
            return until if report(until, np.bincount(schedule.placement[done <= until], minlength=engines)) else None
        order = np.argsort(done, kind="stable")
        grain = max(1, total // PROGRESS_POINTS)
        counts = np.zeros(engines, dtype=np.int64)
        for k, j in enumerate(order):
            counts[schedule.placement[j]] += 1
            at = float(done[j])
            if at <= since:
                continue
            if at > until:
                break
            if (k + 1) % grain and k + 1 != total:
                continue
            if report(at, counts):
                return at
        return None

    def _report_rest(self, w: int, start: float, workers: list[str], schedule: EngineSchedule | None,
                     offset: float, since: float, *, watch: bool = False) -> None:
        """The rest of step w's progress after `since`: every report (`watch`: a return of lent
        devices may start on one), or only each engine's last, when it has done all of its own."""
        if schedule is None:
            return
        if watch:
            back = self._report_progress(w, start, workers, schedule, offset, since, math.inf, watch=True)
            if back is not None:
                self._report_rest(w, start, workers, schedule, offset, back)
            return
        engines = len(workers)
        mine = np.bincount(schedule.placement, minlength=engines)
        for e in np.argsort(schedule.finish_s, kind="stable"):
            at = float(schedule.finish_s[e]) + offset
            if at > since and mine[e]:
                self._feed(ev.ProgressReported(at=start + at, worker_id=workers[e], step=w, done=int(mine[e]),
                                               total=int(schedule.done_s.shape[0])))

    def _mixed_rollout_s(self, w: int, split: Split, now: float) -> float:
        """Rollout w on `split`, plus, with the pull router, the engines of a pipelined resize to
        the rollout that started at this boundary: each pulls from the step's queue once its
        drain, release, join and restore are done and it has warmed up (our router admits an
        engine mid-step, `backends/vllm/router.py`); the commit still waits for the boundary."""
        model = self.model
        fl = self.state.inflight
        if (self.naive or model.router != "pull" or fl is None or fl.plan.kind is not PlanKind.RESIZE
                or fl.plan.to_pool is not Pool.ROLLOUT or fl.plan.resize_id in self._served_early
                or fl.started_at != now):
            return model.rollout_seconds(w, split.rollout)
        profile = model.profile
        ready = profile.resize.to_rollout.ready_s()
        home, extra = model.engines(split.rollout), model.engines(len(fl.plan.devices))
        if extra == 0:
            return model.rollout_seconds(w, split.rollout)  # too few devices moving for one engine
        late = np.concatenate([np.zeros(home), np.full(extra, ready)])
        self._served_early.add(fl.plan.resize_id)
        return float(model.engine_finish(w, home + extra, late).max())

    # -- regroups ------------------------------------------------------------------------
    def _initial_engines(self) -> None:
        """Engines of several devices from the start: the core learns them as the daemon would
        from a regroup before the first step (at no cost: the job's engines start that way), so
        that it moves each whole and lends each whole, as the daemon does."""
        gpe = self.model.profile.rollout.gpus_per_engine
        rollout = sorted(self.state.pool_devices(Pool.ROLLOUT), key=self.index.__getitem__)
        self._form_engines(tuple(rollout[:len(rollout) // gpe * gpe]), 0.0, "the job's engines as they start")

    def _form_engines(self, devices: tuple[str, ...], at: float, why: str) -> None:
        """`devices` serve as engines of the profile's size from `at` on: the core learns them
        through a regroup answered at once (what it costs is charged by whoever made them: the
        job's start, or the resize whose restore started them)."""
        gpe = self.model.profile.rollout.gpus_per_engine
        if gpe == 1 or not devices:
            return
        self._feed(ev.RegroupRequested(at=at, devices=devices, tp=gpe, requested_by="profile", reason=why))
        while self.state.inflight is not None:
            acks, self._acks = self._acks, []
            if not acks:
                rid = self.state.inflight.plan.resize_id
                raise RuntimeError(f"regroup {rid} of {devices} waits for an op nobody runs")
            self._feed_answers([ev.OpReported(at=at, worker_id=a.worker_id, op_id=a.op_id, ok=True) for a in acks])

    def _form_arrived_engines(self, at: float) -> None:
        """Devices a resize brought to the rollout pool start engines of the profile's size (the
        resize's restore starts them so): the core learns them once nothing is in flight."""
        if self._arrived and self.state.inflight is None:
            arrived, self._arrived = self._arrived, []
            for devices in arrived:
                self._form_engines(devices, at, "engines started on devices a resize brought to the rollout")

    def _regroup(self, w: int, now: float) -> None:
        """At the boundary after rollout `w`, ask the layout advisor; when it names another
        engine size, request the regroup of the rollout pool from the core (as `dynaresized
        regroup` does) and, once the core has started it, price the rollout on the new engines
        from the next window on, which starts late by the regroup's ops and first step (the
        pool serves nothing meanwhile; training goes on)."""
        s = self.state
        if self.layout is None or s.inflight is not None or s.phase is not Phase.STEADY or s.paused:
            return
        tp = self.model.profile.rollout.gpus_per_engine
        advice = self.layout(w, tp)
        if advice is None or advice[0] == tp:
            return
        target, why = advice
        # at home in the rollout pool: neither lent (a home elsewhere) nor moving (no pool)
        home = sorted((d for d, p in s.devices.items() if p.pool is Pool.ROLLOUT and p.home is None),
                      key=self.index.__getitem__)
        devices = tuple(home[:len(home) // target * target])
        if not devices:
            return
        before = len(self.facts)
        self._feed(ev.RegroupRequested(at=now, devices=devices, tp=target, requested_by="planner", reason=why))
        if any(isinstance(x, f.RegroupStarted) for x in self.facts[before:]):
            self.model = self.model.at_tp(target)
            self._penalty[Pool.ROLLOUT] += self.model.profile.resize.regroup.ready_s()

    def _candidates(self) -> tuple[Split, ...]:
        """The splits the policy may pick: the profile's, and with engines of several devices
        only those whose rollout pool is whole engines (a resize moves whole engines, and the
        devices it brings start whole engines); empty: every split."""
        profile = self.model.profile
        gpe = profile.rollout.gpus_per_engine
        splits = profile.candidate_splits()
        if gpe == 1:
            return splits
        if not splits:
            splits = tuple(Split(self.gpus - r, r) for r in range(gpe, self.gpus, gpe))
        return tuple(c for c in splits if c.rollout % gpe == 0 or c == profile.initial_split)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> DynamicRun:
        model = self.model
        profile = model.profile
        initial = profile.initial_split
        pools = tuple(Pool.TRAINING if i < initial.train else Pool.ROLLOUT for i in range(self.gpus))
        self._feed(ev.Configure(at=0.0, devices=self.devices, pools=pools, candidates=self._candidates()))
        for i, d in enumerate(self.devices):
            self._feed(ev.WorkerHello(at=0.0, worker_id=engine_id(i), kind=WorkerKind.ROLLOUT_ENGINE, devices=(d,)))
            self._feed(ev.WorkerHello(at=0.0, worker_id=trainer_id(i), kind=WorkerKind.TRAINER_RANK, devices=(d,)))
        self._initial_engines()
        k = model.steps
        sync = model.weight_sync_s
        now = 0.0
        windows: list[Window] = []
        held: list[tuple[int, str]] = []
        last_rollout = (0.0, 0, 0.0)  # (seconds, devices, device-seconds) of the previous window's rollout
        for w in range(k + 1):
            if self.naive and self.state.inflight is not None:
                now = self._stop_the_world(now)
                self._form_arrived_engines(now)
            split = self.state.split
            moving = self.gpus - split.total
            rollout_s = train_s = served = 0.0
            lent = 0
            if self.lending and moving == 0 and self.state.inflight is None:
                rollout_s, train_s, lent, served = self._window_with_loans(w, now, split)
            else:
                if w < k:
                    rollout_s = self._mixed_rollout_s(w, split, now) + self._penalty[Pool.ROLLOUT]
                    served = rollout_s * split.rollout
                if w >= 1:
                    train_s = model.train_seconds(w - 1, split.train) + self._penalty[Pool.TRAINING]
                self._late.clear()
            self._penalty = {Pool.ROLLOUT: 0.0, Pool.TRAINING: 0.0}
            end = now + max(rollout_s, train_s) + (sync if w >= 1 else 0.0)
            if self._early_home is not None:
                # lent trainers that went home inside the window: the next step waits for the
                # part of their way home that outlasts this window
                at, paid = self._early_home
                self._penalty[Pool.TRAINING] += max(at + paid - end, 0.0)
                self._early_home = None
            self._ack_until(end)
            self._finish_joins(end)
            end = self._land_loan(end)
            windows.append(Window(w, now, end, split.rollout, split.train, moving, rollout_s, train_s, lent))
            now = end
            self._feed(ev.Tick(at=now))
            if w >= 1:
                step = w - 1
                timing = StepTiming(
                    step=step,
                    rollout_s=last_rollout[0],
                    train_s=train_s,
                    weight_sync_s=sync,
                    rollout_devices=last_rollout[1],
                    rollout_device_s=last_rollout[2],
                    train_devices=split.train,
                    samples=int(model.samples[step]),
                    response_tokens=int(model.response_tokens[step]),
                )
                before = len(self.facts)
                consulted = self.state.phase is Phase.STEADY and not self.state.paused
                self._feed(ev.StepReported(at=now, worker_id=self._reporter(), timing=timing))
                reason = getattr(self.policy, "last_reason", "")
                proposed = any(isinstance(x, (f.ResizeStarted, f.ProposalRejected)) for x in self.facts[before:])
                if consulted and reason and not proposed:
                    held.append((step, reason))
            if not self.naive:
                self._commit_at_boundary(now)
            self._ack_until(now)  # a loan's way home is answered at the boundary
            self._form_arrived_engines(now)
            if w + 1 < k:
                self._regroup(w, now)
            last_rollout = (rollout_s, split.rollout, served)
            if self.progress is not None:
                self.progress(w + 1, k + 1)
        # A resize started at the very last boundary never ran: nothing is left to run on it.
        return DynamicRun(
            total_time_s=now,
            windows=tuple(windows),
            facts=tuple(self.facts),
            final_split=self.state.split,
            state=self.state,
            held=tuple(held),
        )
