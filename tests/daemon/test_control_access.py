"""Who may drive the daemon (#16, point 2): only its own user and root change anything; status
and the event log are for them and, when configured, one group. The other user is a real
process under uid/gid 65534 (nobody), forked from this one: root's interpreter may live where
nobody cannot read it, so the child runs the CLI's `main` already loaded instead of exec'ing."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq  # noqa: F401  (control_request imports it lazily)

import dynaresized.daemon.config  # noqa: F401  (loaded before the child drops to nobody)
import dynaresized.daemon.service  # noqa: F401
from dynaresized import wire
from dynaresized.cli import build_parser, main

from .conftest import read_facts, write_config
from .test_bad_input import metric
from .test_cli import cli

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root (CI runs as root)")


def as_nobody(*argv: str, out: Path) -> tuple[int, str]:
    """Run `dynaresized ARGV` in a child process as uid/gid 65534; its exit code and output."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            sys.stdout = sys.stderr = os.fdopen(fd, "w")
            build_parser()  # loads what the CLI imports lazily, while root can still read it
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = main([*argv])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory nobody can reach (its parents are world-searchable, unlike pytest's tmp_path)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="dynaresized-") as path:
        os.chmod(path, 0o755)
        yield Path(path)


MUTATING = [("pause", "--reason", "not mine"), ("resume",), ("drain",), ("resize", "3:1")]


def test_another_user_cannot_pause_resume_drain_or_resize_on_tcp_loopback(make_daemon, tmp_path) -> None:
    daemon = make_daemon()
    for argv in MUTATING:
        code, text = as_nobody(*argv, "--control", daemon.control_endpoint, "--timeout", "5", out=tmp_path / "out")
        assert code == 1 and "needs the control secret" in text, (argv, code, text)
    code, text = as_nobody("status", "--json", "--control", daemon.control_endpoint, out=tmp_path / "out")
    assert code == 0 and '"paused": false' in text  # status is readable on tcp loopback (docs/security.md)
    status = daemon.status()
    assert status["paused"] is False and status["stopping"] is False and status["resizes"]["started"] == 0
    assert metric(daemon, "dynaresized_security_refusals_total", 'kind="control_secret"') == len(MUTATING)
    assert "refused a control request without the control secret" in daemon.output()
    types = {type(x).__name__ for x in read_facts(daemon.state_dir)}
    assert not types & {"ResizingPaused", "ShutdownRequested", "ResizeStarted"}, types
    # The daemon's own user (root here) presents the secret and is obeyed.
    assert daemon.control(wire.PauseRequest(reason="mine")).ok and daemon.status()["paused"] is True


def test_the_ipc_control_socket_admits_only_the_daemons_user(make_daemon, tmp_path, open_dir) -> None:
    old = os.umask(0)  # the daemon inherits the widest umask: the socket must be private all the same
    try:
        daemon = make_daemon(daemon={"control_endpoint": f"ipc://{open_dir}/control.sock"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((open_dir / "control.sock").stat().st_mode) == 0o600
    for argv in [("status",), *MUTATING]:
        code, text = as_nobody(*argv, "--control", daemon.control_endpoint, "--timeout", "1", out=tmp_path / "out")
        assert code == 3 and "no answer" in text, (argv, code, text)  # connect(2) is refused: EACCES
    assert cli("pause", "--config", str(daemon.config_path)).returncode == 0
    assert daemon.status()["paused"] is True


def test_a_control_group_reads_status_and_events_but_changes_nothing(make_daemon, tmp_path, open_dir) -> None:
    daemon = make_daemon(start=False, security={"control_group": "nogroup"})
    daemon.sections["daemon"]["state_dir"] = str(open_dir / "state")
    del daemon.sections["daemon"]["control_endpoint"]  # the default: ipc://<state_dir>/control.sock
    write_config(daemon.config_path, daemon.sections)
    daemon.start()
    sock = open_dir / "state" / "control.sock"
    assert daemon.control_endpoint == f"ipc://{sock}"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660 and sock.stat().st_gid == NOBODY
    assert (open_dir / "state").stat().st_gid == NOBODY

    code, text = as_nobody("status", "--control", daemon.control_endpoint, out=tmp_path / "out")
    assert code == 0 and "phase       steady" in text, text
    code, text = as_nobody("events", "--state-dir", str(open_dir / "state"), out=tmp_path / "out")
    assert code == 0 and "cluster_configured" in text, text
    for argv in MUTATING:
        code, text = as_nobody(*argv, "--control", daemon.control_endpoint, "--timeout", "5", out=tmp_path / "out")
        assert code == 1 and "needs the control secret" in text, (argv, code, text)
    assert daemon.status()["paused"] is False and daemon.status()["stopping"] is False
