"""systemd integration: the unit as shipped passes `systemd-analyze verify` and keeps its
`systemd-analyze security` exposure; the notify protocol is spoken to a real unix datagram
socket standing in for NOTIFY_SOCKET. No systemd runs here as PID 1 (a container without it),
so `systemctl reload` itself is not exercised: the SIGHUP it sends is, in test_service.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[2] / "systemd" / "dynaresized.service"


README = (Path(__file__).parents[2] / "README.md").read_text()


def _service_section() -> str:
    start = README.index("## Run it as a service")
    return README[start:README.index("\n## ", start + 1)]


def _systemd_analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing in CI (.ci/run installs the Debian package systemd)")
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    return analyze


def _exec_start() -> str:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split()[0]


def test_unit_as_shipped_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit file unchanged, verified in a root laid out the way README's "Run it as a service"
    installs: the console script at the unit's ExecStart path, the host's systemd units."""
    analyze = _systemd_analyze()
    exe = Path(sys.executable).parent / "dynaresized"  # the venv's script; the venv need not be on PATH
    assert exe.exists(), f"the dynaresized console script is installed next to {sys.executable}"
    root = tmp_path / "root"
    units = next(p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir())
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    for program in (Path(_exec_start()), Path("/bin/kill")):
        target = root / program.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(exe if program.name == "dynaresized" else program, target)
    result = subprocess.run([analyze, "verify", "--man=no", f"--root={root}", UNIT.name], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert "dynaresized.service" not in result.stderr, result.stderr  # no warnings about our unit


def test_readme_installs_where_the_unit_looks() -> None:
    exec_start = _exec_start()
    venv = str(Path(exec_start).parents[1])
    steps = _service_section()
    block = steps[steps.index("```sh"):steps.index("```", steps.index("```sh") + 5)]
    lines = [x.split("#")[0].strip() for x in block.splitlines()[1:]]
    assert f"python3 -m venv {venv}" in lines and f"{venv}/bin/pip install ." in lines
    assert "install -d -m 0755 /etc/dynaresized" in lines  # a fresh host has no /etc/dynaresized
    assert "ConfigurationDirectoryMode=0755" in UNIT.read_text()  # a dynamic user reads it as "other"
    # as root, as a fresh container or host is: a line starting with sudo fails where sudo is missing
    assert not any(x.startswith("sudo") for x in lines), lines


def test_the_units_documentation_is_a_file_the_readme_installs() -> None:
    """Documentation= named /usr/share/doc/dynaresized/README.md, which nothing installed."""
    docs = [x.removeprefix("Documentation=") for x in UNIT.read_text().splitlines() if x.startswith("Documentation=")]
    assert docs, "the unit names its documentation"
    steps = _service_section()
    for uri in docs:
        assert uri.startswith("file://"), uri
        path = uri.removeprefix("file://")
        assert f"install -D -m 0644 README.md {path}" in steps, path


def test_reload_sends_sighup_which_the_daemon_handles() -> None:
    """SIGTERM exits 0, which Restart=on-failure does not restart: reload must never send it.
    tests/daemon/test_service.py checks what the daemon does on SIGHUP."""
    text = UNIT.read_text()
    assert "ExecReload=/bin/kill -HUP $MAINPID" in text
    assert "-TERM" not in text.split("ExecReload=", 1)[1].splitlines()[0]


def test_unit_exposure_stays_at_most_1_8(tmp_path: Path) -> None:
    analyze = _systemd_analyze()
    result = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(UNIT)], capture_output=True,
                            text=True)
    exposure = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout + result.stderr)
    assert exposure, result.stdout + result.stderr
    assert float(exposure.group(1)) <= 1.8, result.stdout


def test_unit_declares_what_the_daemon_relies_on() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StateDirectory=dynaresized",
                 "ConfigurationDirectory=dynaresized", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "RestartPreventExitStatus=6"):
        assert line in text
    # libzmq resolves every bind address through getifaddrs (netlink) and aborts without it;
    # systemd/check-in-container.sh is where that showed.
    families = next(x for x in text.splitlines() if x.startswith("RestrictAddressFamilies="))
    assert "AF_NETLINK" in families.split("=", 1)[1].split()


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
        daemon.proc.send_signal(signal.SIGHUP)  # what `systemctl reload` sends
        while not any("RELOADING=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
        reloading = next(i for i, m in enumerate(seen) if "RELOADING=1" in m)
        while not any("READY=1" in m for m in seen[reloading:]):
            seen.append(sock.recv(4096).decode())
        assert any("STATUS=reloaded; policy static" in m for m in seen[reloading:])
        daemon.stop()
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
    finally:
        sock.close()
