"""A fixed-seed slice of the chaos harness (benchmarks/chaos.py): real daemon processes, real
worker processes, lost/repeated/delayed/failed messages and SIGKILLs of both, resizes and
regroups; every invariant holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


@pytest.mark.slow
def test_a_fixed_seed_slice_of_chaos_runs_keeps_every_invariant(tmp_path: Path) -> None:
    # Seeds 1000-1008 kill the daemon (6 times in all) and workers (6), and lose, repeat, delay
    # and fail messages; the benchmark runs many more (`python benchmarks/chaos.py --runs N`).
    done = subprocess.run([sys.executable, str(CHAOS), "--runs", "9", "--seed", "1000", "--jobs", "3",
                           "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["runs"] == 9
    assert report["violations"] == 0, json.dumps(report["violation_list"], indent=1)
    assert report["degraded_messages_only"] == 0
    assert report["recovery_s"]["p50"] is not None
    # The slice exercised what it claims to. Only what a seed plans is asserted (kills, faulty
    # messages, loans), and outcomes that follow from it in nearly every run. Whether an injected
    # failure lands on an op mid-resize (a rollback) is a matter of timing: in 2000 benchmark
    # runs it did in 45% of the runs that fail messages, so a rollback is not asserted here; the
    # rollback paths have their own deterministic tests (tests/daemon/test_service.py).
    assert report["resizes_committed"] > 0
    # half the operator's requests are regroups, picked from what the status shows (9 of 9 seeds
    # tried started 6-9 of them); whether one commits or rolls back is timing
    assert report["regroups_started"] > 0
    assert report["daemon_restarts"] > 0 and report["workers_lost"] > 0
    injected = report["messages_injected"]
    assert injected["dropped"] > 0 and injected["delayed"] > 0 and injected["duplicated"] > 0
    # seeds 1000, 1002, 1006 and 1008 run a job that reports, and the policy lends inside its
    # steps; 1006 and 1008 kill nothing, and their loans came home in 95% of such benchmark runs
    assert report["runs_with_loans"] == 4 and report["loans_started"] > 0 and report["loans_returned"] > 0
