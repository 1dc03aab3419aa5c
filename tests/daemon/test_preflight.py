"""`check-config` refuses what `serve` refuses, in the same words, and a refused start writes
nothing: after fixing the configuration, the next start is a first start."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import DEVICES, daemon_sections, read_facts, write_config


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynaresized.cli", *args], capture_output=True, text=True,
                          timeout=60)


def refused_by_both(config: Path) -> str:
    """Run check-config and serve on `config`; both must refuse with exit 6 and the same reason.
    Only the lead differs: serve "cannot start", check-config says serve would refuse to."""
    checked = cli("check-config", "--config", str(config))
    served = cli("serve", "--config", str(config))
    assert served.returncode == 6, served.stdout + served.stderr
    assert checked.returncode == 6, checked.stdout
    assert served.stderr.startswith("dynaresized: cannot start: ")
    assert checked.stderr.startswith(f"dynaresized: {config}: serve would refuse to start: ")
    assert checked.stderr.split("refuse to start: ", 1)[1] == served.stderr.split("cannot start: ", 1)[1]
    assert "Traceback" not in served.stderr
    return served.stderr


TRAPS: dict[str, tuple[dict[str, dict[str, Any]], str]] = {
    "unknown policy": ({"policy": {"name": "hysterisis"}},
                       "cannot start: policy.name: unknown policy 'hysterisis'; installed policies: "),
    "misspelt policy": ({"policy": {"name": "hysterisis"}}, "; did you mean 'hysteresis'?"),
    "unknown policy option": ({"policy": {"name": "hysteresis", "options": {"bogus": 1}}},
                              "cannot start: policy.options: bad options for policy 'hysteresis'"),
    "tail regroups, simulated only": ({"policy": {"name": "hysteresis", "options": {"tail_regroup": True}}},
                                      "cannot start: policy.options: tail_regroup is simulated only"),
    "exposed endpoint without CURVE": ({"daemon": {"worker_endpoint": "tcp://0.0.0.0:5555"}},
                                       "cannot start: refusing to bind tcp://0.0.0.0:5555 without CurveZMQ"),
    # zmq.auth calls a missing file "Invalid certificate file"
    "missing key file": ({"daemon": {"worker_endpoint": "tcp://0.0.0.0:5555"},
                          "security": {"server_secret_key": "/nonexistent/daemon.key_secret",
                                       "authorized_keys_dir": "/nonexistent"}},
                         "cannot start: server_secret_key /nonexistent/daemon.key_secret does not exist: name the "
                         "daemon's .key_secret file (`dynaresized keygen daemon --dir DIR` writes "
                         "DIR/daemon.key_secret)\n"),
}


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_check_config_refuses_what_serve_refuses_and_nothing_is_written(tmp_path: Path, trap: str) -> None:
    overrides, expected = TRAPS[trap]
    sections = daemon_sections(tmp_path, **overrides)
    config = write_config(tmp_path / "config.toml", sections)
    assert expected in refused_by_both(config)
    state = Path(sections["daemon"]["state_dir"])
    assert not (state / "events.sqlite").exists(), "a refused start left a log behind"


def test_every_root_cause_is_reported_once(tmp_path: Path) -> None:
    sections = daemon_sections(tmp_path, policy={"name": "hysterisis"},
                               daemon={"worker_endpoint": "tcp://0.0.0.0:5555"})
    stderr = refused_by_both(write_config(tmp_path / "config.toml", sections))
    assert stderr.startswith("dynaresized: cannot start: 2 problems:\n")
    assert stderr.count("unknown policy") == 1 and stderr.count("refusing to bind") == 1


def test_an_unwritable_state_dir_is_refused_by_both(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    sections = daemon_sections(tmp_path, daemon={"state_dir": str(blocker / "state")})
    stderr = refused_by_both(write_config(tmp_path / "c.toml", sections))
    assert f"cannot create state_dir {blocker / 'state'}: {blocker} is not a directory" in stderr


@pytest.mark.parametrize("kernel_dir", ["/proc/dynaresized", "/sys/fs/dynaresized/state"])
def test_a_state_dir_on_a_kernel_filesystem_is_refused_by_both(tmp_path: Path, kernel_dir: str) -> None:
    """access(2) tells root it may write under /proc and /sys; mkdir then fails. check-config
    accepted these and serve refused them: both refuse now, before anything is created."""
    sections = daemon_sections(tmp_path, daemon={"state_dir": kernel_dir})
    stderr = refused_by_both(write_config(tmp_path / "c.toml", sections))
    fs = "proc" if kernel_dir.startswith("/proc") else "sysfs"
    assert f"state_dir {kernel_dir} is on /{kernel_dir.split('/')[1]}, a {fs} filesystem the kernel provides" in stderr
    assert not Path(kernel_dir).exists()


def test_the_filesystem_of_a_path_is_the_longest_mount_holding_it(tmp_path: Path) -> None:
    from dynaresized.daemon.preflight import filesystem_of

    mounts = tmp_path / "mounts"
    mounts.write_text("rootfs / ext4 rw 0 0\nsysfs /sys sysfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n"
                      "tmpfs /srv/my\\040disk tmpfs rw 0 0\n")
    assert filesystem_of(Path("/sys/fs"), str(mounts)) == ("/sys", "sysfs")
    assert filesystem_of(Path("/sys/fs/cgroup/cpu"), str(mounts)) == ("/sys/fs/cgroup/cpu", "cgroup")
    assert filesystem_of(Path("/system"), str(mounts)) == ("/", "ext4")
    assert filesystem_of(Path("/srv/my disk"), str(mounts)) == ("/srv/my disk", "tmpfs")
    assert filesystem_of(Path("/"), str(tmp_path / "none")) is None


def test_a_changed_inventory_is_refused_by_both_and_the_log_is_kept(make_daemon, tmp_path: Path) -> None:
    first = make_daemon()
    first.stop()
    before = read_facts(first.state_dir)
    sections = daemon_sections(tmp_path, daemon={"state_dir": str(first.state_dir)},
                               cluster={"devices": DEVICES[:3], "training": DEVICES[:2]})
    stderr = refused_by_both(write_config(tmp_path / "fewer.toml", sections))
    assert "cluster.devices in the configuration (3 devices) differ from the inventory in " \
           f"{first.state_dir / 'events.sqlite'} (4 devices): only in the log: {DEVICES[3]}; restore" in stderr
    assert read_facts(first.state_dir) == before


def test_a_start_refused_at_bind_writes_nothing_and_the_fixed_config_starts(make_daemon, tmp_path: Path) -> None:
    """The issue's trap: a refused start had recorded cluster_configured, so after fixing the
    device list the next start failed on an inventory nobody had ever run."""
    daemon = make_daemon(start=False)
    with socket.socket() as taken:
        port = int(daemon.worker_endpoint.rsplit(":", 1)[1])
        taken.bind(("127.0.0.1", port))
        taken.listen()
        daemon.start(wait=False)
        assert daemon.proc.wait(timeout=30) == 6
    assert "cannot bind" in daemon.output()
    assert not (daemon.state_dir / "events.sqlite").exists()
    daemon.sections["cluster"] = {"devices": DEVICES[:3], "training": DEVICES[:1]}
    write_config(daemon.config_path, daemon.sections)
    assert cli("check-config", "--config", str(daemon.config_path)).returncode == 0
    daemon.start()
    assert daemon.status()["split"] == {"train": 1, "rollout": 2}


def test_check_config_accepts_a_running_daemons_config(make_daemon) -> None:
    daemon = make_daemon()  # its log exists, is locked by the daemon, and matches
    out = cli("check-config", "--config", str(daemon.config_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{daemon.config_path}: ok\n"


def _with_open_files(soft: int, hard: int) -> Any:
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return limit


def _cluster(n: int) -> dict[str, Any]:
    devices = [f"node{i // 8}:gpu{i % 8}" for i in range(n)]
    return {"devices": devices, "training": devices[: n // 2]}


def test_an_open_file_limit_below_a_connection_per_worker_is_refused_by_both(tmp_path: Path) -> None:
    """4,096 devices are 8,192 worker connections: a hard limit of 2,048 cannot hold them."""
    config = write_config(tmp_path / "big.toml", daemon_sections(tmp_path, cluster=_cluster(4096)))
    runs = [subprocess.run([sys.executable, "-m", "dynaresized.cli", command, "--config", str(config)],
                           capture_output=True, text=True, timeout=60, preexec_fn=_with_open_files(1024, 2048))
            for command in ("check-config", "serve")]
    for run in runs:
        assert run.returncode == 6, run.stderr
        assert ("the open-file limit is 2048 (RLIMIT_NOFILE, hard), and 4096 devices need at least 8448: a "
                "connection per worker") in run.stderr
        assert "LimitNOFILE=16640" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "state" / "events.sqlite").exists()


def test_serve_raises_its_soft_open_file_limit_to_what_its_workers_need(tmp_path: Path) -> None:
    """systemd starts a service at a soft limit of 1,024 open files, which 512 devices' workers
    already exceed: the daemon raises it (up to the hard limit) before it binds."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # raising it needs CAP_SYS_RESOURCE: keep it
    assert hard >= 2304, f"this machine's hard open-file limit ({hard}) is below 1,024 devices' workers"
    sections = daemon_sections(tmp_path, cluster=_cluster(1024))
    config = write_config(tmp_path / "wide.toml", sections)
    proc = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_with_open_files(1024, hard))
    try:
        limits = ""
        for _ in range(600):  # until it serves (its control socket answers `status`)
            if cli("status", "--config", str(config)).returncode == 0:
                limits = Path(f"/proc/{proc.pid}/limits").read_text()
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        # 2 x 2,048 workers + 256 spare (at most the hard limit, which stays)
        assert line.split()[3:5] == [str(min(hard, 4352)), str(hard)], line
    finally:
        proc.terminate()
        proc.wait(timeout=60)
