"""The nearest known name to one a person typed: the "did you mean" of an error message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the closest of `known` to `word`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
