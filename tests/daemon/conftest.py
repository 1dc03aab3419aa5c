"""A real daemon in a real process, on loopback TCP, with its event log in tmp_path."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynaresized import wire
from dynaresized.control import control_request, read_control_secret

DEVICES = ["node0:cpu0", "node0:cpu1", "node0:cpu2", "node0:cpu3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table, e.g. policy.options
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def daemon_sections(tmp_path: Path, **overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {
        "daemon": {
            "state_dir": str(tmp_path / "state"),
            "worker_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "control_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "metrics_port": free_port(),
            "tick_interval_s": 0.05,
            "heartbeat_interval_s": 0.2,
            "drain_timeout_s": 2.0,
            "log_format": "json",
            "log_level": "debug",
        },
        "cluster": {"devices": DEVICES, "training": DEVICES[:2]},
        "policy": {"name": "static"},
        "core": {"heartbeat_timeout_s": 3.0, "op_timeout_s": 10.0},
        "guards": {"signal_run": 1, "min_dwell_s": 0.0, "cooldown_steps": 0, "payback_safety": 0.0,
                   "imbalance_threshold": 0.1},
    }
    for name, values in overrides.items():
        sections.setdefault(name, {}).update(values)
    return sections


@dataclass
class RunningDaemon:
    config_path: Path
    sections: dict[str, dict[str, Any]]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def worker_endpoint(self) -> str:
        return self.sections["daemon"]["worker_endpoint"]

    @property
    def control_endpoint(self) -> str:
        """As the CLI finds it: the configured endpoint, else the default ipc:// socket."""
        from dynaresized.daemon.config import DaemonSection, control_endpoint_of

        return control_endpoint_of(DaemonSection(**self.sections["daemon"]))

    @property
    def state_dir(self) -> Path:
        return Path(self.sections["daemon"]["state_dir"])

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.sections['daemon']['metrics_port']}/metrics"

    def start(self, wait: bool = True) -> RunningDaemon:
        assert self.proc is None or self.proc.poll() is not None
        self.log_path = self.config_path.with_suffix(f".{int(time.time() * 1000)}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(self.config_path)],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.output()}")
            try:
                control_request(self.control_endpoint, wire.StatusRequest(), timeout_s=0.5)
                return
            except TimeoutError:
                continue
        raise AssertionError(f"daemon not ready in {timeout}s:\n{self.output()}")

    def status(self) -> dict[str, Any]:
        return control_request(self.control_endpoint, wire.StatusRequest(), timeout_s=5).data

    def control(self, request: Any) -> wire.ControlReply:
        """Send a request as the daemon's owner does: with the secret from its state directory."""
        return control_request(self.control_endpoint, request, timeout_s=5, secret=read_control_secret(self.state_dir))

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def configured_daemon(directory: Path, name: str = "config", env: dict[str, str] | None = None,
                      **overrides: dict[str, Any]) -> RunningDaemon:
    """A daemon (not started) whose config `directory`/`name`.toml holds `daemon_sections`
    with `overrides`, its state in `directory`/state."""
    sections = daemon_sections(directory, **overrides)
    return RunningDaemon(write_config(directory / f"{name}.toml", sections), sections, env=env or {})


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    started: list[RunningDaemon] = []

    def make(start: bool = True, env: dict[str, str] | None = None, **overrides: dict[str, Any]) -> RunningDaemon:
        daemon = configured_daemon(tmp_path, f"config{len(started)}", env, **overrides)
        started.append(daemon)
        if start:
            daemon.start()
        return daemon

    yield make
    for d in started:
        d.stop()


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_facts(state_dir: Path) -> list[Any]:
    from dynaresized.core.facts import decode_fact
    from dynaresized.store import open_recorder

    recorder = open_recorder(state_dir / "events.sqlite", read_only=True)
    try:
        start = recorder.log_start()
        # The tests read every fact of a short run; a compacted log would hide some (docs/store.md, retention).
        assert start is None, f"the log was compacted: {start.summary()}"
        return [decode_fact(e.data) for e in recorder.read_all()]
    finally:
        recorder.close()
