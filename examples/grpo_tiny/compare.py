"""How a run of the example compares with the static split it started on (no torch needed)."""

from __future__ import annotations

from typing import Any


def static_comparison(summary: dict[str, Any], initial: str) -> str:
    """The run's last line without `--compare-static`: how it compares with the static split it
    started on, or plainly why that needs another run. A run where the daemon moved and lent
    nothing ran on the static split throughout: it is its own static run."""
    moved = summary["resizes"].get("committed", 0) if isinstance(summary["resizes"], dict) else summary["resizes"]
    lent = sum(e.startswith("LoanStarted:") for e in summary.get("events", []))
    if not moved and not lent:
        return (f"against the static split {initial}: the same run (the daemon moved and lent nothing, so it ran on "
                f"{initial} throughout: {summary['loop_s']:.1f}s either way)")
    return (f"against the static split {initial}: not measured; the daemon moved or lent devices "
            f"({moved} resize(s), {lent} loan(s)), so the static split needs its own run on the same seeds: "
            "add --compare-static (each static split takes about as long as this run)")
