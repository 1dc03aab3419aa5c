"""Regroups in the dynamic mode: the engines of several devices the core learns (at the start,
and where a resize brings devices to the rollout), the layout advisor's regroups between steps,
and a step's tail regrouped into one wider engine (`TailTimeline`, one window's rollout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dynaresized.core import Phase
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.domain import Pool
from dynaresized.sim.stages import busy_s, contexts
from dynaresized.sim.workers import SimWorkers

if TYPE_CHECKING:
    from dynaresized.sim.lending import Lending
    from dynaresized.sim.pipeline import Layout


MEASURED_STEPS = 10
"""A tail's estimate of a running request's tokens left reads the response lengths of this many
steps before the one in progress (`remaining_tokens`)."""


GRID_POINTS = 256
"""Points of the grid of tokens left on which `remaining_tokens` integrates."""


def remaining_tokens(generated: np.ndarray, measured: np.ndarray, max_tokens: int) -> int:
    """What an engine can say of how many tokens its longest running request has left, from
    what it knows: each running request's tokens so far (`generated`), `max_tokens`, and the
    response lengths measured on recent steps (`measured`, any order); never the lengths still
    to come. A request of g tokens so far ends at a length drawn from the measured lengths above
    g (where none is above g: anywhere up to `max_tokens`, uniformly), never past `max_tokens`;
    the requests independent, the answer is the expected tokens left of the last to finish
    (the integral of P(max > x) over a grid of `GRID_POINTS`), at least one."""
    g = np.asarray(generated, dtype=np.float64)
    if g.size == 0:
        return 0
    room = np.maximum(float(max_tokens) - g, 1.0)
    lengths = np.sort(np.asarray(measured, dtype=np.float64))
    x = np.linspace(0.0, float(room.max()), GRID_POINTS + 1)
    below = np.searchsorted(lengths, g, side="right")  # measured lengths the request has passed
    above = len(lengths) - below
    reached = np.searchsorted(lengths, g[:, None] + x[None, :], side="right")
    cdf = np.where(above[:, None] > 0, (reached - below[:, None]) / np.maximum(above, 1)[:, None],
                   x[None, :] / room[:, None])
    cdf = np.where(x[None, :] >= room[:, None], 1.0, np.minimum(cdf, 1.0))  # max_tokens cuts it there
    tail = 1.0 - cdf.prod(axis=0)  # P(the last request has more than x tokens left)
    expected = float(np.sum((tail[1:] + tail[:-1]) / 2.0 * np.diff(x)))
    return max(int(np.ceil(expected)), 1)


class TailTimeline:
    """One window's rollout request by request, for tail regroups. When an engine runs dry, every
    engine still decoding first says how many requests it runs and how many tokens the longest
    has left, as far as it can know (`remaining_tokens`: its requests' tokens so far,
    `max_tokens` and the recent steps' lengths, never the lengths still to come; the router knows
    every engine's requests); when the core then starts a tail
    regroup (`propose_tail`), the busy engine's running requests decode from then on one wider
    engine of its devices and the idle engines', after the switch, and the window's rollout
    ends when the slowest engine does. Before any engine runs dry nothing is reported, as
    without tail regroups, so that a run where none pays is the run without them."""

    def __init__(self, pipe: Lending, w: int, start: float, finish: np.ndarray,
                 groups: dict[int, list[str]], late: np.ndarray, idle_at: list[tuple[float, int]]) -> None:
        self.pipe, self.w, self.start, self.finish, self.groups = pipe, w, start, finish, groups
        self.idle_at = idle_at  # the window's engines by when they run dry (shared with it)
        model = pipe.model
        self.penalty = pipe._penalty[Pool.ROLLOUT]
        self.schedule, self.start_s, self.pace, self.queue_empty_s = model.pull_timeline(w, len(groups), late)
        self.lengths = model.trace.steps[w].response_tokens.astype(np.float64)
        self.prompts = model.trace.steps[w].prompt_tokens.astype(np.float64)
        # what the engines have measured: the lengths of the steps generated before this one
        recent = model.trace.steps[max(w - MEASURED_STEPS, 0):w]
        self.measured = (np.concatenate([b.response_tokens for b in recent]).astype(np.float64) if recent
                         else np.zeros(0))
        self.max_tokens = model.profile.workload.max_response_tokens
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
            # tokens each running request has made so far (the present, which the engine knows)
            generated = self.lengths[run] - (self.schedule.done_s[run] - now) / self.pace[e]
            left = remaining_tokens(generated, self.measured, self.max_tokens)
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


class Regroups(SimWorkers):
    """The regroups of a run (`pipeline.DynamicPipeline`, whose `__init__` sets the state below)."""

    layout: Layout | None

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
        resize's restore starts them so), with any device of the pool left out of an engine so
        far (a start whose rollout pool is not whole engines): the core learns them once nothing
        is in flight, so that its engines are the `StageModel`'s (devices // size of them)."""
        if self._arrived and self.state.inflight is None:
            self._arrived = False
            gpe = self.model.profile.rollout.gpus_per_engine
            s = self.state
            single = sorted((d for d, p in s.devices.items()
                             if p.pool is Pool.ROLLOUT and p.home is None and len(s.engine_of(d)) < gpe),
                            key=self.index.__getitem__)
            self._form_engines(tuple(single[:len(single) // gpe * gpe]), at,
                               "engines started on devices a resize brought to the rollout")

    def _engine_groups(self, devices: list[str]) -> list[tuple[str, ...]]:
        """The rollout engines `devices` (the pool's, in device order) form, as many as the
        `StageModel` prices (devices // the profile's size), each its leader first: the core's
        engines of that size, in their leaders' order, then the rest in device order (the core
        forms arrived devices into engines only once nothing is in flight)."""
        gpe = self.model.profile.rollout.gpus_per_engine
        count = self.model.engines(len(devices))
        if gpe == 1:
            return [(d,) for d in devices[:count]]
        inside = set(devices)
        engines = {g for d in devices if len(g := self.state.engine_of(d)) == gpe and inside.issuperset(g)}
        taken = {d for g in engines for d in g}
        rest = [d for d in devices if d not in taken]
        groups = [*engines, *(tuple(rest[i:i + gpe]) for i in range(0, len(rest) // gpe * gpe, gpe))]
        return sorted(groups, key=lambda g: self.index[g[0]])[:count]

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

