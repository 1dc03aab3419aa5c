"""The trained-once half of the example's ledger: what every trainer rank trained on, read only
once every rank has finished writing it.

Each rank appends one line per optimizer step to `trained/rank<r>.jsonl` and, when its training
loop has ended (no line can follow), writes `trained/rank<r>.done`. The lowest rank publishes a
step's policy version before the other ranks have necessarily appended their last line of that
step, so the driver waits for every rank's marker before it reads: reading earlier can call a
correct run wrong ("trained on 256 sample ids, requested 512" for the last step).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path


class LedgerIncomplete(RuntimeError):
    """Some trainer rank has not finished writing its ledger."""


def ledger_path(trained: Path, rank: int) -> Path:
    return trained / f"rank{rank}.jsonl"


def done_path(trained: Path, rank: int) -> Path:
    return trained / f"rank{rank}.done"


def mark_done(trained: Path, rank: int, state: str = "") -> None:
    """Rank `rank` will append nothing more to its ledger (call it after the last line is flushed)."""
    tmp = trained / f".rank{rank}.done.tmp"
    tmp.write_text(json.dumps({"rank": rank, "state": state}))
    os.replace(tmp, done_path(trained, rank))


def unfinished(trained: Path, ranks: int) -> list[int]:
    """The ranks of `range(ranks)` that have not marked their ledger done."""
    return [r for r in range(ranks) if not done_path(trained, r).exists()]


def read_trained(trained: Path, ranks: int) -> dict[int, list[str]]:
    """RL step -> every sample id trained on in it, over all ranks' ledgers. Raises
    `LedgerIncomplete` while any rank of `range(ranks)` may still write."""
    missing = unfinished(trained, ranks)
    if missing:
        raise LedgerIncomplete(f"trainer rank(s) {missing} have not finished writing their ledger in {trained}")
    steps: dict[int, list[str]] = {}
    for rank in range(ranks):
        path = ledger_path(trained, rank)
        if not path.exists():  # a rank that never trained (parked for the whole run)
            continue
        for row in path.read_text().splitlines():
            rec = json.loads(row)
            steps.setdefault(rec["step"], []).extend(rec["sample_ids"])
    return steps


async def wait_trained(trained: Path, ranks: int, timeout_s: float,
                       check: Callable[[], None] = lambda: None) -> dict[int, list[str]]:
    """`read_trained` once every rank has marked its ledger done. `check` runs while waiting
    (the driver's: raise if a trainer died); `LedgerIncomplete` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while unfinished(trained, ranks):
        check()
        if time.monotonic() > deadline:
            raise LedgerIncomplete(f"trainer rank(s) {unfinished(trained, ranks)} did not finish writing their "
                                   f"ledger in {trained} within {timeout_s:g}s")
        await asyncio.sleep(0.02)
    return read_trained(trained, ranks)
