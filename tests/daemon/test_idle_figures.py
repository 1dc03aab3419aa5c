"""Idle figures through the real daemon: a worker reports steps over ZeroMQ, and `status`,
`events` and the Prometheus endpoint show the figures docs/idle.md defines, "unknown" (NaN,
null) where a stage was not measured, and the same figures after a restart on the log."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request

from dynaresized.client import BlockingWorkerClient
from dynaresized.domain import StepTiming, WorkerKind

from .conftest import DEVICES


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynaresized.cli", *args], capture_output=True, text=True,
                          timeout=60)


def metric(url: str, name: str, labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not exported")


def wait_for_step(daemon, step: int) -> None:
    deadline = time.monotonic() + 20
    while daemon.status()["last_step"] != step:
        assert time.monotonic() < deadline, f"step {step} was not observed"
        time.sleep(0.05)


def test_status_events_and_metrics_show_idle_figures(make_daemon) -> None:
    daemon = make_daemon()  # 4 devices: 2 training, 2 rollout
    ctl = ["--control", daemon.control_endpoint]
    assert "idle        rollout unknown (last step unknown), training unknown" in cli("status", *ctl).stdout
    trainer = BlockingWorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    trainer.start()
    try:
        trainer.report_step(StepTiming(step=0, rollout_s=0.0, train_s=4.0))  # no rollout time: unknown
        wait_for_step(daemon, 0)
        value = metric(daemon.metrics_url, "dynaresized_pool_idle_ratio", 'pool="rollout"')
        assert math.isnan(value)
        # period max(6, 2) + 1 = 7: rollout busy 7 of 7, training busy 3 of 7 (4/7 idle)
        trainer.report_step(StepTiming(step=1, rollout_s=6.0, train_s=2.0, weight_sync_s=1.0))
        wait_for_step(daemon, 1)
    finally:
        trainer.close()
    assert metric(daemon.metrics_url, "dynaresized_pool_idle_ratio", 'pool="training"') == 4 / 7
    assert metric(daemon.metrics_url, "dynaresized_pool_idle_device_seconds", 'pool="training"') == 8.0
    assert metric(daemon.metrics_url, "dynaresized_pool_idle_unknown_steps", 'pool="rollout"') == 1.0

    data = json.loads(cli("status", "--json", *ctl).stdout)
    assert data["idle"]["pools"]["training"]["ratio"] == 4 / 7
    assert data["idle"]["devices"][DEVICES[3]]["ratio"] == 0.0
    text = cli("status", *ctl).stdout
    assert "training 57.1% (last step 57.1%)" in text and "1 step(s) accounted, 1 unknown" in text

    events = [json.loads(x) for x in cli("events", "--state-dir", str(daemon.state_dir),
                                          "--type", "step_observed").stdout.splitlines()]
    assert [e["idle_ratio"] for e in events] == [{"rollout": None, "training": None},
                                                 {"rollout": 0.0, "training": 4 / 7}]

    daemon.stop()
    daemon.start()  # the figures are folded from the log: a restart shows the same
    assert json.loads(cli("status", "--json", *ctl).stdout)["idle"] == data["idle"]
