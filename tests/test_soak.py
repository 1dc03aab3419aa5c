"""The soak benchmark (benchmarks/soak.py), CI-sized: a real daemon serving 128 devices' workers
for a minute under resizes, loans, a junk flood and a chatty worker keeps every worker
answered within the heartbeat timeout, loses none, refuses what it should, and stays up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
KEYS = {"ack_silence_max_s", "heartbeat_rtt_ms", "rss_mib", "log_bytes_per_hour", "workers_lost",
        "refusals_by_reason", "resizes_committed", "loans_started", "replay_s", "daemon_alive", "load_avg_1m",
        "devices", "duration_s", "warmup_s", "step_s", "chatty_per_s", "frame_bytes", "daemon_limits"}


@pytest.mark.slow
def test_a_ci_sized_soak_keeps_every_worker_answered_and_refuses_the_flood_and_the_chatty_worker() -> None:
    done = subprocess.run([sys.executable, str(SOAK), "--devices", "128", "--duration-s", "60"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert KEYS <= report.keys(), KEYS - report.keys()
    assert report["daemon_alive"] is True
    assert report["workers_lost"] == 0 and report["live_at_end"] == 2 * 128
    assert 0 < report["ack_silence_max_s"] < report["daemon_limits"]["heartbeat_timeout_s"]
    rtt = report["heartbeat_rtt_ms"]
    assert rtt["acks"] > 0 and 0 < rtt["p50"] <= rtt["p99"] <= rtt["max"]
    rss = report["rss_mib"]
    assert 0 < rss["start"] <= rss["peak"] and 0 < rss["end"] <= rss["peak"] and rss["samples_after_warmup"] > 2
    assert report["log_bytes_per_hour"] > 0 and report["replay_s"] >= 0
    # the job did what the run claims: resizes (guards opened) and loans (engines idle mid-step)
    assert report["resizes_committed"] > 0 and report["loans_started"] > 0
    # the flood was refused and cut, the chatty engine held to daemon.report_rate
    refused = report["refusals_by_reason"]
    assert refused["decode_errors"] and refused["connections_cut"]
    assert refused["refusals"].get("rate_limited", 0) > 0
    assert report["chatty_reports_sent"] > refused["refusals"]["rate_limited"] > 0
