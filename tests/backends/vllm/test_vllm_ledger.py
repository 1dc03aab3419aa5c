"""The step ledger on its own: placements, hand-overs, stale completions and the boundary check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresized.backends.vllm.ledger import LedgerError, SampleResult, StepLedger


def result(ledger: StepLedger, attempt, version: int | None = None, tokens=(5, 6)) -> SampleResult:
    return SampleResult(
        sample_id=attempt.sample_id,
        step=ledger.step,
        policy_version=ledger.policy_version if version is None else version,
        engine_id=attempt.engine_id,
        attempt=attempt.number,
        token_ids=tuple(tokens),
        finish_reason="length",
    )


def test_every_sample_once_passes_the_check() -> None:
    ledger = StepLedger(3, 7, ["a", "b"])
    for sid, engine in (("a", "e0"), ("b", "e1")):
        attempt = ledger.place(sid, engine)
        assert ledger.complete(attempt, result(ledger, attempt))
    summary = ledger.check()
    assert (summary.samples, summary.placements, summary.handed_over, summary.discarded) == (2, 2, 0, 0)
    assert summary.response_tokens == 4
    assert [r.sample_id for r in ledger.results()] == ["a", "b"]


def test_missing_samples_are_named() -> None:
    ledger = StepLedger(1, 0, ["a", "b", "c"])
    attempt = ledger.place("b", "e0")
    ledger.complete(attempt, result(ledger, attempt))
    with pytest.raises(LedgerError) as err:
        ledger.check()
    assert err.value.missing == ("a", "c")
    assert "step 1" in str(err.value) and "2 missing: a, c" in str(err.value)


def test_a_superseded_attempt_cannot_complete_and_the_new_one_does() -> None:
    ledger = StepLedger(0, 0, ["a"])
    first = ledger.place("a", "e1")
    assert ledger.supersede(first, lost=False)
    second = ledger.place("a", "e0")
    assert second.number == 2 and second.request_id != first.request_id
    assert not ledger.complete(first, result(ledger, first))  # the drained engine finished late
    assert ledger.complete(second, result(ledger, second))
    summary = ledger.check()
    assert (summary.handed_over, summary.discarded, summary.placements) == (1, 1, 2)
    assert ledger.results()[0].engine_id == "e0"


def test_a_completion_from_another_policy_version_breaks_the_step() -> None:
    ledger = StepLedger(2, 5, ["a"])
    attempt = ledger.place("a", "e0")
    ledger.complete(attempt, result(ledger, attempt, version=4))
    with pytest.raises(LedgerError) as err:
        ledger.check()
    assert err.value.wrong_version == ("a",)


def test_bad_input_is_refused_with_the_name_of_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="repeated: a"):
        StepLedger(0, 0, ["a", "b", "a"])
    ledger = StepLedger(0, 0, ["a"])
    with pytest.raises(KeyError, match="'zz' is not part of this step"):
        ledger.place("zz", "e0")
    attempt = ledger.place("a", "e0")
    with pytest.raises(RuntimeError, match="already placed"):
        ledger.place("a", "e1")
    ledger.complete(attempt, result(ledger, attempt))
    with pytest.raises(RuntimeError, match="already completed"):
        ledger.place("a", "e1")


def test_the_error_names_duplicates() -> None:
    err = LedgerError(4, duplicated=("x", "y"))
    assert str(err) == "step 4 ledger broken: 2 duplicated: x, y"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["done", "drain", "lose", "late"]), st.integers(0, 9)), max_size=80))
def test_any_interleaving_ends_with_each_sample_exactly_once(script: list[tuple[str, int]]) -> None:
    """Whatever order hand-overs, losses and late completions come in, re-placing every
    superseded sample and finishing the rest yields each sample exactly once."""
    ids = [f"s{i}" for i in range(10)]
    ledger = StepLedger(0, 1, ids)
    current = {sid: ledger.place(sid, "e0") for sid in ids}
    stale = []
    for action, index in script:
        sid = ids[index]
        attempt = current.get(sid)
        if attempt is None:
            continue
        if action == "done":
            assert ledger.complete(attempt, result(ledger, attempt))
            del current[sid]
        elif action in ("drain", "lose"):
            assert ledger.supersede(attempt, lost=action == "lose")
            stale.append(attempt)
            current[sid] = ledger.place(sid, "e1")
        elif stale:
            late = stale.pop()
            assert not ledger.complete(late, result(ledger, late))
    for attempt in current.values():
        assert ledger.complete(attempt, result(ledger, attempt))
    summary = ledger.check()
    assert summary.samples == 10 and ledger.finished
    assert summary.placements == 10 + summary.handed_over + summary.lost
