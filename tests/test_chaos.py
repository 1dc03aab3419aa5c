"""A fixed-seed slice of the chaos harness (benchmarks/chaos.py): real daemon processes, real
worker processes, lost/repeated/delayed/failed messages and SIGKILLs of both; every invariant holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


@pytest.mark.slow
def test_a_fixed_seed_slice_of_chaos_runs_keeps_every_invariant(tmp_path: Path) -> None:
    # Seeds 1000-1005 kill the daemon (6 times in all) and workers (6), and lose, repeat, delay
    # and fail messages; the benchmark runs many more (`python benchmarks/chaos.py --runs N`).
    done = subprocess.run([sys.executable, str(CHAOS), "--runs", "6", "--seed", "1000", "--jobs", "3",
                           "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["runs"] == 6
    assert report["violations"] == 0, json.dumps(report["violation_list"], indent=1)
    assert report["degraded_messages_only"] == 0
    assert report["recovery_s"]["p50"] is not None
    # the slice exercised what it claims to: resizes, and faults of each kind
    assert report["resizes_committed"] > 0 and report["resizes_rolled_back"] > 0
    assert report["daemon_restarts"] > 0 and report["workers_lost"] > 0
    injected = report["messages_injected"]
    assert injected["dropped"] > 0 and injected["delayed"] > 0 and injected["duplicated"] > 0
    # seeds 1000 and 1002 run a job that reports, and the policy lends inside its steps
    assert report["runs_with_loans"] == 2 and report["loans_started"] > 0 and report["loans_returned"] > 0
