"""What every end-to-end run of examples/grpo_tiny must hold, for the e2e tests to share."""

from __future__ import annotations

from typing import Any


def assert_every_sample_once(runs: dict[str, dict[str, Any]], steps: int, samples_per_step: int) -> None:
    """Every sample of every step produced once and trained on once, and no resize left in flight."""
    for name, summary in runs.items():
        assert summary["ledger_ok"], (name, summary["ledger_problems"])
        assert summary["phase"] == "steady", (name, summary["events"])
        assert len(summary["sample_hashes"]) == steps
        assert all(len(h) == samples_per_step for h in summary["sample_hashes"])


def assert_same_rl(a: dict[str, Any], b: dict[str, Any], steps: int) -> None:
    """Two runs with the same seeds saw the same RL: versions, per-sample hashes, parameter digests."""
    assert a["versions"] == b["versions"] == [max(s - 1, 0) for s in range(steps)]  # one step off-policy
    # per-request seeds + batch-invariant CPU decoding: the same tokens whichever engine ran them
    for step, (ha, hb) in enumerate(zip(a["sample_hashes"], b["sample_hashes"], strict=True)):
        assert ha == hb, f"step {step}: samples differ between the two runs"
    # deterministic reduction: the same parameters after every step, bitwise, on 1 or 2 ranks
    assert all(a["params_sha"]) and a["params_sha"] == b["params_sha"]
