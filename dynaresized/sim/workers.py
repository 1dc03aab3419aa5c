"""The simulated workers behind the dynamic mode: events fed to the core, each op it sends answered
after the op's simulated duration (a loan's join at a mini-batch boundary, a commit at the step
boundary), and each resize's, loan's or tail regroup's cost charged to the pool where it falls."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import msgspec

from dynaresized.core import ClusterState, Core, SendOp
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.domain import OpKind, PlanKind, Pool, ResizePlan

if TYPE_CHECKING:
    from dynaresized.sim.stages import StageModel


def device_ids(gpus: int, per_node: int) -> tuple[str, ...]:
    return tuple(f"node{i // per_node}:gpu{i % per_node}" for i in range(gpus))


def engine_id(index: int) -> str:
    return f"engine-{index}"


def trainer_id(index: int) -> str:
    return f"trainer-{index}"


class _Ack(msgspec.Struct, frozen=True, order=True, array_like=True):
    at: float
    seq: int
    worker_id: str
    op_id: str


class SimWorkers:
    """The workers of one dynamic run (`pipeline.DynamicPipeline`, whose `__init__` sets the state
    below): they feed the core, queue each op's answer for when it is done, and charge what an
    op costs to the pools (`_penalty`: seconds a pool's next step starts late; `_late`: per
    device, seconds its engine starts the next rollout late)."""

    model: StageModel
    naive: bool
    index: dict[str, int]
    core: Core
    state: ClusterState
    facts: list[f.Fact]
    _acks: list[_Ack]
    _seq: int
    _commits: list[SendOp]
    _joins: list[SendOp]
    _joined: list[tuple[float, int]]
    _charged: set[str]
    _late: dict[str, float]
    _penalty: dict[Pool, float]
    _served_early: set[str]
    _mid_window: bool
    _early_home: tuple[float, float] | None
    _arrived: bool
    _tail_in: set[str]
    _tail_pending: list[tuple[ResizePlan, tuple[tuple[str, ...], ...]]]
    _tail_out: set[str]

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
                    self._arrived = True
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

    # -- a loan's ops --------------------------------------------------------------------
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
