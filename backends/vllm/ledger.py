"""The per-step accounting ledger: proof that every sample of a rollout step was produced once.

A step owns a fixed set of sample ids. Each time the router places a sample on an engine it
opens an *attempt*; a drain or an engine loss supersedes the attempt (the partial output is
dropped and the sample is placed again). Only the sample's current attempt may complete it:
a completion that arrives from a superseded attempt is counted as discarded, never recorded.
`check()` runs at the step boundary and raises `LedgerError` naming every missing, duplicated
or wrongly versioned sample. The ledger is pure bookkeeping: no engine, clock or IO.
"""

from __future__ import annotations

import msgspec

SampleId = str
EngineId = str


class SampleResult(msgspec.Struct, frozen=True):
    """One generated sample, as handed to the trainer."""

    sample_id: SampleId
    step: int
    policy_version: int  # the weights version that generated every token of the response
    engine_id: EngineId
    attempt: int  # 1 for the first placement, +1 per hand-over
    token_ids: tuple[int, ...]
    finish_reason: str


class LedgerError(AssertionError):
    """The step's accounting is broken: samples missing, duplicated or off-version."""

    def __init__(
        self,
        step: int,
        *,
        missing: tuple[SampleId, ...] = (),
        duplicated: tuple[SampleId, ...] = (),
        wrong_version: tuple[SampleId, ...] = (),
    ) -> None:
        self.step = step
        self.missing = missing
        self.duplicated = duplicated
        self.wrong_version = wrong_version
        parts = []
        for label, ids in (
            ("missing", missing),
            ("duplicated", duplicated),
            ("wrong policy version", wrong_version),
        ):
            if ids:
                shown = ", ".join(ids[:20]) + (f" … (+{len(ids) - 20})" if len(ids) > 20 else "")
                parts.append(f"{len(ids)} {label}: {shown}")
        super().__init__(f"step {step} ledger broken: " + "; ".join(parts))


class Attempt(msgspec.Struct, frozen=True):
    """One placement of a sample on an engine; `request_id` is what vLLM knows it by."""

    sample_id: SampleId
    number: int
    engine_id: EngineId
    request_id: str


class LedgerSummary(msgspec.Struct, frozen=True):
    step: int
    samples: int
    placements: int  # attempts opened (>= samples)
    handed_over: int  # attempts superseded by a drain
    lost: int  # attempts superseded because their engine died or stopped answering
    discarded: int  # completions that arrived from superseded attempts, not recorded
    response_tokens: int


class StepLedger:
    """Accounting of one rollout step: who was placed where, what completed, what was dropped."""

    def __init__(self, step: int, policy_version: int, sample_ids: list[SampleId] | tuple[SampleId, ...]) -> None:
        ids = list(sample_ids)
        seen: set[SampleId] = set()
        repeated = sorted({s for s in ids if s in seen or seen.add(s)})  # type: ignore[func-returns-value]
        if repeated:
            raise ValueError(f"step {step}: sample ids must be unique, repeated: {', '.join(repeated)}")
        self.step = step
        self.policy_version = policy_version
        self.sample_ids: tuple[SampleId, ...] = tuple(ids)
        self._current: dict[SampleId, Attempt] = {}
        self._attempts: dict[SampleId, int] = {s: 0 for s in ids}
        self._results: dict[SampleId, list[SampleResult]] = {}
        self.placements = 0
        self.handed_over = 0
        self.lost = 0
        self.discarded = 0

    # -- the router's side -------------------------------------------------------------
    def place(self, sample_id: SampleId, engine_id: EngineId) -> Attempt:
        """Open the next attempt of a sample on an engine."""
        if sample_id not in self._attempts:
            raise KeyError(f"step {self.step}: sample {sample_id!r} is not part of this step")
        if sample_id in self._current:
            raise RuntimeError(
                f"step {self.step}: sample {sample_id!r} is already placed "
                f"(attempt {self._current[sample_id].number} on {self._current[sample_id].engine_id})"
            )
        if sample_id in self._results:
            raise RuntimeError(f"step {self.step}: sample {sample_id!r} already completed; not placing it again")
        number = self._attempts[sample_id] + 1
        self._attempts[sample_id] = number
        attempt = Attempt(sample_id, number, engine_id, f"s{self.step}-{sample_id}-a{number}")
        self._current[sample_id] = attempt
        self.placements += 1
        return attempt

    def supersede(self, attempt: Attempt, *, lost: bool) -> bool:
        """Drop an in-flight attempt (drain hand-over, or its engine was lost).

        Returns False if the attempt is no longer current (it completed, or was dropped already).
        """
        if self._current.get(attempt.sample_id) != attempt:
            return False
        del self._current[attempt.sample_id]
        if lost:
            self.lost += 1
        else:
            self.handed_over += 1
        return True

    def complete(self, attempt: Attempt, result: SampleResult) -> bool:
        """Record a finished sample if `attempt` is still the sample's current one.

        A completion from a superseded attempt is discarded (and counted) rather than recorded:
        the sample has been placed again and that placement owns it now.
        """
        if result.sample_id != attempt.sample_id:
            raise ValueError(f"result for {result.sample_id!r} reported under attempt of {attempt.sample_id!r}")
        if self._current.get(attempt.sample_id) != attempt:
            self.discarded += 1
            return False
        del self._current[attempt.sample_id]
        self._results.setdefault(attempt.sample_id, []).append(result)
        return True

    # -- views ----------------------------------------------------------------------------
    def in_flight(self, engine_id: EngineId | None = None) -> list[Attempt]:
        return [a for a in self._current.values() if engine_id is None or a.engine_id == engine_id]

    def current(self, sample_id: SampleId) -> Attempt | None:
        return self._current.get(sample_id)

    @property
    def done(self) -> int:
        return len(self._results)

    @property
    def finished(self) -> bool:
        return len(self._results) == len(self.sample_ids) and not self._current

    def results(self) -> list[SampleResult]:
        """The step's samples in the order the step listed them (first record of each)."""
        return [self._results[s][0] for s in self.sample_ids if s in self._results]

    def summary(self) -> LedgerSummary:
        return LedgerSummary(
            step=self.step,
            samples=len(self.sample_ids),
            placements=self.placements,
            handed_over=self.handed_over,
            lost=self.lost,
            discarded=self.discarded,
            response_tokens=sum(len(r[0].token_ids) for r in self._results.values()),
        )

    def check(self) -> LedgerSummary:
        """At the step boundary: every sample exactly once, from the step's policy version."""
        missing = tuple(s for s in self.sample_ids if s not in self._results)
        duplicated = tuple(s for s in self.sample_ids if len(self._results.get(s, ())) > 1)
        wrong_version = tuple(
            s
            for s in self.sample_ids
            if any(r.policy_version != self.policy_version or r.step != self.step for r in self._results.get(s, ()))
        )
        if missing or duplicated or wrong_version:
            raise LedgerError(self.step, missing=missing, duplicated=duplicated, wrong_version=wrong_version)
        return self.summary()
