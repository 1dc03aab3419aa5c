"""The daemon on a full disk, for real: its state directory on a small tmpfs that the test fills.
While the event log cannot be written the daemon starts no transition, keeps answering
heartbeats and `status`, and says so (status, metric, log); what was stepped before is written,
in order, with nothing half-written, once there is space, and everything resumes by itself."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynaresized import wire
from dynaresized.client import WorkerClient
from dynaresized.core import facts as f
from dynaresized.domain import WorkerKind

from ..store.test_disk_full import fill_up
from .conftest import DEVICES, read_facts, until
from .test_bad_input import metric


@pytest.fixture
def small_disk(small_tmpfs) -> Path:  # type: ignore[no-untyped-def]
    """An 8 MiB tmpfs for the daemon's state directory (tests/conftest.py)."""
    return small_tmpfs("8m")


async def test_a_full_disk_stops_transitions_keeps_heartbeats_and_resumes_by_itself(make_daemon, small_disk) -> None:
    daemon = make_daemon(daemon={"state_dir": str(small_disk / "state")}, core={"heartbeat_timeout_s": 3.0})
    steady = WorkerClient(daemon.worker_endpoint, "steady", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    await steady.start()
    before = read_facts(daemon.state_dir)
    filler = small_disk / "filler"
    fill_up(filler)
    late = WorkerClient(daemon.worker_endpoint, "late", WorkerKind.TRAINER_RANK, (DEVICES[1],), hello_timeout_s=60)
    registering = asyncio.create_task(late.start())  # its registration is a fact: it waits for space
    try:
        status = await until(lambda: (s := daemon.status())["disk_full"] and s, timeout=15, what="disk_full in status")
        assert "full" in status["disk_full"] and "events.sqlite" in status["disk_full"]
        assert metric(daemon, "dynaresized_disk_full") == 1
        assert "the disk under the event log is full" in daemon.output()
        reply = daemon.control(wire.ResizeRequest(train=1, rollout=3))
        assert not reply.ok and "disk under the event log is full" in reply.message
        silence, end = 0.0, time.monotonic() + 4.0  # beyond the heartbeat timeout
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            silence = max(silence, time.monotonic() - steady._last_ack)
        assert silence < 3.0, f"heartbeats answered while the disk is full (silent {silence:.2f} s)"
        assert steady.registered and not registering.done(), "heartbeats answered; the registration waits"
        assert read_facts(daemon.state_dir) == before, "nothing written, nothing half-written"
    finally:
        filler.unlink()
    welcome = await asyncio.wait_for(registering, 30)
    assert welcome.worker_id == "late"
    await until(lambda: daemon.status()["disk_full"] == "", what="the daemon resumed by itself")
    assert metric(daemon, "dynaresized_disk_full") == 0
    after = read_facts(daemon.state_dir)
    assert after[:len(before)] == before
    assert any(isinstance(x, f.WorkerRegistered) and x.worker.worker_id == "late" for x in after[len(before):])
    assert not any(isinstance(x, f.ResizeStarted) for x in after), "no transition started while the disk was full"
    reply = daemon.control(wire.ResizeRequest(train=1, rollout=3))
    assert "disk" not in reply.message  # refused or started on its own merits again
    check = subprocess.run([sys.executable, "-m", "dynaresized.store", "check", str(daemon.state_dir / "events.sqlite")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    await late.close()
    await steady.close()
    assert daemon.proc.poll() is None
