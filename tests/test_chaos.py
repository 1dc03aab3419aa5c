"""A fixed-seed slice of the chaos harness (benchmarks/chaos.py): real daemon processes, real
worker processes, lost/repeated/delayed/failed messages and SIGKILLs; every invariant holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


@pytest.mark.slow
def test_a_fixed_seed_slice_of_chaos_runs_keeps_every_invariant(tmp_path: Path) -> None:
    # Message faults only (lost, repeated, delayed, reordered, failed answers): the runs with
    # SIGKILLs are the benchmark's (`python benchmarks/chaos.py --runs N`), see docs/benchmarks.md.
    done = subprocess.run([sys.executable, str(CHAOS), "--runs", "4", "--seed", "1000", "--jobs", "2", "--no-kills",
                           "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["runs"] == 4
    assert report["violations"] == 0, json.dumps(report["violation_list"], indent=1)
    assert report["degraded_messages_only"] == 0
    assert report["recovery_s"]["p50"] is not None
    # the slice exercised what it claims to: resizes, and faults of each kind
    assert report["resizes_committed"] + report["resizes_rolled_back"] > 0
    injected = report["messages_injected"]
    assert injected["dropped"] > 0 and injected["delayed"] > 0 and injected["duplicated"] > 0
