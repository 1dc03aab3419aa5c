"""The pull router's schedules (`pull_schedule`, `pull_segments`: event-driven, and only the
slots that run something are simulated) against the router iteration by iteration, every slot
of every engine looked at in order: the same placements and segments, in the same order, for
random steps, late engines, stops and rebalances."""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.sim.stages import Intervention, hold_share, pull_schedule, pull_segments


def starts(lengths, engines, slots, offsets):
    """When each slot first takes a request: its engine's offset, and for a slot beyond the
    engine's share of the step, not before the last late engine starts (`hold_share`)."""
    hold = hold_share(len(lengths), offsets, slots, None)
    return {s: offsets[s % engines] if hold is None or s // engines < hold[1] else max(offsets[s % engines], hold[0])
            for s in range(engines * slots)}


def tick_by_tick(lengths, engines, slots, offsets, interventions):
    """The router iteration by iteration: at each iteration t, the interventions due, then every
    slot in order that comes free at t (its request done, or its engine starting) takes the next
    queued request; a slot that finds the queue empty stays idle until an intervention. (It
    skips the iterations at which nothing comes free and nothing intervenes.)"""
    n, width = len(lengths), engines * slots
    queue = deque((j, 0) for j in range(n))
    running = {}  # slot -> (request, started, generated before)
    free_at = starts(lengths, engines, slots, offsets)  # slots that will come free, and when
    idle, alive = set(), [True] * engines
    done_at, segments = np.full(n, np.nan), []
    pending = sorted(interventions, key=lambda x: x.at)

    def begin(s, t):
        j, gen = queue.popleft()
        running[s] = (j, t, gen)
        free_at[s] = t + lengths[j] - gen

    t = 0
    while free_at or pending:
        while pending and pending[0].at <= t:
            x = pending.pop(0)
            requeued = []
            for s in sorted(running):
                if alive[s % engines] and (x.rebalance or s % engines in x.stop):
                    j, started, gen = running.pop(s)
                    made = gen + int(x.at - started)
                    segments.append((j, s % engines, started, x.at, gen, made))
                    requeued.append((j, made))
                    free_at.pop(s)
            queue.extendleft(reversed(requeued))
            for e in x.stop:
                alive[e] = False
            if x.rebalance:
                takers = [s for s in range(width) if alive[s % engines] and offsets[s % engines] <= x.at]
                for s in takers:
                    free_at.pop(s, None)
                    idle.discard(s)
            else:
                takers = sorted(s for s in idle if alive[s % engines])
                idle.difference_update(takers)
            for s in takers:
                if queue:
                    begin(s, x.at)
                else:
                    idle.add(s)
        while due := [s for s, at in free_at.items() if at == t]:  # lowest slot first, again after each
            s = min(due)
            del free_at[s]
            if not alive[s % engines]:
                running.pop(s, None)
                continue
            if s in running:
                j, started, gen = running.pop(s)
                segments.append((j, s % engines, started, float(t), gen, lengths[j]))
                done_at[j] = t
            if queue:
                begin(s, float(t))
            else:
                idle.add(s)
        # the next iteration at which anything happens (the ones between change nothing)
        t = min([*free_at.values(), *(x.at for x in pending[:1])], default=t + 1)
    if np.isnan(done_at).any():
        raise ValueError("every engine stopped before the step's requests were done")
    return done_at, segments


def every_slot(lengths, engines, slots, offsets):
    """`pull_schedule` with every slot a heap entry from when it starts (`starts`)."""
    heap = [(t, s) for s, t in starts(lengths, engines, slots, offsets).items()]
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
    want_done, want_segments = tick_by_tick(lengths, engines, slots, offsets, plan)
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
    """64 engines of 64 slots and 300 requests, engines late, a rebalance, half of them stopped."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 120, size=300).tolist()
    offsets = [0] * 40 + [7] * 24
    plan = [Intervention(at=10.0, rebalance=True), Intervention(at=60.0, stop=frozenset(range(32, 64)))]
    done, segments = pull_segments(lengths, 64, 64, offsets, plan)
    want_done, want_segments = tick_by_tick(lengths, 64, 64, offsets, plan)
    assert segments == want_segments and np.array_equal(done, want_done)
    placement, done_at, _ = pull_schedule(lengths, 64, 64, offsets)
    assert (placement.tolist(), done_at.tolist()) == every_slot(lengths, 64, 64, offsets)


def test_an_engine_coming_home_late_finds_its_share_still_queued():
    """Two engines, eight requests of 100 tokens, slots for all of them on one engine: engine 1
    comes home 10 iterations late. The router holds its share (4) for it instead of engine 0
    running all eight; an engine lent in mid-step (not one of the step's `home` engines) is
    not waited for."""
    lengths = [100] * 8
    placement, _, finish = pull_schedule(lengths, 2, 8, [0, 10])
    assert placement.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and finish.tolist() == [100.0, 110.0]
    assert hold_share(8, [0, 10], 8, None) == (10.0, 4)
    placement, _, finish = pull_schedule(lengths, 2, 8, [0, 10], home=1)
    assert placement.tolist() == [0] * 8 and finish.tolist() == [100.0, 10.0]
    assert hold_share(8, [0, 10], 4, None) is None, "a share that fills every slot holds nothing"
    done, _ = pull_segments(lengths, 2, 8, [0, 10], [])
    assert done.tolist() == [100.0] * 4 + [110.0] * 4
