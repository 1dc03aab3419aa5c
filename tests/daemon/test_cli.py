"""The operator's CLI against a real daemon: readable output, JSON for tools, systemd exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from dynaresized.cli import main

from .conftest import write_config


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynaresized.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_status_pause_resume_resize_and_events(make_daemon) -> None:
    daemon = make_daemon()
    ctl = ["--config", str(daemon.config_path)]  # the endpoint, and the state_dir holding the control secret
    out = cli("status", *ctl)
    assert out.returncode == 0, out.stderr
    assert "phase       steady" in out.stdout and "train 2 : rollout 2" in out.stdout
    assert "last step   none" in out.stdout  # no step reported yet: not "-1"
    assert "node0:cpu3" in out.stdout
    data = json.loads(cli("status", "--json", *ctl).stdout)
    assert data["split"] == {"train": 2, "rollout": 2}

    assert cli("pause", *ctl, "--reason", "maintenance").returncode == 0
    assert json.loads(cli("status", "--json", *ctl).stdout)["paused"] is True
    assert cli("resume", *ctl).returncode == 0
    assert json.loads(cli("status", "--json", *ctl).stdout)["paused"] is False

    refused = cli("resize", "4:0", *ctl)  # min_rollout is 1: refused, with the guard's words
    assert refused.returncode == 1 and "min_pool" in refused.stdout and "min_rollout=1" in refused.stdout
    bad = cli("resize", "four:zero", *ctl)
    assert bad.returncode == 2 and "not a 'train:rollout' split" in bad.stderr

    events = cli("events", "--state-dir", str(daemon.state_dir))  # piped: JSON lines
    lines = [json.loads(line) for line in events.stdout.splitlines()]
    types = [e["type"] for e in lines]
    assert types[0] == "cluster_configured"
    assert "resizing_paused" in types and "resizing_resumed" in types and "proposal_rejected" in types
    assert all(e["position"] == i + 1 for i, e in enumerate(lines))
    only = cli("events", "--state-dir", str(daemon.state_dir), "--type", "proposal_rejected")
    assert [json.loads(x)["guard"] for x in only.stdout.splitlines()] == ["min_pool"]
    since = cli("events", "--state-dir", str(daemon.state_dir), "--since", "2")
    assert json.loads(since.stdout.splitlines()[0])["position"] == 3


def test_events_as_text_on_a_terminal(make_daemon, capsys, monkeypatch) -> None:
    daemon = make_daemon()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["events", "--state-dir", str(daemon.state_dir)]) == 0
    text = capsys.readouterr().out
    assert "cluster_configured" in text and "cluster configured: 4 devices" in text


def test_exit_codes_follow_systemd_conventions(tmp_path: Path) -> None:
    down = cli("status", "--control", "tcp://127.0.0.1:9", "--timeout", "0.3")
    assert down.returncode == 3 and "nothing listens" in down.stderr
    with socket.socket() as mute:  # listens, never speaks ZeroMQ: the wait runs out
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        silent = cli("status", "--control", f"tcp://127.0.0.1:{mute.getsockname()[1]}", "--timeout", "0.3")
    assert silent.returncode == 3 and "no answer from the daemon" in silent.stderr
    missing = cli("serve", "--config", str(tmp_path / "missing.toml"))
    assert missing.returncode == 6 and "no such file" in missing.stderr
    assert cli("events", "--state-dir", str(tmp_path)).returncode == 6
    good = write_config(tmp_path / "ok.toml", {"cluster": {"devices": ["a:gpu0", "a:gpu1"]}})
    assert cli("check-config", "--config", str(good)).returncode == 0
    assert cli("--help").returncode == 0 and "demo" in cli("--help").stdout


def test_keygen_writes_a_usable_key_pair(tmp_path: Path) -> None:
    out = cli("keygen", "trainer-0", "--dir", str(tmp_path))
    assert out.returncode == 0
    secret = tmp_path / "trainer-0.key_secret"
    assert (tmp_path / "trainer-0.key").exists() and secret.stat().st_mode & 0o777 == 0o600


def test_a_second_daemon_on_the_same_log_refuses_to_start(make_daemon) -> None:
    first = make_daemon()
    second = make_daemon(start=False)
    second.sections["daemon"]["state_dir"] = first.sections["daemon"]["state_dir"]
    write_config(second.config_path, second.sections)
    second.start(wait=False)
    assert second.proc.wait(timeout=30) == 6
    assert "events.sqlite" in second.output()
    assert first.status()["phase"] == "steady"


def test_events_follow_prints_facts_as_they_are_recorded(make_daemon) -> None:
    import time

    daemon = make_daemon()
    follow = subprocess.Popen([sys.executable, "-m", "dynaresized.cli", "events", "--follow", "--state-dir",
                               str(daemon.state_dir), "--type", "resizing_paused"],
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # it has printed the (empty) past and is waiting for more
        assert cli("pause", "--config", str(daemon.config_path), "--reason", "tailing").returncode == 0
        line = follow.stdout.readline()  # blocks until the follower sees the new fact
        event = json.loads(line)
        assert event["type"] == "resizing_paused" and event["reason"] == "tailing"
    finally:
        follow.terminate()
        follow.wait(timeout=10)


def test_status_fails_at_once_when_nothing_listens(tmp_path: Path) -> None:
    """Even with an hour's --timeout: a refused connection is an answer, no need to wait it out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    down = cli("status", "--control", f"tcp://127.0.0.1:{port}", "--timeout", "3600", timeout=60)
    assert down.returncode == 3
    assert down.stderr == (f"dynaresized: nothing listens on the daemon's control endpoint tcp://127.0.0.1:{port} "
                           "(is it running? `systemctl status dynaresized`)\n  the endpoint is from --control; "
                           "point the CLI at another daemon with --config FILE or DYNARESIZED_CONFIG=FILE "
                           "(or --control ENDPOINT)\n")
    ipc = cli("status", "--control", f"ipc://{tmp_path / 'control.sock'}", "--timeout", "3600", timeout=60)
    assert ipc.returncode == 3 and "nothing listens" in ipc.stderr


def test_the_config_is_found_through_DYNARESIZED_CONFIG_and_errors_say_where_the_cli_looked(
        make_daemon, tmp_path: Path) -> None:
    """Off systemd (issue 45): no --config on every command, and a miss says what was read."""
    daemon = make_daemon()
    env = {**os.environ, "DYNARESIZED_CONFIG": str(daemon.config_path)}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dynaresized.cli", *args], capture_output=True, text=True,
                              timeout=60, env={**env, **extra})

    status = run("status")
    assert status.returncode == 0 and "phase       steady" in status.stdout, status.stderr
    assert run("pause").returncode == 0 and run("resume").returncode == 0  # the secret from its state_dir
    assert run("check-config").returncode == 0  # serve's own checks read it too
    assert json.loads(run("events").stdout.splitlines()[0])["type"] == "cluster_configured"
    # --config wins over the variable
    other = write_config(tmp_path / "other.toml", {"daemon": {"state_dir": str(tmp_path / "none")},
                                                   "cluster": {"devices": ["a:gpu0", "a:gpu1"]}})
    down = run("status", "--config", str(other), "--timeout", "0.5")
    assert down.returncode == 3
    assert f"nothing listens on the daemon's control endpoint ipc://{tmp_path / 'none' / 'control.sock'}" in down.stderr
    assert f"the endpoint is from --config {other}; point the CLI at another daemon with --config FILE or " \
           "DYNARESIZED_CONFIG=FILE" in down.stderr
    missing = run("status", DYNARESIZED_CONFIG=str(tmp_path / "gone.toml"))
    assert missing.returncode == 6 and missing.stderr == \
        f"dynaresized: {tmp_path / 'gone.toml'}: no such file (named by DYNARESIZED_CONFIG)\n"
    no_log = run("events", DYNARESIZED_CONFIG=str(other))
    assert no_log.returncode == 6 and f"the state_dir is from DYNARESIZED_CONFIG={other}" in no_log.stderr


def test_a_directory_as_config_is_one_line_of_error(tmp_path: Path) -> None:
    for command in ("check-config", "serve", "status"):
        out = cli(command, "--config", str(tmp_path))
        assert out.returncode == 6, (command, out.stderr)
        assert out.stderr == f"dynaresized: {tmp_path}: is a directory; name the TOML file in it, e.g. " \
                             f"{tmp_path / 'config.toml'}\n", command


def test_check_config_warns_when_the_metrics_listener_binds_wider_than_loopback(tmp_path: Path) -> None:
    sections = {"cluster": {"devices": ["a:gpu0", "a:gpu1"]}}
    quiet = cli("check-config", "--config", str(write_config(tmp_path / "quiet.toml", sections)))
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
    wide = write_config(tmp_path / "wide.toml", {**sections, "daemon": {"metrics_host": "0.0.0.0"}})
    out = cli("check-config", "--config", str(wide))
    assert out.returncode == 0, out.stderr  # allowed, but said
    assert "warning" in out.stderr and "daemon.metrics_host" in out.stderr and "no authentication" in out.stderr
    off = write_config(tmp_path / "off.toml", {**sections, "daemon": {"metrics_host": "0.0.0.0", "metrics_port": 0}})
    assert "warning" not in cli("check-config", "--config", str(off)).stderr


def test_a_reader_that_stops_early_gets_no_traceback(make_daemon) -> None:
    """`dynaresized status | head -3`: the pipe closes before the CLI writes; it exits 0 quietly."""
    import os

    daemon = make_daemon()
    for args in (["status", "--config", str(daemon.config_path)], ["events", "--state-dir", str(daemon.state_dir)]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first write
        try:
            done = subprocess.run([sys.executable, "-m", "dynaresized.cli", *args], stdout=write,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(write)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)


def test_events_of_an_unknown_type_is_a_usage_error_naming_the_types(tmp_path: Path) -> None:
    out = cli("events", "--state-dir", str(tmp_path), "--type", "resize_started", "--type", "bogus")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("dynaresized: unknown event type(s) 'bogus'; the log records: cluster_configured, ")
    assert "resize_started" in out.stderr and "loan_returned" in out.stderr


def test_status_counts_each_pools_unknown_steps() -> None:
    from dynaresized.cli import render_status

    pools = {"rollout": {"ratio": 0.1, "last_step_ratio": 0.2, "steps": 5, "unknown_steps": 0},
             "training": {"ratio": 0.3, "last_step_ratio": 0.4, "steps": 2, "unknown_steps": 3}}
    data = {"phase": "steady", "paused": False, "stopping": False, "split": {"train": 1, "rollout": 1},
            "policy": "hysteresis", "last_step": 4, "resizes": {"committed": 0, "rolled_back": 0, "started": 0},
            "degraded_reason": "", "in_flight": None, "workers": [], "devices": {"a:gpu0": "training"},
            "idle": {"pools": pools, "devices": {}}}
    text = render_status(data)
    assert "idle        rollout 10.0% (last step 20.0%), training 30.0% (last step 40.0%); " \
           "rollout 5 step(s) accounted, 0 unknown; training 2 step(s) accounted, 3 unknown" in text


def test_status_text_accounts_every_resize_started() -> None:
    from dynaresized.cli import render_status

    data = {"phase": "steady", "paused": False, "stopping": False, "split": {"train": 1, "rollout": 1},
            "policy": "hysteresis", "last_step": 4,
            "resizes": {"started": 5, "committed": 2, "rolled_back": 1, "degraded": 1, "in_flight": 1},
            "degraded_reason": "", "in_flight": None, "workers": [], "devices": {"a:gpu0": "training"},
            "idle": {"pools": {}, "devices": {}}}
    assert "resizes     5 started: 2 committed, 1 rolled back, 1 degraded, 1 in flight" in render_status(data)


def test_conformance_is_a_subcommand_that_hands_every_argument_to_the_checker(capsys) -> None:
    try:
        main(["conformance", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dynaresized conformance ENDPOINT") and "-- COMMAND" in out


def test_events_and_the_store_commands_say_where_a_compacted_log_starts(tmp_path: Path, capsys) -> None:
    from dynaresized.store import FactLog, SQLiteRecorder
    from tests.store.test_factlog import Cluster

    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as recorder:
        cluster = Cluster(FactLog(recorder, snapshot_every=20))
        cluster.start()
        cluster.run_steps(4, rollout_s=255, train_s=100)
        last = recorder.last_position()
    busy = SQLiteRecorder(path)  # the daemon: the log is open for writing
    refused = cli("store", "compact", str(path), "--retention-s", "0", "--retention-bytes", "1")
    busy.close()
    assert refused.returncode == 1 and "already open for writing" in refused.stderr
    # With the daemon stopped: drop every fact a snapshot covers.
    done = cli("store", "compact", str(path), "--retention-s", "0", "--retention-bytes", "1")
    assert done.returncode == 0, done.stderr
    start = json.loads(done.stdout)["compaction"]["start"]
    assert 0 < start["position"] < last
    check = cli("store", "check", str(path))
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["start"] == start
    assert json.loads(check.stdout)["events"] == last - start["position"]

    assert main(["events", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.splitlines()[0])["position"] == start["position"] + 1
    assert len(out.out.splitlines()) == last - start["position"]
    first = start["position"] + 1
    assert out.err.startswith(f"dynaresized: facts before position {first} (versions 1..{start['version']} "
                              "of stream 'cluster') were compacted at ")
    assert out.err.rstrip().endswith(f"the history here starts at position {first}")
    assert main(["events", "--state-dir", str(tmp_path), "--since", str(first)]) == 0  # after the start: no word
    assert capsys.readouterr().err == ""


def test_the_toy_cluster_says_what_it_needs(tmp_path: Path) -> None:
    """Without a config it names both ways to give one; with no daemon running, how to start it;
    with a config for other devices, the command that writes one for its own (the whole recipe
    runs in tests/test_docs.py)."""
    env = {k: v for k, v in os.environ.items() if k != "DYNARESIZED_CONFIG"}
    none = subprocess.run([sys.executable, "-m", "dynaresized.cli", "toy-cluster"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    if not Path("/etc/dynaresized/config.toml").exists():
        assert none.returncode == 6 and "--config FILE or DYNARESIZED_CONFIG=FILE" in none.stderr
    wrote = cli("toy-cluster", "--write-config", str(tmp_path / "toy"))
    assert wrote.returncode == 0 and f"export DYNARESIZED_CONFIG={tmp_path / 'toy' / 'config.toml'}" in wrote.stdout
    down = cli("toy-cluster", "--config", str(tmp_path / "toy" / "config.toml"), "--timeout", "0.5")
    assert down.returncode == 3 and "start it first: `dynaresized serve &`" in down.stderr
    other = write_config(tmp_path / "other.toml", {"cluster": {"devices": ["a:gpu0", "a:gpu1"]}})
    mine = cli("toy-cluster", "--config", str(other))
    assert mine.returncode == 6 and "`dynaresized toy-cluster --write-config DIR` writes a config" in mine.stderr
