"""The example's ledger check reads the trainers' ledgers only once every rank has finished
writing: the last step's publisher (the lowest rank) is ahead of the others' last lines."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from examples.grpo_tiny.ledger import LedgerIncomplete, ledger_path, mark_done, read_trained, wait_trained


def write(trained: Path, rank: int, step: int, ids: list[str]) -> None:
    with ledger_path(trained, rank).open("a") as fh:
        fh.write(json.dumps({"step": step, "mini_batch": 0, "rank": rank, "micro_batches": [0],
                             "sample_ids": ids}) + "\n")


def test_a_ledger_is_not_read_while_a_rank_may_still_write(tmp_path: Path) -> None:
    write(tmp_path, 0, 23, ["a", "b"])
    mark_done(tmp_path, 0)
    with pytest.raises(LedgerIncomplete, match=r"\[1\]"):
        read_trained(tmp_path, 2)


def test_the_wait_sees_the_last_line_a_slower_rank_writes(tmp_path: Path) -> None:
    # Rank 0 published the last step and is done; rank 1 appends its half of that step later.
    write(tmp_path, 0, 23, ["a", "b"])
    mark_done(tmp_path, 0)
    write(tmp_path, 1, 22, ["x"])

    def slow_rank() -> None:
        time.sleep(0.3)
        write(tmp_path, 1, 23, ["c", "d"])
        mark_done(tmp_path, 1)

    writer = threading.Thread(target=slow_rank)
    writer.start()
    try:
        trained = asyncio.run(wait_trained(tmp_path, 2, timeout_s=30))
    finally:
        writer.join()
    assert sorted(trained[23]) == ["a", "b", "c", "d"]
    assert trained[22] == ["x"]


def test_a_rank_that_never_trained_has_no_ledger_but_a_marker(tmp_path: Path) -> None:
    write(tmp_path, 0, 0, ["a"])
    mark_done(tmp_path, 0)
    mark_done(tmp_path, 1, "finished")
    assert read_trained(tmp_path, 2) == {0: ["a"]}


def test_the_wait_gives_up_naming_the_ranks_and_runs_the_drivers_check(tmp_path: Path) -> None:
    checks = []
    with pytest.raises(LedgerIncomplete, match=r"\[0, 1\].*within 0.1s"):
        asyncio.run(wait_trained(tmp_path, 2, timeout_s=0.1, check=lambda: checks.append(1)))
    assert checks
