"""RL rollout workloads for the simulator: trace files and the built-in seeded scenarios.

A trace is one batch of samples per RL step, each sample a (prompt tokens, response tokens)
pair. Users bring their own as JSON Lines (one line per step, see `load_trace`); the built-in
scenarios are generated from seeded distributions, so the same seed always gives the same
trace, bit for bit.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np


@dataclass(frozen=True, eq=False)
class StepBatch:
    """The samples of one RL step. Arrays are int64, aligned, one entry per sample."""

    step: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    trained: np.ndarray | None = None
    """Which samples the trainer trains on (bool, aligned); None: all of them. Dynamic sampling
    (DAPO) generates samples it then filters out: they cost rollout time but no training."""

    @property
    def samples(self) -> int:
        return int(self.response_tokens.shape[0])

    @property
    def trained_mask(self) -> np.ndarray:
        if self.trained is None:
            return np.ones(self.samples, dtype=bool)
        return self.trained


@dataclass(frozen=True, eq=False)
class Trace:
    """A named sequence of RL steps, numbered 0..len-1."""

    name: str
    steps: tuple[StepBatch, ...]

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[StepBatch]:
        return iter(self.steps)

    def head(self, count: int) -> Trace:
        """The first `count` steps (all of them if the trace is shorter)."""
        if count < 1:
            raise ValueError(f"a trace needs at least one step, got steps={count}")
        return Trace(self.name, self.steps[:count])


class TraceError(ValueError):
    """A trace file is malformed; the message names the file and line."""


class _TraceLine(msgspec.Struct, omit_defaults=True):
    # Unknown fields (rewards, advantages, …) are ignored: users export from their own logs.
    step: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    trained: list[bool] | None = None


_line_decoder = msgspec.json.Decoder(_TraceLine)


def load_trace(path: str | Path) -> Trace:
    """Read a JSON Lines trace: one line per RL step, steps 0, 1, 2, … in order.

    Every problem is reported with its line number; nothing is skipped silently.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    lines = raw.split(b"\n")
    if lines and lines[-1].strip() == b"":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise TraceError(f"{path}: the trace is empty (expected one JSON object per line, one line per step)")
    steps: list[StepBatch] = []
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        if not line.strip():
            raise TraceError(f"{where}: empty line; every line must be one step's JSON object")
        try:
            rec = _line_decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{where}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc})") from None
        expected = len(steps)
        if rec.step != expected:
            if rec.step > expected:
                missing = f"step {expected} is missing" if rec.step == expected + 1 else (
                    f"steps {expected}..{rec.step - 1} are missing")
                raise TraceError(f"{where}: step {rec.step} where step {expected} was expected ({missing})")
            raise TraceError(
                f"{where}: step {rec.step} where step {expected} was expected (steps must be 0, 1, 2, … in order)"
            )
        if len(rec.prompt_tokens) != len(rec.response_tokens):
            raise TraceError(
                f"{where}: prompt_tokens has {len(rec.prompt_tokens)} entries but response_tokens has "
                f"{len(rec.response_tokens)}; both need one entry per sample"
            )
        if not rec.response_tokens:
            raise TraceError(f"{where}: step {rec.step} has no samples")
        if rec.trained is not None and len(rec.trained) != len(rec.response_tokens):
            raise TraceError(
                f"{where}: trained has {len(rec.trained)} entries but response_tokens has "
                f"{len(rec.response_tokens)}; trained needs one true/false per sample"
            )
        prompt = np.asarray(rec.prompt_tokens, dtype=np.int64)
        response = np.asarray(rec.response_tokens, dtype=np.int64)
        if prompt.min() < 0:
            raise TraceError(f"{where}: prompt_tokens[{int(prompt.argmin())}] = {int(prompt.min())} is negative")
        if response.min() < 1:
            raise TraceError(
                f"{where}: response_tokens[{int(response.argmin())}] = {int(response.min())}; "
                "a response has at least one token"
            )
        trained = None if rec.trained is None else np.asarray(rec.trained, dtype=bool)
        steps.append(StepBatch(rec.step, prompt, response, trained))
    return Trace(path.stem, tuple(steps))


def dump_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` in the JSON Lines format `load_trace` reads."""
    enc = msgspec.json.Encoder()
    with open(path, "wb") as out:
        for b in trace:
            trained = None if b.trained is None else b.trained.tolist()
            line = _TraceLine(b.step, b.prompt_tokens.tolist(), b.response_tokens.tolist(), trained)
            out.write(enc.encode(line) + b"\n")


# -- built-in scenarios ------------------------------------------------------------------

P99_Z = 2.3263478740408408  # the standard normal's 99th percentile
TAIL_SIGMA = math.log(10.0) / P99_Z  # lognormal sigma for which p99 = 10 x median (≈ 0.99)


class Shape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a built-in scenario draws one step's samples (see `_draw`)."""

    samples_per_step: int
    samples_per_prompt: int
    max_response_tokens: int
    prompt_median: float = 180.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    steps: int
    draw: Callable[[np.random.Generator, int, int, Shape], StepBatch]


def _prompts(rng: np.random.Generator, shape: Shape) -> tuple[np.ndarray, int]:
    prompts = -(-shape.samples_per_step // shape.samples_per_prompt)
    per_prompt = rng.lognormal(math.log(shape.prompt_median), 0.45, size=prompts)
    return np.repeat(np.maximum(per_prompt, 8.0), shape.samples_per_prompt)[: shape.samples_per_step], prompts


def _lognormal_responses(
    rng: np.random.Generator, shape: Shape, median: float, sigma: float, prompt_share: float = 0.35
) -> np.ndarray:
    """Lognormal response lengths with total log-sigma `sigma`. A share of the variance is per
    prompt (hard prompts make every sample long), the rest per sample; lengths are clipped at
    the maximum response length, as the engine truncates them."""
    prompts = -(-shape.samples_per_step // shape.samples_per_prompt)
    sp = sigma * math.sqrt(prompt_share)
    ss = sigma * math.sqrt(1.0 - prompt_share)
    per_prompt = np.repeat(rng.normal(0.0, sp, size=prompts), shape.samples_per_prompt)[: shape.samples_per_step]
    per_sample = rng.normal(0.0, ss, size=shape.samples_per_step)
    lengths = np.exp(math.log(median) + per_prompt + per_sample)
    return np.clip(lengths, 1.0, shape.max_response_tokens)


def _batch(step: int, prompt: np.ndarray, response: np.ndarray) -> StepBatch:
    return StepBatch(step, np.rint(prompt).astype(np.int64), np.rint(response).astype(np.int64))


def _geometric(start: float, end: float, step: int, steps: int) -> float:
    frac = step / max(steps - 1, 1)
    return start * (end / start) ** frac


def _stationary(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    prompt, _ = _prompts(rng, shape)
    return _batch(step, prompt, _lognormal_responses(rng, shape, 1800.0, TAIL_SIGMA))


def _drift(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    # Reasoning RL: the median response grows ~6x over the run (as in DAPO/DeepSeek-R1-style runs).
    prompt, _ = _prompts(rng, shape)
    median = _geometric(600.0, 3600.0, step, steps)
    return _batch(step, prompt, _lognormal_responses(rng, shape, median, TAIL_SIGMA))


def _shrinking(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    # A length penalty (or an efficiency reward) at work: the median response falls ~4x and the
    # tail falls faster, since the longest responses are the ones the penalty hits hardest
    # (p99 goes from ~14x to ~3x the median).
    prompt, _ = _prompts(rng, shape)
    frac = step / max(steps - 1, 1)
    median = _geometric(3200.0, 800.0, step, steps)
    sigma = 1.15 + (0.5 - 1.15) * frac
    return _batch(step, prompt, _lognormal_responses(rng, shape, median, sigma))


def _bimodal(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    # Short direct answers mixed with very long reasoning; the mix itself wanders a little.
    prompt, prompts = _prompts(rng, shape)
    long_share = float(np.clip(0.35 + 0.1 * math.sin(step / 9.0) + rng.normal(0.0, 0.03), 0.1, 0.9))
    reasoning = np.repeat(rng.random(prompts) < long_share, shape.samples_per_prompt)[: shape.samples_per_step]
    short = _lognormal_responses(rng, shape, 250.0, 0.5)
    long = _lognormal_responses(rng, shape, 6000.0, 0.45)
    return _batch(step, prompt, np.where(reasoning, long, short))


def _noisy(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    # Stationary on average, but each step's median and tail weight jump around: a policy that
    # reacts to one step's imbalance thrashes.
    prompt, _ = _prompts(rng, shape)
    median = 1800.0 * math.exp(rng.normal(0.0, 0.3))
    sigma = TAIL_SIGMA * float(rng.uniform(0.6, 1.3))
    return _batch(step, prompt, _lognormal_responses(rng, shape, median, sigma))


def _verl_dapo(rng: np.random.Generator, step: int, steps: int, shape: Shape) -> StepBatch:
    # Shaped like verl's fully-async benchmark workload (Qwen2.5-Math-7B on DAPO-Math-17k):
    # 16 samples per prompt, 28K max response, long reasoning with a sizeable truncated share.
    prompt, _ = _prompts(rng, shape)
    return _batch(step, prompt, _lognormal_responses(rng, shape, 650.0, 1.25, prompt_share=0.5))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("longtail-stationary", "lognormal response lengths, median 1.8K tokens, p99 = 10x median", 200,
                 _stationary),
        Scenario("longtail-drift", "median response grows 600 -> 3.6K tokens over the run (p99 = 10x median)", 200,
                 _drift),
        Scenario("shrinking", "median response falls 4K -> 800 tokens over the run", 200, _shrinking),
        Scenario("bimodal", "short answers (median 250) mixed with long reasoning (median 6K), mix wanders", 200,
                 _bimodal),
        Scenario("noisy", "stationary on average; each step's median (x e^N(0,0.3)) and tail weight jump", 200,
                 _noisy),
        Scenario("verl-dapo", "shaped like verl's DAPO benchmark: 16 samples/prompt, 28K max response", 20,
                 _verl_dapo),
    )
}

DYNAMIC_SCENARIOS: tuple[str, ...] = ("longtail-stationary", "longtail-drift", "shrinking", "bimodal", "noisy")
"""The scenarios `bench` runs (verl-dapo is the calibration workload, run by its own test)."""


def lognormal_trace(name: str, shape: Shape, *, median: float, sigma: float = TAIL_SIGMA, steps: int,
                    seed: int = 0) -> Trace:
    """A stationary trace like `longtail-stationary` with its own median response and tail
    (log-sigma), for a profile whose workload the built-in scenarios do not describe (e.g. a
    published setup, `benchmarks/verl_published.py`)."""
    if steps < 1 or median < 1 or sigma < 0:
        raise ValueError(f"steps >= 1, median >= 1, sigma >= 0; got {steps}, {median}, {sigma}")
    rng = np.random.default_rng([zlib.crc32(name.encode()), seed])
    batches = []
    for k in range(steps):
        prompt, _ = _prompts(rng, shape)
        batches.append(_batch(k, prompt, _lognormal_responses(rng, shape, median, sigma)))
    return Trace(name, tuple(batches))


class UnknownScenarioError(LookupError):
    pass


def scenario_trace(name: str, shape: Shape, *, seed: int = 0, steps: int | None = None) -> Trace:
    """Generate the built-in scenario `name`; the same (name, shape, seed, steps) gives the
    same trace bit for bit."""
    try:
        scenario = SCENARIOS[name]
    except KeyError:
        raise UnknownScenarioError(
            f"unknown scenario {name!r}; built-in scenarios: {', '.join(SCENARIOS)}"
        ) from None
    count = scenario.steps if steps is None else steps
    if count < 1:
        raise ValueError(f"steps must be >= 1, got {count}")
    for field in ("samples_per_step", "samples_per_prompt", "max_response_tokens"):
        if getattr(shape, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(shape, field)}")
    # One stream per (scenario, seed): adding a scenario never changes another's trace.
    rng = np.random.default_rng([zlib.crc32(name.encode()), seed])
    return Trace(name, tuple(scenario.draw(rng, k, count, shape) for k in range(count)))
