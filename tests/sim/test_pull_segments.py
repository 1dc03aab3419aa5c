"""The pull router's schedules (`pull_schedule`, `pull_segments`: they simulate only the slots
that run something) against the router as first written, every slot of every engine its own
heap entry: the same placements and segments, in the same order, for random steps, late
engines, stops and rebalances."""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.sim.stages import Intervention, pull_schedule, pull_segments


def slot_by_slot(lengths, engines, slots, offsets, interventions):
    """Every slot its own heap entry from the start (the router as first written)."""
    n, width = len(lengths), engines * slots
    queue: deque[tuple[int, int]] = deque(zip(range(n), [0] * n))
    running: list[tuple[int, float, int] | None] = [None] * width  # (request, started, generated before)
    version = [0] * width
    alive = [True] * engines
    heap = [(float(offsets[s % engines]), s, 0) for s in range(width)]
    heapq.heapify(heap)
    idle: set[int] = set()
    done_at = np.full(n, np.nan)
    segments: list[tuple[int, int, float, float, int, int]] = []
    pending = sorted(interventions, key=lambda x: x.at)

    def begin(slot: int, t: float) -> None:
        j, gen = queue.popleft()
        running[slot] = (j, t, gen)
        version[slot] += 1
        heapq.heappush(heap, (t + lengths[j] - gen, slot, version[slot]))

    def abort(slot: int, t: float) -> tuple[int, int]:
        j, started, gen = running[slot]  # type: ignore[misc]
        made = gen + int(t - started)
        segments.append((j, slot % engines, started, t, gen, made))
        running[slot] = None
        version[slot] += 1
        return j, made

    while heap or pending:
        if pending and (not heap or pending[0].at <= heap[0][0]):
            x = pending.pop(0)
            hit = [s for s in range(width) if running[s] is not None and alive[s % engines]
                   and (x.rebalance or s % engines in x.stop)]
            requeued = [abort(s, x.at) for s in hit]
            queue.extendleft(reversed(requeued))
            for e in x.stop:
                alive[e] = False
            if x.rebalance:  # every slot that has started takes from the queue again, engine by engine
                free = [s for s in range(width) if alive[s % engines] and offsets[s % engines] <= x.at]
                for slot in free:
                    version[slot] += 1
            else:
                free = sorted(s for s in idle if alive[s % engines])
            idle.difference_update(free)
            for slot in free:
                if queue:
                    begin(slot, x.at)
                else:
                    idle.add(slot)
            continue
        t, slot, ver = heapq.heappop(heap)
        if ver != version[slot] or not alive[slot % engines]:
            continue
        if running[slot] is not None:
            j, started, gen = running[slot]  # type: ignore[misc]
            segments.append((j, slot % engines, started, t, gen, lengths[j]))
            done_at[j] = t
            running[slot] = None
        if queue:
            begin(slot, t)
        else:
            idle.add(slot)
    if np.isnan(done_at).any():
        raise ValueError("every engine stopped before the step's requests were done")
    return done_at, segments


def every_slot(lengths, engines, slots, offsets):
    """`pull_schedule` with every slot a heap entry from its engine's offset."""
    heap = [(offsets[s % engines], s) for s in range(engines * slots)]
    heapq.heapify(heap)
    placement, done_at = [], []
    for length in lengths:
        t, s = heap[0]
        placement.append(s % engines)
        done_at.append(t + length)
        heapq.heapreplace(heap, (t + length, s))
    return placement, done_at


@st.composite
def steps(draw):
    engines = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 60), min_size=1, max_size=80))
    offsets = draw(st.lists(st.integers(0, 40), min_size=engines, max_size=engines))
    offsets[draw(st.integers(0, engines - 1))] = 0  # one engine serves from the start
    plan = []
    if draw(st.booleans()):
        plan.append(Intervention(at=float(draw(st.integers(0, 80))), rebalance=True))
    if draw(st.booleans()) and engines > 1:
        home = draw(st.integers(0, engines - 1))
        stop = frozenset(draw(st.sets(st.sampled_from([e for e in range(engines) if e != home]), min_size=1)))
        plan.append(Intervention(at=float(draw(st.integers(0, 80))), stop=stop))
    return lengths, engines, slots, offsets, plan


@settings(max_examples=400, deadline=None)
@given(steps())
def test_only_the_slots_that_run_something_are_simulated_and_nothing_changes(step):
    lengths, engines, slots, offsets, plan = step
    done, segments = pull_segments(lengths, engines, slots, offsets, plan)
    want_done, want_segments = slot_by_slot(lengths, engines, slots, offsets, plan)
    assert segments == want_segments
    assert np.array_equal(done, want_done)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_late_engines_take_requests_in_the_order_every_slot_would(step):
    lengths, engines, slots, offsets, _ = step
    placement, done_at, finish = pull_schedule(lengths, engines, slots, offsets)
    want_placement, want_done = every_slot(lengths, engines, slots, offsets)
    assert placement.tolist() == want_placement and done_at.tolist() == want_done
    assert (finish >= np.array(offsets)).all()


def test_a_wide_cluster_with_few_requests_costs_the_requests_not_the_slots():
    """768 engines of 256 slots and 1,024 requests: the old router heapified 196,608 slots."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4000, size=1024).tolist()
    offsets = [0] * 700 + [50] * 68
    plan = [Intervention(at=100.0, rebalance=True), Intervention(at=900.0, stop=frozenset(range(700, 768)))]
    done, segments = pull_segments(lengths, 768, 256, offsets, plan)
    want_done, want_segments = slot_by_slot(lengths, 768, 256, offsets, plan)
    assert segments == want_segments and np.array_equal(done, want_done)
    placement, done_at, _ = pull_schedule(lengths, 768, 256, offsets)
    assert (placement.tolist(), done_at.tolist()) == every_slot(lengths, 768, 256, offsets)
