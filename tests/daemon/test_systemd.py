"""systemd integration: the unit passes `systemd-analyze verify`; the notify protocol is spoken
to a real unix datagram socket standing in for NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[2] / "systemd" / "dynaresized.service"


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing in CI (.ci/run installs the Debian package systemd)")
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    exe = Path(sys.executable).parent / "dynaresized"  # the venv's script; the venv need not be on PATH
    assert exe.exists(), f"the dynaresized console script is installed next to {sys.executable}"
    unit = tmp_path / "dynaresized.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/dynaresized", str(exe)))
    result = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "dynaresized.service" not in result.stderr, result.stderr  # no warnings about our unit


def test_unit_declares_what_the_daemon_relies_on() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StateDirectory=dynaresized",
                 "ConfigurationDirectory=dynaresized", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "RestartPreventExitStatus=6"):
        assert line in text


def test_ready_and_watchdog_reach_the_notify_socket(make_daemon, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    daemon = make_daemon(start=False, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    daemon.start(wait=False)
    try:
        seen: list[str] = []
        while not any("WATCHDOG=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
        ready = next(m for m in seen if "READY=1" in m)
        assert f"MAINPID={daemon.proc.pid}" in ready
        assert seen.index(ready) < next(i for i, m in enumerate(seen) if "WATCHDOG=1" in m)
        daemon.wait_ready()  # READY=1 was sent only once the control endpoint answers
        daemon.stop()
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
    finally:
        sock.close()
