"""How long each stage of an RL step takes on a given number of devices: the cost model.

`StageModel` turns a trace and a profile into seconds: the rollout of step k on n devices,
the training of step k on n devices, weight sync, and the full-utilisation work the lower
bound uses. Everything is a pure function of (trace, profile), cached per pool size, so the
simulator, the best-static search, the lower bound and the daemon's simulated backend all
see the same numbers.

Rollout model (per engine, continuous batching, FCFS). Requests of a step are placed on
engines by a router (`ROUTERS`): pulled from one queue (ours), or fixed at submission as verl
places them. An engine runs at most
`B` requests at once, `B = min(max_num_seqs, kv_cache_tokens / mean context)`; one decode
iteration advances every running request by one token and costs
`base + per_seq * running + per_ctx * sum(running contexts)`. Because every running request
advances at the same rate, the admission schedule in "tokens generated" time does not depend
on the costs: it is a B-slot FIFO queue whose service times are the response lengths. Its
makespan `tau` (in iterations) is all the engine needs, and the engine's busy time is exactly

    base * tau + per_seq * sum(L) + per_ctx * sum(P*L + L*(L-1)/2) + prefill * sum(P)

The first term is where the long tail hurts: when few requests remain, every iteration still
pays `base` for a handful of tokens (memory-bound decode, an underused device).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynaresized.domain import ResponseLengths
from dynaresized.sim.profile import Profile, RolloutSpec
from dynaresized.sim.workload import Trace


def fifo_makespan(lengths: list[int], slots: int) -> int:
    """Iterations until a `slots`-wide FIFO batch has generated every response in `lengths`."""
    if len(lengths) <= slots:
        return max(lengths, default=0)
    heap = lengths[:slots]
    heapq.heapify(heap)
    for length in lengths[slots:]:
        heapq.heapreplace(heap, heap[0] + length)
    return max(heap)


ROUTERS: tuple[str, ...] = ("pull", "round-robin", "verl")
"""`pull`: one queue per step, an engine pulls a request when it has a free slot (our router,
backends/vllm/router.py). `round-robin`: placed at submission, request j on engine j % E (verl's
`AsyncLLMServerManager` for a batch submitted at once). `verl`: placed at submission in E
contiguous, equal chunks (verl's `DP_COMPUTE_PROTO` dispatch, `DataProto.chunk`, of a batch whose
samples are grouped by prompt, as `repeat(interleave=True)` leaves them): every sample of a prompt
lands on one engine, so a hard prompt's long responses straggle together."""


def placement_at_submission(n: int, engines: int, router: str) -> np.ndarray:
    """The engine each of `n` requests is placed on by a router that places at submission."""
    if router == "round-robin":
        return np.arange(n, dtype=np.int64) % engines
    if router == "verl":
        # np.array_split's chunks: the first n % engines one request longer
        sizes = np.full(engines, n // engines, dtype=np.int64)
        sizes[: n % engines] += 1
        return np.repeat(np.arange(engines, dtype=np.int64), sizes)
    raise ValueError(f"router {router!r} does not place at submission")


def submitted_makespans(lengths: np.ndarray, placement: np.ndarray, engines: int, slots: int) -> np.ndarray:
    """Each engine's makespan in iterations (`fifo_makespan`) when request j, of `lengths[j]`
    tokens, was placed on engine `placement[j]` and each engine runs its own FIFO in request
    order. An engine with no more requests than slots runs them all at once (its longest), so
    only the others are queued one by one: at hundreds of engines that is most of them."""
    order = lengths[np.argsort(placement, kind="stable")]
    counts = np.bincount(placement, minlength=engines)
    starts = np.cumsum(counts) - counts
    tau = np.zeros(engines, dtype=np.float64)
    held = counts > 0
    if held.any():
        tau[held] = np.maximum.reduceat(order, starts[held])
    for e in np.nonzero(counts > slots)[0]:
        tau[e] = fifo_makespan(order[starts[e]:starts[e] + counts[e]].tolist(), slots)
    return tau


def trained_tokens(seq: np.ndarray, attention_tokens: float) -> np.ndarray:
    """Per sample of `seq` (prompt + response tokens), the tokens its training step costs: its
    sequence, weighted by `1 + seq / attention_tokens` where attention's quadratic term counts."""
    return seq * (1.0 + seq / attention_tokens) if attention_tokens > 0 else seq


def contexts(prompts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per request, the context tokens read over its decode: its prompt at every generated
    token, and the tokens generated before each one."""
    return prompts * lengths + lengths * (lengths - 1.0) / 2.0


def busy_s(r: RolloutSpec, iterations: np.ndarray, tokens: np.ndarray, ctx: np.ndarray,
           prompt_tokens: np.ndarray) -> np.ndarray:
    """An engine's busy seconds: `base` for each iteration it runs, the per-token costs of what
    it generates and reads, and the prefill of its prompts (one expression, so every schedule
    sums the same way to the last bit)."""
    return (r.iter_base_s * iterations + r.iter_per_seq_s * tokens + r.iter_per_ctx_token_s * ctx
            + r.prefill_per_token_s * prompt_tokens)


def pull_placement(lengths: Sequence[int] | np.ndarray, engines: int, slots: int,
                   offsets: list[int] | None = None, home: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The engine each request lands on, and each engine's makespan in iterations, when
    `engines` engines of `slots` slots pull from one FIFO queue. Every running request advances
    one token per iteration on every engine (the same lock-step the FIFO model assumes);
    `offsets[e]` is the iteration at which engine e starts pulling (a late-waking engine);
    `home`: `hold_share`."""
    placement, _, finish = pull_schedule(lengths, engines, slots, offsets, home)
    return placement, finish


def hold_share(n: int, offsets: Sequence[float] | None, slots: int, home: int | None) -> tuple[float, int] | None:
    """What the router holds for the step's own engines that start late (coming home from a
    loan): (until, share). The first `home` engines (all, if None) are the step's own; until
    the last of them starts (`until`, an iteration), an engine takes at most `share` =
    ceil(n / home) requests, so that one woken a few seconds late finds its share of the
    step still queued instead of the engines on time holding all of it in batches twice as
    wide (`backends/vllm/router.py` holds it the same way). Engines that join later than
    `home` (trainers lent mid-step) are not waited for. None: nothing held (nobody late, or
    the step's requests fill every slot anyway)."""
    if offsets is None:
        return None
    home = len(offsets) if home is None else home
    until = max(offsets[:home], default=0)
    if until <= 0 or home < 1:
        return None
    share = -(-n // home)
    return (float(until), share) if share < slots else None


def pull_schedule(lengths: Sequence[int] | np.ndarray, engines: int, slots: int,
                  offsets: list[int] | None = None, home: int | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """`pull_placement`, with the iteration each request finishes at: (placement, done_at,
    finish), in iterations. `lengths` as an array costs no conversion where everything fits in
    the first wave (the static searches ask that of every split and step)."""
    if engines < 1 or slots < 1:
        raise ValueError(f"a pull router needs at least one engine with a slot, got {engines} engine(s) "
                         f"of {slots} slot(s): the rollout pool is smaller than one engine")
    n, width = len(lengths), engines * slots
    placement = np.empty(n, dtype=np.int64)
    done_at = np.empty(n, dtype=np.int64)
    if (offsets is None or not any(offsets)) and n <= width:
        # Everything fits in the first wave: slot j (engine j % engines) runs request j.
        placement = np.arange(n, dtype=np.int64) % engines
        done = np.asarray(lengths, dtype=np.int64)
        rows = -(-n // engines)  # request j is in row j // engines, column j % engines
        padded = np.zeros(rows * engines, dtype=np.float64)
        padded[:n] = done
        finish = padded.reshape(rows, engines).max(axis=0) if n else np.zeros(engines, dtype=np.float64)
        return placement, done, finish
    if isinstance(lengths, np.ndarray):
        lengths = lengths.tolist()  # one element at a time below: a list's are cheaper to read
    if offsets is None or not any(offsets):
        # Everyone starts at once: the first wave fills slot s (engine s % engines) in order.
        first = min(n, width)
        placement[:first] = np.arange(first) % engines
        done_at[:first] = lengths[:first]
        heap = [(lengths[s], s) for s in range(first)] + [(0, s) for s in range(first, width)]
        rest = range(first, n)
        heapq.heapify(heap)
        for j in rest:
            t, s = heap[0]
            placement[j] = s % engines
            d = t + lengths[j]
            done_at[j] = d
            heapq.heapreplace(heap, (d, s))
    else:
        # Late engines: free slots in order of (time, slot), an engine's never-used slots one
        # entry (the lowest) until it takes a request, so that n requests cost O(n log engines)
        # however wide the engines are (see `pull_segments`).
        busy: list[tuple[int, int]] = []  # (finishes, slot)
        hold = hold_share(n, offsets, slots, home)
        fresh = _fresh_slots(offsets, slots)
        for j in range(n):
            if fresh and (not busy or fresh[0][:2] < busy[0]):
                t, s = _take_fresh(fresh, engines, slots, hold)
            else:
                t, s = heapq.heappop(busy)
            placement[j] = s % engines
            d = t + lengths[j]
            done_at[j] = d
            heapq.heappush(busy, (d, s))
    finish = np.zeros(engines, dtype=np.float64) if offsets is None else np.array(offsets, dtype=np.float64)
    np.maximum.at(finish, placement, done_at.astype(np.float64))
    return placement, done_at, finish


def _fresh_slots(offsets: Sequence[float], slots: int) -> list[tuple[float, int, int, int]]:
    """The engines' never-used slots as a heap of one entry an engine, its lowest: (when it
    starts, slot, engine, level); slot s is level s // engines of engine s % engines."""
    fresh = [(offsets[e], e, e, 0) for e in range(len(offsets))] if slots > 0 else []
    heapq.heapify(fresh)
    return fresh


def _take_fresh(fresh: list[tuple[float, int, int, int]], engines: int, slots: int,
                hold: tuple[float, int] | None = None) -> tuple[float, int]:
    """(when, slot) of the first never-used slot; its engine's next level takes its place,
    from `hold`'s `until` on where that level is beyond the held share (`hold_share`)."""
    t, slot, e, k = heapq.heappop(fresh)
    if k + 1 < slots:
        nxt = t if hold is None or k + 1 < hold[1] else max(t, hold[0])
        heapq.heappush(fresh, (nxt, slot + engines, e, k + 1))
    return t, slot


@dataclass(frozen=True)
class Intervention:
    """Something done to the running requests of a pull-routed step at `at` (an iteration):
    the engines in `stop` go home, their running requests aborted; with `rebalance`, every
    running request is aborted and all of them go back to the queue (verl's
    `request_rebalance`). Aborted requests keep what they generated (partial rollout) and are
    queued first; the engine that resumes one prefills its prompt and what it generated."""

    at: float
    stop: frozenset[int] = frozenset()
    rebalance: bool = False


def pull_segments(lengths: list[int], engines: int, slots: int, offsets: list[int],
                  interventions: list[Intervention],
                  home: int | None = None) -> tuple[np.ndarray, list[tuple[int, int, float, float, int, int]]]:
    """The pull router's FIFO queue with `interventions`, run segment by segment. Returns each
    request's finishing iteration and the segments: (request, engine, from, to, tokens generated
    before, after), in iterations.

    Slot s is slot s // engines of engine s % engines; free slots take requests in order of
    (time, s). Only slots that run something are simulated one by one: an engine's slots that
    have never run anything are one entry (`fresh`, the lowest of them) until one takes a
    request, and once the queue is empty those left, and every slot of an engine after a
    rebalance, are idle from a level on (`idle_from`), so a step of n requests costs
    O(n log(engines)) however wide the engines are (at 1,024 devices of 256 slots, the old
    slot-by-slot heap was most of a simulated run)."""
    n = len(lengths)
    queue: deque[tuple[int, int]] = deque(zip(range(n), [0] * n))
    running: dict[int, tuple[int, float, int]] = {}  # slot -> (request, started, generated before)
    version: dict[int, int] = {}
    alive = [True] * engines
    heap: list[tuple[float, int, int]] = []  # (when, slot, version): a running request finishes
    fresh = _fresh_slots([float(o) for o in offsets], slots)
    idle: set[int] = set()  # slots that ran something and found the queue empty
    idle_from: dict[int, int] = {}  # engine -> every slot of it from this level on is idle...
    idle_to: dict[int, int] = {}  # ...up to this level (the held share's, `hold_share`, or `slots`)
    done_at = np.full(n, np.nan)
    segments: list[tuple[int, int, float, float, int, int]] = []
    pending = sorted(interventions, key=lambda x: x.at)
    hold = hold_share(n, offsets, slots, home)

    def begin(slot: int, t: float) -> None:
        j, gen = queue.popleft()
        running[slot] = (j, t, gen)
        v = version[slot] = version.get(slot, 0) + 1
        heapq.heappush(heap, (t + lengths[j] - gen, slot, v))

    def abort(slot: int, t: float) -> tuple[int, int]:
        j, started, gen = running.pop(slot)
        made = gen + int(t - started)
        segments.append((j, slot % engines, started, t, gen, made))
        version[slot] = version.get(slot, 0) + 1
        return j, made

    def fill(t: float) -> None:
        """Free slots take what the queue holds, lowest slot first."""
        listed = sorted(s for s in idle if alive[s % engines])
        levels = [(k * engines + e, e) for e, k in idle_from.items() if alive[e]]
        heapq.heapify(levels)
        i = 0
        while queue and (i < len(listed) or levels):
            if levels and (i == len(listed) or levels[0][0] < listed[i]):
                slot, e = heapq.heappop(levels)
                k = idle_from[e] = idle_from[e] + 1
                if k < idle_to[e]:
                    heapq.heappush(levels, (slot + engines, e))
                else:
                    del idle_from[e], idle_to[e]
            else:
                slot = listed[i]
                i += 1
                idle.discard(slot)
            begin(slot, t)

    while heap or pending or (queue and fresh):
        t_run = heap[0][0] if heap else math.inf
        t_new = fresh[0][0] if queue and fresh else math.inf
        if pending and pending[0].at <= min(t_run, t_new):
            x = pending.pop(0)
            hit = sorted(s for s in running if alive[s % engines] and (x.rebalance or s % engines in x.stop))
            requeued = [abort(s, x.at) for s in hit]
            queue.extendleft(reversed(requeued))
            for e in x.stop:
                alive[e] = False
            # the engines' never-used slots free before now found the queue empty: idle
            while fresh and fresh[0][0] < x.at:
                _, _, e, k = heapq.heappop(fresh)
                if hold is not None and k < hold[1] and hold[0] >= x.at:
                    # the levels beyond the held share open later: idle up to it, the rest still fresh
                    heapq.heappush(fresh, (max(float(offsets[e]), hold[0]), e + hold[1] * engines, e, hold[1]))
                    idle_from[e], idle_to[e] = k, hold[1]
                else:  # joined to the levels below it still idle, if any
                    idle_from[e] = idle_from[e] if idle_to.get(e) == k else k
                    idle_to[e] = slots
            if x.rebalance:  # every slot that has started takes from the queue again, engine by engine
                again = {e for e in range(engines) if alive[e] and offsets[e] <= x.at}
                fresh = [entry for entry in fresh if entry[2] not in again]
                heapq.heapify(fresh)
                idle = {s for s in idle if s % engines not in again}
                for e in again:
                    idle_from[e], idle_to[e] = 0, slots
            fill(x.at)
            continue
        if t_new < t_run or (t_new == t_run and fresh[0][1] < heap[0][1]):
            if not alive[fresh[0][2]]:
                heapq.heappop(fresh)  # a stopped engine's slots take nothing more
                continue
            t, slot = _take_fresh(fresh, engines, slots, hold)
            begin(slot, t)
            continue
        t, slot, ver = heapq.heappop(heap)
        if ver != version[slot] or not alive[slot % engines]:
            continue
        j, started, gen = running.pop(slot)
        segments.append((j, slot % engines, started, t, gen, lengths[j]))
        done_at[j] = t
        if queue:
            begin(slot, t)
        else:
            idle.add(slot)
    if np.isnan(done_at).any():
        raise ValueError("every engine stopped before the step's requests were done")
    return done_at, segments


def fifo_done(lengths: list[int], slots: int) -> np.ndarray:
    """The iteration at which each response of a `slots`-wide FIFO batch finishes."""
    done = np.empty(len(lengths), dtype=np.float64)
    heap = [(0, s) for s in range(max(slots, 1))]
    for j, length in enumerate(lengths):
        t, s = heap[0]
        done[j] = t + length
        heapq.heapreplace(heap, (t + length, s))
    return done


@dataclass(frozen=True, eq=False)
class EngineSchedule:
    """One step's rollout request by request (`StageModel.engine_schedule`)."""

    placement: np.ndarray  # the engine of each request
    done_s: np.ndarray  # seconds after the step starts at which each request finishes
    finish_s: np.ndarray  # seconds at which each engine finishes its last request

    def done_by(self, engines: int, at_s: float) -> np.ndarray:
        """Requests each engine has finished by `at_s`."""
        return np.bincount(self.placement[self.done_s <= at_s], minlength=engines)


class StageModel:
    """Stage times of one trace on one profile. Pool sizes are counted in devices."""

    def __init__(self, profile: Profile, trace: Trace, *, router: str = "pull") -> None:
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; routers: {', '.join(ROUTERS)}")
        self.profile = profile
        self.trace = trace
        self.router = router
        r = profile.rollout
        self._gpe = r.gpus_per_engine
        k = len(trace)
        self.steps = k
        self.samples = np.array([b.samples for b in trace], dtype=np.int64)
        self.trained_samples = np.array([int(b.trained_mask.sum()) for b in trace], dtype=np.int64)
        self.response_tokens = np.array([int(b.response_tokens.sum()) for b in trace], dtype=np.int64)
        # Per step: sum L, sum P, sum of contexts over every generated token, batch limit.
        self._sum_l = np.zeros(k)
        self._sum_p = np.zeros(k)
        self._ctx = np.zeros(k)
        self.batch_limit = np.zeros(k, dtype=np.int64)
        self.longest_request_s = np.zeros(k)
        train_tokens = np.zeros(k)
        attn = profile.training.attention_tokens
        for i, b in enumerate(trace):
            p = b.prompt_tokens.astype(np.float64)
            length = b.response_tokens.astype(np.float64)
            ctx = contexts(p, length)
            self._sum_l[i] = length.sum()
            self._sum_p[i] = p.sum()
            self._ctx[i] = ctx.sum()
            mean_ctx = self._ctx[i] / max(self._sum_l[i], 1.0)
            self.batch_limit[i] = max(1, min(r.max_num_seqs, int(r.kv_cache_tokens // max(mean_ctx, 1.0))))
            # Alone on an engine, a request still pays the whole iteration cost for each token.
            alone = ((r.iter_base_s + r.iter_per_seq_s) * length + r.iter_per_ctx_token_s * ctx
                     + r.prefill_per_token_s * p)
            self.longest_request_s[i] = float(alone.max())
            seq = (p + length)[b.trained_mask]  # filtered samples (dynamic sampling) are not trained
            train_tokens[i] = trained_tokens(seq, attn).sum()
        self.train_tokens = train_tokens
        t = profile.training
        self.train_s_per_token = 1.0 / t.update_tokens_per_s + 1.0 / t.logprob_tokens_per_s
        """Device-seconds of training (update and old log-probs) per trained token."""
        self._rollout_cache: dict[int, np.ndarray] = {}
        self._train_cache: dict[int, np.ndarray] = {}
        self._variants: dict[int, StageModel] = {self._gpe: self}
        self._alone: list[np.ndarray] | None = None
        self._rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._work: np.ndarray | None = None

    # -- engine sizes -------------------------------------------------------------------
    def at_tp(self, devices: int) -> StageModel:
        """The same trace and router on engines of `devices` devices (`Profile.with_tp`)."""
        model = self._variants.get(devices)
        if model is None:
            model = StageModel(self.profile.with_tp(devices), self.trace, router=self.router)
            model._variants = self._variants  # one family: every variant sees the same cache
            self._variants[devices] = model
        return model

    def variants(self, most: int) -> list[StageModel]:
        """This model on every engine size the profile allows (`RolloutSpec.engine_sizes`)
        of at most `most` devices; the profile's own size when none is that small."""
        sizes = [k for k in self.profile.rollout.engine_sizes() if k <= most]
        return [self.at_tp(k) for k in sizes] if sizes else [self]

    def alone_s(self) -> list[np.ndarray]:
        """Per step, the seconds each request takes decoded alone on one engine (it still pays
        the whole iteration cost for every token it generates)."""
        if self._alone is None:
            r = self.profile.rollout
            self._alone = []
            for b in self.trace:
                p = b.prompt_tokens.astype(np.float64)
                length = b.response_tokens.astype(np.float64)
                ctx = contexts(p, length)
                self._alone.append((r.iter_base_s + r.iter_per_seq_s) * length + r.iter_per_ctx_token_s * ctx
                                   + r.prefill_per_token_s * p)
        return self._alone

    def lengths(self, step: int) -> ResponseLengths:
        """Step `step`'s response lengths as a router reports them (`StepTiming.lengths`): the
        quantiles of its response tokens, and the seconds per token of its longest response
        decoded alone on one of this model's engines (its latency floor over its tokens)."""
        return ResponseLengths.of(self.trace.steps[step].response_tokens.tolist(),
                                  float(self.longest_request_s[step]))

    def rollout_work_table(self) -> np.ndarray:
        """`rollout_work` of every step."""
        if self._work is None:
            self._work = np.array([self.rollout_work(i) for i in range(self.steps)])
        return self._work

    # -- rollout ------------------------------------------------------------------------
    def engines(self, devices: int) -> int:
        return devices // self._gpe

    def rollout_table(self, devices: int) -> np.ndarray:
        """Rollout seconds of every step on `devices` devices (inf when no engine fits)."""
        engines = self.engines(devices)
        cached = self._rollout_cache.get(engines)
        if cached is None:
            if engines < 1:
                cached = np.full(self.steps, math.inf)
            else:
                cached = self._first_wave_table(engines)
                for i in np.flatnonzero(np.isnan(cached)):
                    cached[i] = self._rollout_step(int(i), engines)
            cached.setflags(write=False)
            self._rollout_cache[engines] = cached
        return cached

    def _padded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every step's response lengths, prompt lengths and contexts (as `engine_finish` sums
        them), one row a step, zero past the step's samples."""
        if self._rows is None:
            width = int(self.samples.max())
            lengths, prompts = np.zeros((self.steps, width)), np.zeros((self.steps, width))
            for i, b in enumerate(self.trace.steps):
                lengths[i, :b.samples] = b.response_tokens
                prompts[i, :b.samples] = b.prompt_tokens
            self._rows = lengths, prompts, contexts(prompts, lengths)
        return self._rows

    def _first_wave_table(self, engines: int) -> np.ndarray:
        """`_rollout_step` of every step whose requests all start at once on `engines` engines
        (no more requests than slots), computed for all of them in one pass; NaN for the others.
        The same sums in the same order as `engine_finish` (request j of a pull or round-robin
        step on engine j % E, verl's contiguous chunks), so the same seconds to the last bit:
        the static searches ask this of every split, and per step it was most of their time."""
        r = self.profile.rollout
        out = np.full(self.steps, np.nan)
        fits = self.samples <= engines * self.batch_limit
        if not fits.any():
            return out
        lengths, prompts, ctx = self._padded()
        if self.router in ("pull", "round-robin"):
            rows = -(-lengths.shape[1] // engines)
            pad = ((0, 0), (0, rows * engines - lengths.shape[1]))

            def per_engine(m: np.ndarray) -> np.ndarray:
                return np.pad(m[fits], pad).reshape(-1, rows, engines)

            ls = per_engine(lengths)
            busy = busy_s(r, ls.max(axis=1), ls.sum(axis=1), per_engine(ctx).sum(axis=1),
                          per_engine(prompts).sum(axis=1))
            out[fits] = busy.max(axis=1)
            return out
        for n in np.unique(self.samples[fits]):  # verl: contiguous chunks, the same for steps of n samples
            steps = np.flatnonzero(fits & (self.samples == n))
            sizes = np.full(engines, n // engines, dtype=np.int64)
            sizes[: n % engines] += 1
            starts = (np.cumsum(sizes) - sizes)[sizes > 0]
            ls = lengths[steps, :n]
            busy = busy_s(r, np.maximum.reduceat(ls, starts, axis=1), np.add.reduceat(ls, starts, axis=1),
                          np.add.reduceat(ctx[steps, :n], starts, axis=1),
                          np.add.reduceat(prompts[steps, :n], starts, axis=1))
            out[steps] = busy.max(axis=1)
        return out

    def rollout_seconds(self, step: int, devices: int) -> float:
        return float(self.rollout_table(devices)[step])

    def _rollout_step(self, i: int, engines: int) -> float:
        return float(self.engine_finish(i, engines).max())

    def _submitted_busy(self, i: int, engines: int) -> np.ndarray:
        """Busy seconds of each engine when the step's requests were placed at submission
        (`round-robin` or `verl`); each engine runs its own requests FIFO with `B` slots."""
        r = self.profile.rollout
        b = self.trace.steps[i]
        length = b.response_tokens
        placement = placement_at_submission(length.shape[0], engines, self.router)
        lf = length.astype(np.float64)
        pf = b.prompt_tokens.astype(np.float64)
        sum_l = np.bincount(placement, lf, engines)
        sum_p = np.bincount(placement, pf, engines)
        ctx = np.bincount(placement, contexts(pf, lf), engines)
        slots = int(self.batch_limit[i])
        # each engine's requests in submission order (a stable sort keeps trace order)
        tau = submitted_makespans(length, placement, engines, slots)
        return busy_s(r, tau, sum_l, ctx, sum_p)

    def engine_finish(self, i: int, engines: int, late_s: np.ndarray | None = None,
                      home: int | None = None) -> np.ndarray:
        """Seconds after the step starts at which each engine of the pull router has generated
        its last response. `late_s[e]`: engine e starts that late (woken after a loan); with the
        pull router its start is converted to iterations at the step's full-batch iteration
        time, and the router holds its share of the step for it if it is one of the step's first
        `home` engines (`hold_share`; the others pull the rest meanwhile); a router that places
        at submission placed its requests already."""
        if self.router != "pull":
            busy = self._submitted_busy(i, engines)
            return busy if late_s is None else busy + np.asarray(late_s, dtype=np.float64)
        r = self.profile.rollout
        b = self.trace.steps[i]
        slots = int(self.batch_limit[i])
        offsets = None
        if late_s is not None and late_s.any():
            mean_ctx = self._ctx[i] / max(self._sum_l[i], 1.0)
            full_iter = r.iter_base_s + slots * (r.iter_per_seq_s + r.iter_per_ctx_token_s * mean_ctx)
            offsets = [int(x / full_iter) for x in late_s]
        placement, tau = pull_placement(b.response_tokens, engines, slots, offsets, home)
        lf = b.response_tokens.astype(np.float64)
        pf = b.prompt_tokens.astype(np.float64)
        sum_l = np.bincount(placement, lf, engines)
        sum_p = np.bincount(placement, pf, engines)
        ctx = np.bincount(placement, contexts(pf, lf), engines)
        start = np.zeros(engines) if late_s is None else np.asarray(late_s, dtype=np.float64)
        iters = tau - (np.zeros(engines) if offsets is None else np.array(offsets, dtype=np.float64))
        return start + busy_s(r, iters, sum_l, ctx, sum_p)

    def _full_iter_s(self, i: int) -> float:
        """Seconds of one decode iteration of step i's full batch (late starts and stops are
        converted to iterations at this pace)."""
        r = self.profile.rollout
        mean_ctx = self._ctx[i] / max(self._sum_l[i], 1.0)
        return r.iter_base_s + int(self.batch_limit[i]) * (r.iter_per_seq_s + r.iter_per_ctx_token_s * mean_ctx)

    def engine_schedule(self, i: int, engines: int, late_s: np.ndarray | None = None, *,
                        stop_at_s: float | None = None, stopping: frozenset[int] = frozenset(),
                        rebalance_at_s: float | None = None, home: int | None = None) -> EngineSchedule:
        """Step i's rollout request by request: the engine each lands on (finishes on), the
        second after the step starts at which each finishes, and each engine's finish
        (`engine_finish`). With the pull router, the engines in `stopping` go home at
        `stop_at_s` and every running request is redistributed at `rebalance_at_s`
        (`Intervention`). A request's finish is interpolated over its engine's busy time by the
        iteration it finishes at; `home` as `engine_finish`'s."""
        start = np.zeros(engines) if late_s is None else np.asarray(late_s, dtype=np.float64)
        if self.router == "pull":
            if stop_at_s is not None or rebalance_at_s is not None:
                return self._intervened(i, engines, start, stop_at_s, stopping, rebalance_at_s, home)
            return self._pull_schedule(i, engines, start, home)[0]
        lengths = self.trace.steps[i].response_tokens
        slots = int(self.batch_limit[i])
        placement = placement_at_submission(lengths.shape[0], engines, self.router)
        done_at = np.empty(lengths.shape[0], dtype=np.float64)
        tau = np.zeros(engines)
        for e in range(engines):
            mine = np.flatnonzero(placement == e)
            done_at[mine] = fifo_done(lengths[mine].tolist(), slots)
            tau[e] = done_at[mine].max() if mine.size else 0.0
        busy = self._submitted_busy(i, engines)
        span = np.maximum(tau, 1e-12)
        done_s = start[placement] + done_at / span[placement] * busy[placement]
        return EngineSchedule(placement=placement, done_s=done_s, finish_s=start + busy)

    def _pull_schedule(self, i: int, engines: int, start: np.ndarray,
                       home: int | None = None) -> tuple[EngineSchedule, np.ndarray, float]:
        """`engine_schedule` with the pull router and no intervention, with each engine's
        iterations (from its offset to its last request's end, at least 1e-12) and the
        iteration at which the step's last request is pulled."""
        b = self.trace.steps[i]
        lengths = b.response_tokens
        full_iter = self._full_iter_s(i)
        offsets_list = [int(x / full_iter) for x in start] if start.any() else None
        placement, done_int, tau = pull_schedule(lengths, engines, int(self.batch_limit[i]), offsets_list, home)
        done_at = done_int.astype(np.float64)
        offsets = np.zeros(engines) if offsets_list is None else np.array(offsets_list, dtype=np.float64)
        lf = lengths.astype(np.float64)
        pf = b.prompt_tokens.astype(np.float64)
        busy = busy_s(self.profile.rollout, tau - offsets, np.bincount(placement, lf, engines),
                      np.bincount(placement, contexts(pf, lf), engines), np.bincount(placement, pf, engines))
        span = np.maximum(tau - offsets, 1e-12)
        done_s = start[placement] + (done_at - offsets[placement]) / span[placement] * busy[placement]
        last_pulled = float((done_int - lengths).max())
        return EngineSchedule(placement=placement, done_s=done_s, finish_s=start + busy), span, last_pulled

    def pull_timeline(self, i: int, engines: int, late_s: np.ndarray,
                      home: int | None = None) -> tuple[EngineSchedule, np.ndarray, np.ndarray, float]:
        """Step i's pull-routed rollout request by request (`engine_schedule`), with each
        request's start (seconds after the step starts), each engine's pace (seconds per
        iteration over its busy time, as `done_s` is interpolated), and when the step's queue
        empties, in the seconds a late engine's offset is counted in (a full batch's iteration:
        an engine lent in before then still pulls a request): what a tail regroup needs to know
        of the requests an engine still runs at a moment. `home` as `engine_finish`'s."""
        schedule, span, last_pulled = self._pull_schedule(i, engines, late_s, home)
        pace = (schedule.finish_s - late_s) / span
        start_s = schedule.done_s - self.trace.steps[i].response_tokens.astype(np.float64) * pace[schedule.placement]
        return schedule, start_s, pace, (last_pulled + 1.0) * self._full_iter_s(i)

    def _intervened(self, i: int, engines: int, start: np.ndarray, stop_at_s: float | None,
                    stopping: frozenset[int], rebalance_at_s: float | None,
                    home: int | None = None) -> EngineSchedule:
        """`engine_schedule` with the pull router's running requests aborted and requeued at
        `rebalance_at_s` (all of them) or `stop_at_s` (those of the engines in `stopping`, which
        go home). An engine's busy seconds: `base` for every iteration it runs anything, the
        per-token costs of what it generates, and the prefill of what it starts or resumes."""
        r = self.profile.rollout
        b = self.trace.steps[i]
        lengths = b.response_tokens.tolist()
        prompts = b.prompt_tokens.astype(np.float64)
        full_iter = self._full_iter_s(i)
        offsets = [int(x / full_iter) for x in start]
        plan = []
        if rebalance_at_s is not None:
            plan.append(Intervention(at=float(int(rebalance_at_s / full_iter)), rebalance=True))
        if stop_at_s is not None:
            plan.append(Intervention(at=float(int(stop_at_s / full_iter)), stop=stopping))
        done_at, segments = pull_segments(lengths, engines, int(self.batch_limit[i]), offsets, plan, home)
        seg = np.array(segments, dtype=np.float64)
        j, e = seg[:, 0].astype(np.int64), seg[:, 1].astype(np.int64)
        t0, t1, g0, g1 = seg[:, 2], seg[:, 3], seg[:, 4], seg[:, 5]
        p = prompts[j]
        ctx = (g1 - g0) * p + (g1 * (g1 - 1.0) - g0 * (g0 - 1.0)) / 2.0
        busy = np.bincount(e, r.iter_per_seq_s * (g1 - g0) + r.iter_per_ctx_token_s * ctx
                           + r.prefill_per_token_s * (p + g0), engines)
        finished = g1 == b.response_tokens[j]
        placement = np.empty(len(lengths), dtype=np.int64)
        placement[j[finished]] = e[finished]
        first = np.array([float(o) for o in offsets])
        last = first.copy()
        for k in range(engines):  # `base` once per iteration the engine runs anything
            mine = e == k
            if not mine.any():
                continue
            order = np.argsort(t0[mine], kind="stable")
            a, z = t0[mine][order], t1[mine][order]
            reach = np.maximum.accumulate(z)
            before = np.concatenate([[-np.inf], reach[:-1]])
            busy[k] += r.iter_base_s * float(np.maximum(z - np.maximum(a, before), 0.0).sum())
            last[k] = reach[-1]
        span = np.maximum(last - first, 1e-12)
        done_s = start[placement] + (done_at - first[placement]) / span[placement] * busy[placement]
        return EngineSchedule(placement=placement, done_s=done_s, finish_s=start + busy)

    def train_work(self, step: int) -> float:
        """Device-seconds of step `step`'s training on one device (no data-parallel loss)."""
        return float(self.train_tokens[step] * self.train_s_per_token)

    def rollout_work(self, step: int) -> float:
        """Device-seconds of step `step`'s rollout at full utilisation: every iteration runs a
        full batch (so `base` is shared by `batch_limit` requests) and no engine waits for
        another. No placement on any number of engines needs less."""
        r = self.profile.rollout
        per_engine = (r.iter_base_s * self._sum_l[step] / self.batch_limit[step] + r.iter_per_seq_s * self._sum_l[step]
                      + r.iter_per_ctx_token_s * self._ctx[step] + r.prefill_per_token_s * self._sum_p[step])
        return float(per_engine * self._gpe)

    # -- training -----------------------------------------------------------------------
    def dp_efficiency(self, devices: int) -> float:
        return self.profile.training.dp_efficiency_per_doubling ** math.log2(devices)

    def train_table(self, devices: int) -> np.ndarray:
        """Training seconds (old log-probs + update) of every step on `devices` devices."""
        cached = self._train_cache.get(devices)
        if cached is None:
            if devices < 1:
                cached = np.full(self.steps, math.inf)
            else:
                rate = devices * self.dp_efficiency(devices)
                cached = self.train_tokens * self.train_s_per_token / rate + self.profile.training.step_overhead_s
            cached.setflags(write=False)
            self._train_cache[devices] = cached
        return cached

    def train_seconds(self, step: int, devices: int) -> float:
        return float(self.train_table(devices)[step])

    # -- the rest of a step -------------------------------------------------------------
    @property
    def weight_sync_s(self) -> float:
        return self.profile.sync.weight_sync_s

    @property
    def colocated_switch_s(self) -> float:
        return self.profile.sync.colocated_switch_s
