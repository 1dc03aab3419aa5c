"""verl's fully-async pipeline in virtual time: a staleness budget, partial rollout and
streaming mini-batches (issue 44; docs/simulator.md, "Pipelines").

`pipeline.py` runs the one-step-off pipeline in windows: rollout w beside training w-1, a whole
batch in before a step trains. verl's fully-async trainer (`verl/experimental/fully_async_policy`)
has no windows, and this module runs it request by request:

* **The rollouter** streams the trace's samples, in order, to the engines (one queue, pulled by
  the least-loaded engine with a free slot; continuous batching as `stages.py` models it: an
  iteration costs `base + per_seq x running + per_ctx x their contexts`, a request's prompt, and
  what it generated before an abort, is prefilled when it is admitted). It starts a sample only
  while the samples started are at most those trained before the last parameter sync plus
  `(1 + staleness) x` the next step's batch (verl's `max_required_samples`, counted from what is in
  flight or queued at each sync, `reset_staleness`). `staleness` 0 is synchronous training.
* **The trainer** takes a mini-batch (`1 / sync_every` of a step's samples) from the queue of
  finished samples as soon as it is there, in the order they finished, and trains it; after
  `sync_every` mini-batches (one of our RL steps, one verl parameter-sync cycle) it syncs the
  weights. During a sync the rollouter is paused: with `partial_rollout` every running request is
  aborted and queued again at the front with what it generated, and goes on after the sync under
  the new weights; without, the sync waits until every running request is done, and nothing new
  starts meanwhile.
* **Hybrid replicas** (verl's dynamic scheduling): a loan policy (`verl-default`, read through the
  same `LoanView` the core hands it) is asked after each training step whether to lend the trainers
  as engines of the rollout's size; they serve from `trainer_leave_s + engine_wake_s` after that
  (and not before the sync ends) until the policy sends them home (the samples it waits for are
  queued); their running requests are resumed on the standalone engines, and the trainer trains
  `engine_release_s + trainer_join_s` later. The core's `loan_payback` gate applies
  (`saves_s > cost_s x loan_safety`).

The ledger records, per sample, the parameter version it started and finished under and the step
that trained it, so a run proves every sample generated once and trained once, never on weights
newer than its own, and never older than the staleness budget allows.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

import msgspec
import numpy as np

from dynaresized.core import costmodel
from dynaresized.core.cycles import cycle_timing
from dynaresized.core.policy import LoanCosts, LoanView, load_policy
from dynaresized.domain import PipelineSpec, Pool, Split, StepTiming
from dynaresized.sim.stages import StageModel, trained_tokens

class SampleLedger(msgspec.Struct, frozen=True):
    """What the run proved about its samples (`AsyncRun.ledger`)."""

    samples: int
    generated_once: bool  # every sample finished exactly once
    trained_once: bool  # every finished sample trained by exactly one step
    never_future_weights: bool  # no sample finished under weights newer than the step training it
    max_staleness: int  # the most versions a sample started before the step that trained it
    resumed: int  # aborted requests resumed (partial rollout, hybrids going home)
    spanning_versions: int  # samples finished under a later version than they started


class AsyncRun(msgspec.Struct, frozen=True):
    total_time_s: float
    split: Split
    tp: int
    step_end_s: list[float]  # when each step's training (and its sync) ended
    loans: int  # hybrid activations
    hybrid_device_s: float  # device-seconds the trainers served as engines
    rollout_busy_s: float  # engine-seconds the rollout pool's engines decoded or prefilled
    trainer_wait_s: float  # seconds the trainer had nothing to train (waiting for samples or hybrids)
    ledger: SampleLedger
    loan_reasons: list[str] = []


class _Engine:
    """One engine's continuous batch: an iteration clock (tokens every running request got so
    far) and, per running request, the clock at which it finishes."""

    __slots__ = ("clock", "t", "heap", "n", "a", "epoch", "busy_s")

    def __init__(self, t: float) -> None:
        self.clock = 0.0
        self.t = t
        self.heap: list[tuple[float, int]] = []
        self.n = 0
        self.a = 0.0  # sum over running requests of (context at admission - clock at admission)
        self.epoch = 0
        self.busy_s = 0.0


class AsyncPipeline:
    """One run of the fully-async pipeline on a fixed split, with an optional loan policy."""

    def __init__(self, model: StageModel, split: Split, spec: PipelineSpec, *,
                 loan_policy: Any = None, loan_safety: float = 1.0, home_ratio: float = 0.3) -> None:
        if spec.windowed:
            raise ValueError("the one-step-off pipeline runs in windows (pipeline.DynamicPipeline)")
        gpe = model.profile.rollout.gpus_per_engine
        if split.train < 1 or split.rollout < gpe:
            raise ValueError(f"split {split} needs a trainer and an engine of {gpe} device(s)")
        self.split, self.spec = split, spec
        if loan_policy is not None and not hasattr(loan_policy, "propose_loan"):
            loan_policy = None  # a policy that never lends (`static`, `greedy`): the split stands
        self.policy, self.loan_safety = loan_policy, float(loan_safety)
        # A policy without a take-back rule of its own (the daemon's, through the verl
        # integration) decides only when to lend; verl's trainer takes its replicas back at its
        # adapted `deactivate_wait_samples`, run here as verl runs it (its own verdict unused).
        self.home_rule = None
        if loan_policy is not None and not hasattr(loan_policy, "observe_progress"):
            self.home_rule = load_policy("verl-default", {"deactivate_ratio": home_ratio})
        r = model.profile.rollout
        self._base, self._seq, self._ctx, self._prefill = (r.iter_base_s, r.iter_per_seq_s, r.iter_per_ctx_token_s,
                                                           r.prefill_per_token_s)
        trace = model.trace
        self.S = [b.samples for b in trace]
        self.cum = np.concatenate([[0], np.cumsum(self.S)]).astype(np.int64)
        n = int(self.cum[-1])
        self.P = np.concatenate([b.prompt_tokens for b in trace]).astype(np.float64)
        self.L = np.concatenate([b.response_tokens for b in trace]).astype(np.float64)
        t = model.profile.training
        tokens = trained_tokens(self.P + self.L, t.attention_tokens)
        trained = np.concatenate([b.trained_mask for b in trace])
        # device-seconds a sample adds to its training step (filtered samples: none)
        self.train_work = np.where(trained, tokens, 0.0) * model.train_s_per_token
        # per sample, as Python lists: the event loop reads them one at a time
        self.Pl: list[float] = self.P.tolist()
        self.Ll: list[float] = self.L.tolist()
        self.slots_l: list[int] = np.concatenate(
            [np.full(b.samples, model.batch_limit[i]) for i, b in enumerate(trace)]).tolist()
        self.train_rate = split.train * model.dp_efficiency(split.train)
        self.overhead = t.step_overhead_s
        self.sync_s = model.weight_sync_s
        loan = model.profile.loan
        self.to_rollout_s = loan.trainer_leave_s + loan.engine_wake_s
        self.home_s = loan.engine_release_s + loan.trainer_join_s
        # As `pipeline.DynamicPipeline` hands them to the core (verl's rules read `return_s` as
        # the way to the rollout and `lead_s` as the way home)
        to_training = loan.group_change_s + loan.trainer_first_step_s
        self.costs = LoanCosts(return_s=self.to_rollout_s, lead_s=self.home_s, to_rollout_s=to_training,
                               to_training_s=to_training)
        self.gpe = gpe
        self.samples = n
        # per sample
        self.generated = [0.0] * n
        self.admitted_clock = [0.0] * n
        self.v_start = [-1] * n
        self.v_end = [-1] * n
        self.trained_by = [-1] * n
        self.finished = [0] * n
        self.cached_on = [-1] * n  # the engine holding an aborted request's prefix
        self.cached_version = [-1] * n

    # -- engines ---------------------------------------------------------------------------
    def _rate(self, e: _Engine) -> tuple[float, float]:
        """(seconds of the next iteration, growth of that per iteration) at the engine's clock."""
        return (self._base + self._seq * e.n + self._ctx * (e.a + e.n * e.clock), self._ctx * e.n)

    def _seconds(self, e: _Engine, iters: float) -> float:
        b, a = self._rate(e)
        return b * iters + 0.5 * a * iters * iters

    def _advance(self, e: _Engine, now: float) -> None:
        """Run the engine's batch up to `now` (it is idle, or prefilling until `e.t`, before)."""
        dt = now - e.t
        if dt <= 0:
            return
        if e.n:
            b, a = self._rate(e)
            iters = dt / b if a <= 0 else (-b + math.sqrt(b * b + 2.0 * a * dt)) / a
            if e.heap:
                iters = min(iters, e.heap[0][0] - e.clock)
            e.clock += max(iters, 0.0)
            e.busy_s += dt
        e.t = now

    def _schedule(self, i: int, e: _Engine) -> None:
        e.epoch += 1
        if e.heap:
            at = e.t + self._seconds(e, e.heap[0][0] - e.clock)
            self._push(at, 0, (i, e.epoch))

    def _admit(self, i: int, e: _Engine, rid: int) -> None:
        g = self.generated[rid]
        p = self.Pl[rid]
        if not (self.cached_on[rid] == i and self.cached_version[rid] == self.version):
            # Prefilled: a new request, or one resumed elsewhere or under new weights. One resumed
            # where it was aborted under the same weights finds its prefix cached (SGLang's radix
            # cache, vLLM's prefix caching).
            e.t += self._prefill * (p + g)
            e.busy_s += self._prefill * (p + g)
        self.cached_on[rid] = -1
        heapq.heappush(e.heap, (e.clock + (self.Ll[rid] - g), rid))
        e.n += 1
        e.a += p + g - e.clock
        self.admitted_clock[rid] = e.clock
        if self.v_start[rid] < 0:
            self.v_start[rid] = self.version
            self.started += 1

    def _abort_all(self, i: int, now: float) -> list[int]:
        """Stop every request running on engine i, keeping what each generated."""
        e = self.engines[i]
        self._advance(e, now)
        rids = sorted(rid for _, rid in e.heap)
        for rid in rids:
            self.generated[rid] += e.clock - self.admitted_clock[rid]
            self.cached_on[rid], self.cached_version[rid] = i, self.version
        e.heap.clear()
        e.n, e.a = 0, 0.0
        e.epoch += 1
        self.resumed += len(rids)
        return rids

    def _set_gate(self) -> None:
        """The samples the rollouter may have started by now: those trained before the last
        sync plus (1 + staleness) x the next step's batch (verl's `max_required_samples`)."""
        c = min(self.syncs, len(self.S) - 1)
        self.gate = min(self.samples, int(self.cum[self.syncs] + math.floor((1.0 + self.spec.staleness) * self.S[c] + 1e-9)))

    def _next_rid(self) -> int | None:
        if self.resume:
            return self.resume[0]
        if self.next_new < self.gate:
            return self.next_new
        return None

    def _take(self, i: int, e: _Engine, rid: int) -> None:
        """Admit `rid`, the queue's next request (`_next_rid`), on engine i."""
        if self.resume and self.resume[0] == rid:
            self.resume.popleft()
        else:
            self.next_new += 1
        self._admit(i, e, rid)

    def _fill(self, i: int, now: float) -> None:
        """Engine i pulls from the queue while it has a free slot."""
        if self.paused:
            return
        e = self.engines[i]
        if e is None:
            return
        self._advance(e, now)
        changed = False
        while True:
            rid = self._next_rid()
            if rid is None or e.n >= self.slots_l[rid]:
                break
            self._take(i, e, rid)
            changed = True
        if changed:
            self._schedule(i, e)

    def _fill_all(self, now: float) -> None:
        """Every engine pulls while it has a free slot, one request at a time to the least
        loaded (verl's least-loaded routing; ours pulls, which places the same)."""
        if self.paused:
            return
        heap = []
        for i, e in enumerate(self.engines):
            if e is not None:
                self._advance(e, now)
                heap.append((e.n, i))
        heapq.heapify(heap)
        changed = set()
        while heap:
            rid = self._next_rid()
            if rid is None:
                break
            n, i = heapq.heappop(heap)
            e = self.engines[i]
            if n >= self.slots_l[rid]:
                continue  # full for this request (and, least loaded, every engine left is)
            self._take(i, e, rid)
            changed.add(i)
            heapq.heappush(heap, (e.n, i))
        for i in changed:
            self._schedule(i, self.engines[i])

    def _running(self) -> int:
        return sum(e.n for e in self.engines if e is not None)

    # -- the event loop ---------------------------------------------------------------------
    def _push(self, at: float, kind: int, data: Any) -> None:
        self._seq_no += 1
        heapq.heappush(self.events, (at, kind, self._seq_no, data))

    def run(self) -> AsyncRun:
        engines = self.split.rollout // self.gpe
        self.engines: list[_Engine | None] = [_Engine(0.0) for _ in range(engines)]
        self.events: list[tuple[float, int, int, Any]] = []
        self._seq_no = 0
        self.version = self.syncs = self.started = self.next_new = self.resumed = 0
        self._set_gate()
        self.resume: deque[int] = deque()
        self.paused = self.sync_wanted = self.syncing = False
        self.done: deque[int] = deque()
        self.step = self.mini = 0
        self.busy = False  # the trainer trains, syncs, or switches its devices
        self.busy_s = 0.0
        self.collecting: tuple[float, int] | None = None  # (since, samples queued then)
        self.cycle_wait: tuple[float, int] = (0.0, 0)  # verl's step_wait_times / step_wait_samples, summed
        self.hybrids: list[int] = []
        self.activating = self.home_wanted = False
        self.hybrid_since = 0.0
        self.loans, self.hybrid_s = 0, 0.0
        self.loan_reasons: list[str] = []
        self.step_end: list[float] = []
        self.recent: list[StepTiming] = []  # the cycles as the verl integration reports them
        self.home_at: int | None = None  # queued samples at which lent trainers go home (home_rule)
        self.cycle_start = self.cycle_train_began = 0.0
        self.cycle_train_s = self.cycle_lent_s = 0.0
        self.cycle_generated = 0
        self.free_trainers = tuple(f"t{d}" for d in range(self.split.train))
        k = self.spec.sync_every
        self.mb_sizes = [[len(c) for c in np.array_split(np.arange(s), k)] for s in self.S]
        self._fill_all(0.0)
        self._observe(0.0)
        self._try_train(0.0)
        steps = len(self.S)
        while self.events and len(self.step_end) < steps:
            now, kind, _, data = heapq.heappop(self.events)
            if kind == 0:  # an engine's next request finished
                i, epoch = data
                e = self.engines[i]
                if e is None or epoch != e.epoch:
                    continue
                self._finish(i, e, now)
            elif kind == 1:  # a mini-batch trained
                self._trained(now)
            elif kind == 2:  # the weight sync to the rollout's engines ended
                self._synced(now)
            elif kind == 3:  # the hybrid replicas are awake with the new weights
                self._hybrids_in(now)
            elif kind == 4:  # the trainers are home
                self._idle(now)
        if len(self.step_end) < steps:
            raise RuntimeError(f"the fully-async run stalled at step {len(self.step_end)} of {steps} "
                               f"(started {self.started}, done {len(self.done)}, running {self._running()})")
        busy = sum(e.busy_s for e in self.engines[:engines] if e is not None)
        total = float(self.step_end[-1])
        return AsyncRun(total_time_s=total, split=self.split, tp=self.gpe, step_end_s=[float(t) for t in self.step_end],
                        loans=self.loans, hybrid_device_s=float(self.hybrid_s), rollout_busy_s=float(busy),
                        trainer_wait_s=float(total - self.busy_s), ledger=self._ledger(), loan_reasons=self.loan_reasons)

    def _finish(self, i: int, e: _Engine, now: float) -> None:
        self._advance(e, now)
        e.clock = max(e.clock, e.heap[0][0])  # the event was scheduled for this finish
        while e.heap and e.heap[0][0] <= e.clock:
            _, rid = heapq.heappop(e.heap)
            e.n -= 1
            e.a -= self.Pl[rid] + self.generated[rid] - self.admitted_clock[rid]
            self.generated[rid] = self.Ll[rid]
            self.v_end[rid] = self.version
            self.finished[rid] += 1
            self.done.append(rid)
            self.cycle_generated += 1
        if not e.n:
            e.a = 0.0
        self._schedule(i, e)
        self._fill(i, now)
        if self.sync_wanted and not self.syncing and self._running() == 0:
            self._start_sync(now)
        self._observe(now)
        self._try_train(now)

    # -- the trainer --------------------------------------------------------------------------
    def _work(self, now: float, seconds: float, kind: int) -> None:
        self.busy = True
        self.busy_s += seconds
        self._push(now + seconds, kind, None)

    def _idle(self, now: float) -> None:
        self.busy = False
        self._try_train(now)

    def _try_train(self, now: float) -> None:
        """verl's `fit_step`: lent trainers come home once the samples the rule waits for are
        queued; then the mini-batch is collected (the wait measured as verl's
        `_get_samples_from_queue` does) and trained."""
        if self.busy or self.activating or self.step >= len(self.S):
            return
        if self.hybrids:
            if self.home_wanted:
                self._go_home(now)
            return
        need = self.mb_sizes[self.step][self.mini]
        if self.collecting is None:
            self.collecting = (now, len(self.done))
        if len(self.done) < need:
            return
        since, queued = self.collecting
        self.collecting = None
        if queued < need:
            waited, samples = self.cycle_wait
            self.cycle_wait = (waited + now - since, samples + need - queued)
        batch = [self.done.popleft() for _ in range(need)]
        for rid in batch:
            self.trained_by[rid] = self.step
        if self.mini == 0:
            self.cycle_train_began = now
        seconds = float(self.train_work[batch].sum()) / self.train_rate + self.overhead / self.spec.sync_every
        self.cycle_train_s += seconds
        self._work(now, seconds, 1)

    def _trained(self, now: float) -> None:
        self.busy = False
        self.mini += 1
        if self.mini < self.spec.sync_every:
            self._try_train(now)
            return
        self._decide_loan(now)
        self.busy = self.sync_wanted = True
        if self.spec.partial_rollout:
            for i, e in enumerate(self.engines):
                if e is not None and e.n:
                    self.resume.extendleft(reversed(self._abort_all(i, now)))
            self._start_sync(now)
        elif self._running() == 0:
            self._start_sync(now)
        else:
            self.paused = True  # nothing new starts; the sync waits for the running requests

    def _start_sync(self, now: float) -> None:
        self.paused = self.syncing = True
        self.busy_s += self.sync_s
        self._push(now + self.sync_s, 2, None)

    def _synced(self, now: float) -> None:
        """The standalone engines have the new weights and go on; the cycle ends here, or once
        the hybrid replicas are awake (verl activates them before `reset_staleness`)."""
        self.version += 1
        self.sync_wanted = self.syncing = self.paused = False
        for e in self.engines:
            if e is not None:
                e.t = max(e.t, now)
        if self.activating:
            self.busy_s += self.to_rollout_s
            self._push(now + self.to_rollout_s, 3, None)
        self._fill_all(now)
        if not self.activating:
            self._end_cycle(now)

    def _end_cycle(self, now: float) -> None:
        self.step_end.append(now)
        self.syncs += 1
        self._set_gate()
        self.step += 1
        self.mini = 0
        self.busy = False
        self.cycle_wait = (0.0, 0)
        self._fill_all(now)
        self._observe(now)
        self._try_train(now)

    # -- hybrid replicas (loans of the trainers to the rollout) -------------------------------
    def _view(self, now: float) -> LoanView:
        lent = self.split.train if (self.hybrids or self.activating) else 0
        step = self.step + (1 if self.mini >= self.spec.sync_every else 0)
        total = self.S[step] if step < len(self.S) else 0
        trained = min(self.mini, self.spec.sync_every)
        return LoanView(now=now, split=self.split, idle_engines=(),
                        free_trainers=self.free_trainers if not lent else (),
                        training_devices=self.split.train - lent, mini_batch_done=trained,
                        mini_batch_total=self.spec.sync_every if step > 0 else 0, mini_batch_s=0.0,
                        queue_empty=False, costs=self.costs, rollout_costs=self.costs, rollout_step=step,
                        samples_done=len(self.done), samples_total=total,
                        tail_binds=costmodel.tail_binds(self.spec))

    def _decide_loan(self, now: float) -> None:
        """After a cycle's last mini-batch, before the sync (verl's `should_activate_after_step`,
        with the cycle's waits as verl measured them; the daemon's policy reads the cycle as the
        verl integration reports it, `core.cycles.cycle_timing`)."""
        if self.policy is None or self.split.train < self.gpe or self.step + 1 >= len(self.S):
            self._new_cycle(now)
            return
        view = self._view(now)
        rule = self.home_rule if self.home_rule is not None else self.policy
        rule.record_wait(self.step, *self.cycle_wait)
        home_at = None
        if self.home_rule is not None:
            self.home_rule.propose_loan(view)  # verl's ratio adapts; the daemon decides
            home_at = int(self.S[self.step + 1] * self.home_rule.deactivate_ratio)
            self.recent.append(cycle_timing(
                self.step, self.split.rollout, self.split.train, period_s=now - self.cycle_start,
                train_s=self.cycle_train_s, lent_s=self.cycle_lent_s, required=self.S[self.step],
                generated=self.cycle_generated, waited=self.cycle_wait[1] > 0, weight_sync_s=self.sync_s,
                queued=len(self.done), home_at=home_at))
            view = msgspec.structs.replace(view, recent=tuple(self.recent[-8:]),
                                           step_started_at=self.cycle_train_began)
        proposal = self.policy.propose_loan(view)
        self._new_cycle(now)
        if proposal is None or proposal.to_pool != Pool.ROLLOUT.value:
            return
        if not proposal.saves_s > proposal.cost_s * self.loan_safety:
            return
        self.activating = True
        self.home_wanted = False
        self.home_at = home_at
        self.loans += 1
        self.loan_reasons.append(proposal.reason)

    def _new_cycle(self, now: float) -> None:
        self.cycle_start = now
        self.cycle_train_s = self.cycle_lent_s = 0.0
        self.cycle_generated = 0

    def _hybrids_in(self, now: float) -> None:
        """The trainers serve as engines of the rollout's size; with verl's rebalance every
        running request is aborted and resumed on the least-loaded engine."""
        self.activating = False
        for _ in range(self.split.train // self.gpe):
            self.engines.append(_Engine(now))
            self.hybrids.append(len(self.engines) - 1)
        self.hybrid_since = now
        if getattr(self.policy, "rebalances", False):
            for i, e in enumerate(self.engines):
                if e is not None and e.n:
                    self.resume.extendleft(reversed(self._abort_all(i, now)))
        self._end_cycle(now)

    def _observe(self, now: float) -> None:
        """A progress report to the loan policy; once it says the lent trainers go home, they
        do as soon as the trainer is ready for its next mini-batch."""
        if self.policy is None:
            return
        if self.home_rule is not None:
            if self.home_at is not None and (self.hybrids or self.activating) and len(self.done) >= self.home_at:
                self.home_wanted = True
            return
        if self.policy.observe_progress(self._view(now)) and (self.hybrids or self.activating):
            self.home_wanted = True

    def _go_home(self, now: float) -> None:
        back: list[int] = []
        for i in self.hybrids:
            back.extend(self._abort_all(i, now))
            self.engines[i] = None
        self.resume.extendleft(reversed(back))
        self.hybrid_s += (now - self.hybrid_since) * len(self.hybrids) * self.gpe
        self.cycle_lent_s += now - self.hybrid_since
        self.hybrids = []
        self.home_wanted = False
        self.home_at = None
        self._work(now, self.home_s, 4)
        self._fill_all(now)

    # -- the proof ------------------------------------------------------------------------------
    def _ledger(self) -> SampleLedger:
        finished, trained_by = np.array(self.finished), np.array(self.trained_by)
        v_start, v_end = np.array(self.v_start), np.array(self.v_end)
        done = finished > 0
        trained = trained_by >= 0
        steps_trained = int(trained.sum())
        stale = (trained_by - v_start)[trained]
        return SampleLedger(
            samples=self.samples,
            generated_once=bool((finished[trained] == 1).all() and (finished <= 1).all()),
            trained_once=bool(steps_trained == int(self.cum[len(self.step_end)])
                              and (done[trained]).all()),
            never_future_weights=bool((v_end[trained] <= trained_by[trained]).all()),
            max_staleness=int(stale.max()) if stale.size else 0,
            resumed=self.resumed,
            spanning_versions=int((v_end[trained] > v_start[trained]).sum()),
        )


def async_total(model: StageModel, split: Split, spec: PipelineSpec) -> float:
    """Total seconds of the fully-async pipeline on a fixed split, no loans."""
    return AsyncPipeline(model, split, spec).run().total_time_s


def async_best_static(model: StageModel, gpus: int, spec: PipelineSpec,
                      sizes: list[int] | None = None) -> tuple[Split, int, float]:
    """The fastest fixed split x engine size in this pipeline: (split, tp, total seconds). The
    total is searched over the training pool's size coarse to fine (it falls, then rises)."""
    best: tuple[Split, int, float] | None = None
    for m in model.variants(gpus - 1) if sizes is None else [model.at_tp(k) for k in sizes]:
        gpe = m.profile.rollout.gpus_per_engine
        trains = [t for t in range(1, gpus) if (gpus - t) % gpe == 0 and gpus - t >= gpe]
        if not trains:
            continue
        cache: dict[int, float] = {}

        def total(t: int) -> float:
            if t not in cache:
                cache[t] = async_total(m, Split(t, gpus - t), spec)
            return cache[t]

        stride = max(1, len(trains) // 8)
        probe = trains[::stride]
        centre = min(probe, key=total)
        j = trains.index(centre)
        lo, hi = max(0, j - stride), min(len(trains) - 1, j + stride)
        t = min(trains[lo:hi + 1], key=total)
        if best is None or total(t) < best[2]:
            best = (Split(t, gpus - t), gpe, total(t))
    if best is None:
        raise ValueError(f"no split of {gpus} devices fits an engine and a trainer")
    return best


def async_fluid_bound(model: StageModel, gpus: int, spec: PipelineSpec) -> float:
    """A time no schedule of this pipeline beats: the run's device-work (every rollout at full
    utilisation on the cheapest engine size, every training step with no data-parallel loss)
    spread over all devices, or the trainer's fixed overheads in a row, whichever is longer,
    plus one weight sync a step, during which no device works (the rollouter is paused, the
    trainer syncs)."""
    models = model.variants(gpus)
    work = float(np.min([m.rollout_work_table() for m in models], axis=0).sum())
    train = sum(model.train_work(i) for i in range(model.steps))
    chain = model.steps * model.profile.training.step_overhead_s
    return max((work + train) / gpus, chain) + model.steps * model.weight_sync_s
