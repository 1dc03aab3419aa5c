"""Every configuration key is documented with its real default, and bad values are refused."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from dynaresized.daemon.config import Config, ConfigError, config_from_dict, load_config

DOC = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()


def _sections() -> dict[str, dict[str, str]]:
    doc: dict[str, dict[str, str]] = {}
    section = ""
    for line in DOC.splitlines():
        if m := re.match(r"## `\[(\w+)\]`", line):
            section = m.group(1)
            doc[section] = {}
        elif section and (m := re.match(r"\| `(\w+)` \| (.+?) \|", line)):
            doc[section][m.group(1)] = m.group(2)
    return doc


def test_every_key_is_documented_with_its_default() -> None:
    documented = _sections()
    defaults = msgspec.to_builtins(Config())
    for section, values in defaults.items():
        assert section in documented, f"[{section}] missing from docs/configuration.md"
        assert set(values) == set(documented[section]), f"[{section}] keys differ from the docs"
        for key, value in values.items():
            doc_default = documented[section][key]
            if value in (None, [], {}):
                continue
            assert doc_default.strip("`").startswith(msgspec.json.encode(value).decode()), (section, key)


def test_example_config_is_valid() -> None:
    cfg = load_config(Path(__file__).parents[2] / "systemd" / "config.example.toml")
    assert cfg.initial_pools()[1].count(cfg.initial_pools()[1][0]) == 6


@pytest.mark.parametrize("raw,expected", [
    ({"cluster": {"devices": []}}, "cluster.devices"),
    ({"cluster": {"devices": ["a", "a"]}}, "distinct"),
    ({"cluster": {"devices": ["a", "b"], "training": ["c"]}}, "cluster.training: c not in cluster.devices"),
    ({"cluster": {"devices": ["a", "b"], "candidates": ["1:2"]}}, "must add up to the 2 devices"),
    ({"cluster": {"devices": ["a", "b"], "candidates": ["one:one"]}}, "not a 'train:rollout' split"),
    ({"cluster": {"devices": ["a", "b"]}, "core": {"heartbeat_timeout_s": 0.5}}, "must exceed"),
    ({"cluster": {"devices": ["a", "b"]}, "daemon": {"worker_endpoint": "http://x"}}, "not a ZeroMQ endpoint"),
    ({"cluster": {"devices": ["a", "b"]}, "security": {"server_secret_key": "k"}}, "set both"),
    ({"cluster": {"devices": ["a", "b"]}, "daemon": {"control_endpoint": "tcp://10.0.0.1:5556"}}, "must be loopback"),
    ({"cluster": {"devices": ["a", "b"]}, "guards": {"payback_backoff": 0.5}}, "guards.payback_backoff: must be >= 1"),
    ({"cluster": {"devices": ["a", "b"]}, "guards": {"verify_steps": 0}}, "guards.verify_steps: must be >= 1"),
    ({"cluster": {"devices": ["a", "b"]}, "daemon": {"batch_window_ms": -1}}, "daemon.batch_window_ms: must be in"),
    ({"cluster": {"devices": ["a", "b"]}, "daemon": {"batch_window_ms": float("nan")}}, "daemon.batch_window_ms"),
    ({"cluster": {"devices": ["a", "b"]}, "store": {"retention_s": -1}}, "store.retention_s: must be a number"),
    ({"cluster": {"devices": ["a", "b"]}, "store": {"retention_s": float("inf")}}, "store.retention_s"),
    ({"cluster": {"devices": ["a", "b"]}, "store": {"retention_bytes": 1 << 20}},
     "store.retention_bytes: must be 0 (no size bound) or at least 67108864"),
    ({"cluster": {"devices": ["a", "b"]}, "store": {"retention": 1}}, "Object contains unknown field `retention`"),
    # a misspelt key or section gets the nearest real one (issue 45)
    ({"daemon": {"stat_dir": "/tmp/x"}}, "unknown field `stat_dir` - at `daemon`; did you mean 'state_dir'?"),
    ({"guards": {"signalrun": 3}}, "unknown field `signalrun` - at `guards`; did you mean 'signal_run'?"),
    ({"polcy": {"name": "static"}}, "unknown field `polcy`; did you mean 'policy'?"),
    ({"pipeline": {"mode": "fully-async", "staleness": -1.0}}, "staleness must be a finite number >= 0"),
    ({"pipeline": {"partial_rollout": True}}, "use --pipeline fully-async"),
])
def test_bad_values_name_the_key(raw: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        config_from_dict(raw, "test.toml")


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon\n")
    with pytest.raises(ConfigError, match=f"{bad}: not valid TOML"):
        load_config(bad)


def test_a_duplicated_device_is_reported_once_without_echoes() -> None:
    """Nine entries for eight devices: the count is wrong, so checks against it would only echo."""
    devices = [f"node0:gpu{i}" for i in range(8)] + ["node0:gpu3"]
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"cluster": {"devices": devices, "candidates": ["6:2", "5:3", "4:4", "3:5", "2:6"]}},
                         "test.toml")
    assert str(raised.value) == "test.toml: invalid configuration\n  cluster.devices: device ids must be distinct"


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: is a directory")):
        load_config(tmp_path)


def test_the_default_control_endpoint_is_an_ipc_socket_in_the_state_directory() -> None:
    from dynaresized.daemon.config import control_endpoint_of

    cfg = config_from_dict({"cluster": {"devices": ["a", "b"]}, "daemon": {"state_dir": "/var/lib/dynaresized"}})
    assert control_endpoint_of(cfg.daemon) == "ipc:///var/lib/dynaresized/control.sock"
    tcp = config_from_dict({"cluster": {"devices": ["a", "b"]}, "daemon": {"control_endpoint": "tcp://127.0.0.1:5556"}})
    assert control_endpoint_of(tcp.daemon) == "tcp://127.0.0.1:5556"
    with pytest.raises(ConfigError, match="security.control_group: no group 'no-such-group"):
        config_from_dict({"cluster": {"devices": ["a", "b"]}, "security": {"control_group": "no-such-group"}})


def test_io_threads_grow_with_the_inventory_and_the_daemon_runs_that_many(tmp_path: Path) -> None:
    """One libzmq I/O thread per 1,024 worker connections (an engine and a trainer a device):
    libzmq cancels a ZMTP heartbeat's timer by scanning its thread's timers."""
    import zmq

    from dynaresized.daemon.service import Daemon, io_threads_for

    def config(n: int, **daemon: object) -> Config:
        devices = [f"n{i // 8}:gpu{i % 8}" for i in range(n)]
        return config_from_dict({"cluster": {"devices": devices, "training": devices[: n // 2]},
                                 "daemon": {"state_dir": str(tmp_path / "state"), "metrics_port": 0,
                                            "worker_endpoint": "tcp://127.0.0.1:0", **daemon}}, "test.toml")

    assert [io_threads_for(config(n)) for n in (8, 512, 513, 1024, 4096, 10_000)] == [1, 1, 2, 2, 8, 8]
    assert io_threads_for(config(4096, io_threads=3)) == 3
    with pytest.raises(ConfigError, match=re.escape("daemon.io_threads: must be in [0, 64]")):
        config(8, io_threads=-1)
    daemon = Daemon(config(1024))
    daemon._bind()
    try:
        assert daemon.ctx is not None and daemon.ctx.get(zmq.IO_THREADS) == 2
    finally:
        daemon._close()


def test_the_store_section_is_the_fact_log_s_retention() -> None:
    from dynaresized.store import Retention

    assert Config().store.retention() == Retention(max_age_s=30 * 86_400, max_bytes=32 << 30)
    cfg = config_from_dict({"cluster": {"devices": ["a", "b"]}, "store": {"retention_s": 0, "retention_bytes": 0}})
    assert not cfg.store.retention().bounded  # both bounds off: the log keeps everything


@pytest.mark.parametrize("timeout_s", [0.01, 3.0, 10.0, 200.0, 200_000.0, 1e12])
def test_the_worker_endpoints_keepalives_stay_within_linuxs_limits(timeout_s: float) -> None:
    """A demo's heartbeat timeout is 200,000 simulated seconds: beyond Linux's TCP_KEEPIDLE and
    TCP_KEEPCNT limits setsockopt fails and libzmq drops every connection it accepts. The kernel
    gives up on a vanished peer within about the timeout, never before 3 s."""
    import socket

    import zmq

    from dynaresized.daemon.endpoints import keepalive_options

    o = keepalive_options(timeout_s)
    assert 1 <= o[zmq.TCP_KEEPALIVE_IDLE] <= 32767 and 1 <= o[zmq.TCP_KEEPALIVE_INTVL] <= 32767
    assert 1 <= o[zmq.TCP_KEEPALIVE_CNT] <= 127 and 0 < o[zmq.TCP_MAXRT] <= 2**31 - 1
    bound = max(3.0, timeout_s)
    probes = o[zmq.TCP_KEEPALIVE_IDLE] + o[zmq.TCP_KEEPALIVE_INTVL] * o[zmq.TCP_KEEPALIVE_CNT]
    if bound < 32767 * 128:
        assert bound <= probes <= bound + o[zmq.TCP_KEEPALIVE_INTVL] + 1
    with socket.socket() as s:  # the kernel takes them
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, o[zmq.TCP_KEEPALIVE_IDLE])
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, o[zmq.TCP_KEEPALIVE_INTVL])
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, o[zmq.TCP_KEEPALIVE_CNT])
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, o[zmq.TCP_MAXRT])


def test_an_unknown_key_far_from_every_real_one_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"daemon": {"zzzzqqq": 1}}, "test.toml")
    assert "unknown field `zzzzqqq`" in str(info.value) and "did you mean" not in str(info.value)


def test_the_documented_built_in_policies_are_the_installed_ones() -> None:
    """docs/configuration.md listed four built-in policies while six were installed (issue 45)."""
    from dynaresized.core.policy import available_policies

    row = next(x for x in DOC.splitlines() if x.startswith("| `name` | `\"hysteresis\"`"))
    listed = re.findall(r"`([a-z0-9-]+)`", row.split("built in are", 1)[1])
    assert sorted(set(listed)) == sorted(available_policies())
