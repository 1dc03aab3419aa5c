"""The stage cost model: the closed-form decode time against an iteration-by-iteration
simulation, and the properties the lower bound relies on."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel, fifo_makespan, placement_at_submission, submitted_makespans
from dynaresized.sim.workload import StepBatch, Trace, scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")


def engine_by_iteration(prompts: list[int], lengths: list[int], slots: int) -> float:
    """One engine, one decode iteration at a time: FCFS admission up to `slots` running."""
    r = PROFILE.rollout
    waiting = list(range(len(lengths)))
    running: dict[int, int] = {}
    seconds = 0.0
    while waiting or running:
        while waiting and len(running) < slots:
            i = waiting.pop(0)
            running[i] = 0
            seconds += r.prefill_per_token_s * prompts[i]
        context = sum(prompts[i] + done for i, done in running.items())
        seconds += r.iter_base_s + r.iter_per_seq_s * len(running) + r.iter_per_ctx_token_s * context
        for i in list(running):
            running[i] += 1
            if running[i] == lengths[i]:
                del running[i]
    return seconds


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 8))
def test_fifo_makespan_matches_iterations(lengths, slots):
    iterations = 0
    waiting = list(lengths)
    running: list[int] = []
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        iterations += 1
        running = [left - 1 for left in running if left > 1]
    assert fifo_makespan(lengths, slots) == iterations


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 11)), min_size=1, max_size=60), st.integers(1, 4))
def test_makespans_of_placed_requests_are_each_engines_fifo(requests, slots):
    """The vectorized makespans (an engine with no more requests than slots: its longest) equal
    a FIFO per engine over its requests in order; an engine with none has 0."""
    lengths = np.array([n for n, _ in requests], dtype=np.int64)
    placement = np.array([e for _, e in requests], dtype=np.int64)
    expected = [fifo_makespan([int(n) for n, e in requests if e == k], slots) for k in range(12)]
    assert submitted_makespans(lengths, placement, 12, slots).tolist() == expected


@pytest.mark.parametrize("router", ["round-robin", "verl"])
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 60)), min_size=1, max_size=24), st.integers(1, 3))
def test_closed_form_rollout_equals_iteration_simulation(router, samples, engines):
    prompts = [p for p, _ in samples]
    lengths = [n for _, n in samples]
    batch = StepBatch(0, np.array(prompts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    model = StageModel(PROFILE, Trace("t", (batch,)), router=router)
    slots = int(model.batch_limit[0])
    placed = placement_at_submission(len(lengths), engines, router)
    sizes = np.bincount(placed, minlength=engines)
    if router == "round-robin":
        assert list(placed) == [j % engines for j in range(len(lengths))]
    else:
        # verl's DataProto.chunk: engine e runs one contiguous slice, sizes differing by at most one.
        assert list(placed) == sorted(placed) and sizes.max() - sizes.min() <= 1
    # Each engine runs its own requests FIFO; the slowest engine sets the rollout time.
    expected = max(
        engine_by_iteration([prompts[j] for j in np.flatnonzero(placed == e)],
                            [lengths[j] for j in np.flatnonzero(placed == e)], slots)
        for e in range(engines)
        if sizes[e]
    )
    assert np.isclose(model.rollout_seconds(0, engines), expected, rtol=1e-9)


def test_verl_placement_keeps_a_prompts_samples_together_and_straggles_more_than_round_robin():
    trace = scenario_trace("longtail-drift", scenario_shape(PROFILE), seed=0, steps=40)
    verl, rr = StageModel(PROFILE, trace, router="verl"), StageModel(PROFILE, trace, router="round-robin")
    per_prompt = PROFILE.workload.samples_per_prompt
    placed = placement_at_submission(trace.steps[0].samples, 4, "verl")
    assert all(len(set(placed[j:j + per_prompt])) == 1 for j in range(0, len(placed), per_prompt))
    assert verl.rollout_table(4).sum() > rr.rollout_table(4).sum()


def pull_by_iteration(prompts: list[int], lengths: list[int], engines: int, slots: int) -> list[float]:
    """Engines decode in lock-step, one iteration at a time; a free slot pulls the next queued
    request (slots in the order the router offers them: slot s on engine s % engines)."""
    r = PROFILE.rollout
    queue = list(range(len(lengths)))
    running: dict[int, tuple[int, int]] = {}  # slot -> (request, tokens done)
    seconds = [0.0] * engines
    finished = [0.0] * engines
    while queue or running:
        for s in range(engines * slots):
            if s not in running and queue:
                i = queue.pop(0)
                running[s] = (i, 0)
                seconds[s % engines] += r.prefill_per_token_s * prompts[i]
        for e in range(engines):
            mine = [(i, done) for s, (i, done) in running.items() if s % engines == e]
            if mine:
                context = sum(prompts[i] + done for i, done in mine)
                seconds[e] += r.iter_base_s + r.iter_per_seq_s * len(mine) + r.iter_per_ctx_token_s * context
        for s, (i, done) in list(running.items()):
            if done + 1 == lengths[i]:
                del running[s]
                finished[s % engines] = seconds[s % engines]
            else:
                running[s] = (i, done + 1)
    return finished


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), min_size=1, max_size=30), st.integers(1, 3),
       st.integers(1, 4))
def test_pull_router_equals_lock_step_iteration_simulation(samples, engines, slots):
    prompts = [p for p, _ in samples]
    lengths = [n for _, n in samples]
    profile = msgspec.structs.replace(PROFILE, rollout=msgspec.structs.replace(PROFILE.rollout, max_num_seqs=slots))
    batch = StepBatch(0, np.array(prompts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    model = StageModel(profile, Trace("t", (batch,)))
    finish = model.engine_finish(0, engines)
    expected = pull_by_iteration(prompts, lengths, engines, int(model.batch_limit[0]))
    assert np.allclose(finish, expected, rtol=1e-9)
    assert np.isclose(model.rollout_seconds(0, engines), max(expected), rtol=1e-9)


def test_small_kv_cache_limits_the_running_batch():
    tight = msgspec.structs.replace(PROFILE, rollout=msgspec.structs.replace(PROFILE.rollout, kv_cache_tokens=5000))
    batch = StepBatch(0, np.full(64, 100, dtype=np.int64), np.full(64, 900, dtype=np.int64))
    model = StageModel(tight, Trace("t", (batch,)))
    assert model.batch_limit[0] == 5000 // (100 + 899 / 2)  # mean context of a running request
    assert model.rollout_seconds(0, 1) > StageModel(PROFILE, Trace("t", (batch,))).rollout_seconds(0, 1)


def test_work_and_longest_request_bound_every_pool_size():
    trace = scenario_trace("longtail-stationary", scenario_shape(PROFILE), steps=3)
    model = StageModel(PROFILE, trace)
    for n in range(1, 9):
        for k in range(3):
            r = model.rollout_seconds(k, n)
            assert model.rollout_work(k) <= n * r * (1 + 1e-12)
            assert model.longest_request_s[k] <= r * (1 + 1e-12)


def test_training_gets_faster_with_more_devices_and_slower_with_more_tokens():
    trace = scenario_trace("longtail-drift", scenario_shape(PROFILE), steps=10)
    model = StageModel(PROFILE, trace)
    times = [model.train_seconds(9, n) for n in range(1, 9)]
    assert all(a > b for a, b in zip(times, times[1:], strict=False))
    assert model.train_seconds(9, 4) > model.train_seconds(0, 4)


@pytest.mark.parametrize("router", ["pull", "verl", "round-robin"])
def test_the_whole_table_in_one_pass_is_every_step_to_the_last_bit(router):
    """`rollout_table` computes the steps whose requests all start at once in one pass: the
    seconds are exactly those of `engine_finish` step by step, on pools of one engine to more
    engines than requests (and the steps that do not fit are left to it)."""
    profile = PROFILE.with_gpus(96)
    trace = scenario_trace("noisy", scenario_shape(profile), seed=3, steps=12)
    model = StageModel(profile, trace, router=router)
    compared = 0
    for engines in (1, 3, 7, 40, 96):
        fast = model._first_wave_table(engines)
        done = ~np.isnan(fast)
        compared += int(done.sum())
        step_by_step = np.array([model.engine_finish(i, engines).max() for i in range(model.steps)])
        assert (fast[done] == step_by_step[done]).all()
        assert (model.rollout_table(engines * profile.rollout.gpus_per_engine) == step_by_step).all()
    assert compared >= 2 * model.steps  # most pools fit every step in one wave
