"""A window of the dynamic mode with loans: idle engines lent to training at its mini-batch
boundaries, trainers with nothing to train lent to the rollout while its queue lasts, and the
engines' progress reports, on which a policy that reads them may send lent trainers home."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.policy import Policy
from dynaresized.domain import PlanKind, Pool, Split
from dynaresized.sim.regroups import TailTimeline
from dynaresized.sim.workers import SimWorkers, engine_id

if TYPE_CHECKING:
    from dynaresized.sim.stages import EngineSchedule

PROGRESS_POINTS = 128
"""Engines report their sample counts this many times per rollout step (at every 1/128 of its
samples), to a policy that reads progress: fine enough for verl's rules (verl polls its queue
once a second), coarse enough to keep a run to seconds."""


class Lending(SimWorkers):
    """The windows of a run whose policy lends (`pipeline.DynamicPipeline`, whose `__init__` sets
    the state below)."""

    policy: Policy
    tracks_progress: bool
    tails: bool
    _home_engines: list[str]
    _schedule_w: EngineSchedule | None
    _queue_empty_w: float  # seconds into the window at which its rollout's queue empties...
    _queue_last_engine: int  # ...and the engine that pulled its last request
    paces: bool
    _tail_landed: float | None
    tail_regroups: list[tuple[int, float]]

    def _window_with_loans(self, w: int, start: float, split: Split) -> tuple[float, float, int, float, float]:
        """Window w with idle engines lent to training step w-1 at its mini-batch boundaries,
        and trainers with nothing to train (window 0, or after the last mini-batch) lent to the
        rollout while its queue lasts. Engines report when they run dry, the trainer when its
        step begins and after every mini-batch; the core and the policy decide; a loan's JOIN
        to training lands at the first boundary after its ops are done, one to the rollout
        pulls queued requests once its ops are done. Returns (rollout seconds, training
        seconds, devices lent, device-seconds that served the rollout, device-seconds that
        served the training: engines lent to it from when they joined)."""
        model, profile = self.model, self.model.profile
        mbs = profile.training.mini_batches_per_step
        if self.tracks_progress and w < model.steps:
            # The step's requests are queued: each engine says it has done none of them yet.
            total = int(model.samples[w])
            home = sorted((d for d, p in self.state.devices.items() if (p.home or p.pool) is Pool.ROLLOUT),
                          key=self.index.__getitem__)
            for group in self._engine_groups(home):
                self._feed(ev.ProgressReported(at=start, worker_id=engine_id(self.index[group[0]]), step=w, done=0,
                                               total=total))
        # The trainer says its step begins (window 0: that it has nothing to train yet); its
        # devices lent to the rollout in window 0 come home first, and the step pays their way.
        self._feed(ev.MiniBatchDone(at=start, worker_id=self._reporter(), step=max(w - 1, 0), done=0,
                                    total=0 if w == 0 else mbs))
        self._ack_until(start)
        rollout_devs = sorted(self.state.pool_devices(Pool.ROLLOUT), key=self.index.__getitem__)
        engines = model.engines(len(rollout_devs))
        groups = dict(enumerate(self._engine_groups(rollout_devs)))
        late = np.array([max(self._late.get(d, 0.0) for d in groups[e]) for e in range(engines)])
        self._late.clear()
        self._home_engines = [engine_id(self.index[groups[e][0]]) for e in range(engines)]
        self._schedule_w = None
        if w < model.steps:
            if self.paces:
                self._schedule_w, starts, _, self._queue_empty_w = model.pull_timeline(w, engines, late)
                self._queue_last_engine = int(self._schedule_w.placement[int(np.argmax(starts))])
            elif self.tracks_progress:
                self._schedule_w = model.engine_schedule(w, engines, late)
            # the request-by-request schedule's engine finishes are `engine_finish`'s, computed once
            finish = (self._schedule_w.finish_s if self._schedule_w is not None
                      else model.engine_finish(w, engines, late)) + self._penalty[Pool.ROLLOUT]
        else:
            finish = late.copy()  # the last window only trains: every engine is idle at once
        rollout_s = float(finish.max()) if w < model.steps else 0.0
        served = rollout_s * len(rollout_devs)
        if w == 0:
            rollout_s, served, lent = self._lend_to_rollout(w, start, rollout_s, len(rollout_devs), late, 0.0)
            return rollout_s, 0.0, lent, served, 0.0
        idle_at = sorted((float(finish[e]), e) for e in range(engines))
        self._tail_pending.clear()
        tail = (TailTimeline(self, w, start, finish, groups, late, idle_at)
                if self.tails and w < model.steps and engines >= 1 else None)
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
        joins: list[tuple[float, int]] = []  # (seconds into the window, devices) of engines joining training
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
                joins.append((t, joined))
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
        train_served = split.train * train_s + sum(k * max(train_s - at, 0.0) for at, k in joins)
        return rollout_s, train_s, lent, served, train_served

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
        if landed is None and self.paces and self._schedule_w is not None and w < self.model.steps:
            landed, since = self._paced_loan(w, start, since, penalty)
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
            schedule = model.engine_schedule(w, home + extra, offsets, rebalance_at_s=rebalance, home=home)
            # what was done by the time they are in, then as it comes
            back = self._report_progress(w, start, workers, schedule, penalty, -math.inf, ready, snapshot=True,
                                         watch=True)
            if back is None:
                back = self._report_progress(w, start, workers, schedule, penalty, ready, math.inf, watch=True)
            if back is not None:
                stops = frozenset(range(home, home + extra))
                schedule = model.engine_schedule(w, home + extra, offsets, rebalance_at_s=rebalance,
                                                 stop_at_s=back - penalty, stopping=stops, home=home)
                self._report_rest(w, start, workers, schedule, penalty, back)
                lent_done = start + float(schedule.finish_s[home:].max()) + penalty
                at_home, paid = self._early_home or (start + back, 0.0)
                self._early_home = (max(at_home, lent_done), paid)
            finish = schedule.finish_s
        else:
            finish = model.engine_finish(w, home + extra, offsets, home=home)
        finish = finish + penalty
        busy = finish[home:] > ready + penalty
        rollout_s = float(max(finish[:home].max(), finish[home:][busy].max() if busy.any() else 0.0))
        # each lent engine served while it decoded what it pulled, not for the rest of the
        # rollout: one that pulled a few requests and ran dry adds its busy seconds only
        busy_s = np.maximum(finish[home:] - (ready + penalty), 0.0)
        served = rollout_s * home_devices + gpe * float(busy_s.sum())
        return rollout_s, served, len(devices)

    def _paced_loan(self, w: int, start: float, since: float,
                    offset: float) -> tuple[tuple[float, tuple[str, ...]] | None, float]:
        """While the trainers wait and the rollout's queue still holds requests, the engines'
        progress reports (every 1/`PROGRESS_POINTS` of the samples) reach the core, which asks
        a policy that lends from the step's pace again (`core.loans.paced`); where a loan to the
        rollout starts on one, (when it landed, its devices), else None; and the seconds into
        the window reported up to. The queue's emptying is reported as the daemon's router
        reports it (the engine that pulled the last request says so, with what it still runs):
        no loan to the rollout is asked after it."""
        empty = self._queue_empty_w + offset
        asked = None
        if empty > since:
            asked = self._report_progress(w, start, self._home_engines, self._schedule_w, offset, since, empty,
                                          lend_watch=True)
        if asked is not None:
            return self._rollout_loan_landed(), asked
        until = max(empty, since)
        if self.state.dry_step < w:
            e, schedule = self._queue_last_engine, self._schedule_w
            running = int(((schedule.placement == e) & (schedule.done_s + offset > until)).sum())
            self._feed(ev.EngineQueueEmpty(at=start + until, worker_id=self._home_engines[e], step=w,
                                           running=running, tokens_left=0))
        return None, until

    def _report_progress(self, w: int, start: float, workers: list[str], schedule: EngineSchedule | None,
                         offset: float, since: float, until: float, *, snapshot: bool = False,
                         watch: bool = False, lend_watch: bool = False) -> float | None:
        """The engines report how many of step w's samples each has done, at every
        `1 / PROGRESS_POINTS` of the step's samples done in (since, until] (seconds into the
        window; `offset` shifts the schedule), or once at `until` (`snapshot`). With `watch`,
        stops at the first report on which the core starts sending lent devices home, and
        returns its time (their ops answered at once: the way home is charged by the window);
        with `lend_watch`, at the first on which it starts a loan to the rollout."""
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
            if lend_watch and fl is not None and fl.plan.kind is PlanKind.LOAN and fl.plan.to_pool is Pool.ROLLOUT:
                return True
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

