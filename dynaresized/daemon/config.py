"""Daemon configuration: one TOML file decoded into typed structs.

Unknown keys, wrong types and impossible values are refused at start with a message that
names the file and the key. Every key, with its default, is documented in
docs/configuration.md (checked against `Config` by tests/daemon/test_config.py).
"""

from __future__ import annotations

import grp
import ipaddress
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

from dynaresized.core.guards import GuardConfig
from dynaresized.core.machine import CoreConfig
from dynaresized.core.policy import LoanCosts, ResizeCosts
from dynaresized.domain import PipelineSpec, Pool, Split
from dynaresized.spelling import did_you_mean
from dynaresized.store import DEFAULT_RETENTION_BYTES, DEFAULT_RETENTION_S, MIN_RETENTION_BYTES, Retention


class ConfigError(Exception):
    """A configuration problem; the message names the file and the key."""


class DaemonSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    state_dir: str = "/var/lib/dynaresized"
    worker_endpoint: str = "tcp://127.0.0.1:5555"
    control_endpoint: str = ""  # "" = ipc://<state_dir>/control.sock; see control_endpoint_of
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464  # 0 disables the Prometheus endpoint
    tick_interval_s: float = 0.5
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = 60.0
    snapshot_every: int = 10_000
    max_message_bytes: int = 64 * 1024
    # Messages one connection may have queued before libzmq stops reading it (its ZMQ_RCVHWM):
    # with max_message_bytes, the bound on what one connection holds in the daemon's memory.
    receive_hwm: int = 1000
    # Refused frames (malformed, several payload frames, a wrong identity or key) one connection
    # to the worker endpoint may send per junk_window_s, each answered; the next one cuts it.
    junk_budget: int = 100
    junk_window_s: float = 10.0
    # Reports that write facts (queue_empty, mini_batch_done, step_report, state_report) one
    # worker may send a second (in the daemon's clock), in bursts of report_burst; more are
    # refused `rate_limited`. A job sends a few a step.
    report_rate: float = 20.0
    report_burst: int = 200
    # Worker messages are taken in batches at most this often (0: as each arrives). A busy
    # cluster's messages then wake the reactor and the log writer once per window, not once each.
    # 20 ms takes a third less CPU at 1,024 devices, for at most 20 ms more per answer on a busy
    # cluster; 5 ms stays the default: with 20 ms a loan test on real engines timed out once
    # (docs/benchmarks.md, the cost curve).
    batch_window_ms: float = 5.0
    # libzmq I/O threads for the worker connections (0: one per 1,024 connections the inventory
    # implies, an engine and a trainer per device, at most 8). Each thread keeps its own timers,
    # and libzmq cancels a timer by a scan of its thread's timers, which a ZMTP heartbeat's answer
    # does on every connection: in one thread that cost grows with the square of the connections
    # (0.8 of a core at 8,192; docs/benchmarks.md, "Scale").
    io_threads: int = 0
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    time_scale: float = 1.0  # demos and replays only: the daemon's clock runs this many times faster


class SecuritySection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server_secret_key: str = ""  # path of the daemon's CURVE secret key file (from `dynaresized keygen`)
    authorized_keys_dir: str = ""  # directory of worker public keys; a key's file stem is its worker id
    control_group: str = ""  # a group that may read status and the event log; "" = the daemon's user only


class ClusterSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    devices: list[str] = []
    training: list[str] = []  # devices that start in the training pool; the rest start in rollout
    candidates: list[str] = []  # allowed "train:rollout" splits; empty = any split


class PolicySection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "hysteresis"
    options: dict[str, Any] = {}


class CoreSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    heartbeat_timeout_s: float = 10.0
    op_timeout_s: float = 120.0
    steps_total: int | None = None
    op_resend_s: float = 2.0  # a pending op is re-sent to live targets that have not answered this often
    audit_interval_s: float = 30.0  # every live worker is asked for its actual state this often; 0: never
    reconcile_retry_s: float = 30.0  # a worker that could not be converged is tried again this long after
    learn_loan_costs: bool = False  # measured loans replace [loan_costs]' estimates (core.CoreConfig)


class StoreSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How much history the event log keeps (docs/store.md, "Retention"): after each snapshot,
    facts past either bound that a snapshot covers are dropped. 0 turns a bound off."""

    retention_s: float = DEFAULT_RETENTION_S  # 30 days
    retention_bytes: int = DEFAULT_RETENTION_BYTES  # 32 GiB: a month of a 1,024-device job

    def retention(self) -> Retention:
        return Retention(max_age_s=self.retention_s, max_bytes=self.retention_bytes)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    daemon: DaemonSection = DaemonSection()
    security: SecuritySection = SecuritySection()
    cluster: ClusterSection = ClusterSection()
    policy: PolicySection = PolicySection()
    core: CoreSection = CoreSection()
    store: StoreSection = StoreSection()
    guards: GuardConfig = GuardConfig()
    costs: ResizeCosts = ResizeCosts()
    loan_costs: LoanCosts = LoanCosts()
    pipeline: PipelineSpec = PipelineSpec()

    def core_config(self) -> CoreConfig:
        return CoreConfig(
            guards=self.guards,
            heartbeat_timeout_s=self.core.heartbeat_timeout_s,
            op_timeout_s=self.core.op_timeout_s,
            steps_total=self.core.steps_total,
            costs=self.costs,
            op_resend_s=self.core.op_resend_s,
            audit_interval_s=self.core.audit_interval_s or None,
            reconcile_retry_s=self.core.reconcile_retry_s,
            loan_costs=self.loan_costs,
            learn_loan_costs=self.core.learn_loan_costs,
            pipeline=self.pipeline,
            # ticks come every tick_interval_s; ten missed in a row is the daemon stalling
            stall_s=max(10 * self.daemon.tick_interval_s, 0.5),
        )

    def initial_pools(self) -> tuple[tuple[str, ...], tuple[Pool, ...]]:
        devices = tuple(self.cluster.devices)
        training = set(self.cluster.training)
        return devices, tuple(Pool.TRAINING if d in training else Pool.ROLLOUT for d in devices)

    def candidate_splits(self) -> tuple[Split, ...]:
        return tuple(Split.parse(c) for c in self.cluster.candidates)

    def worker_connections(self) -> int:
        """The worker connections the inventory implies: an engine and a trainer per device
        (what the daemon's I/O threads and open files are sized for)."""
        return 2 * len(self.cluster.devices)


DEFAULT_CONFIG = "/etc/dynaresized/config.toml"
CONFIG_ENV = "DYNARESIZED_CONFIG"


def config_path(named: str | None) -> tuple[str | None, str]:
    """The config file a command reads, and where it came from in words: `--config`, else
    $DYNARESIZED_CONFIG, else the default file if it exists; None when there is none of these
    (a client command then uses the built-in defaults)."""
    if named:
        return named, f"--config {named}"
    if env := os.environ.get(CONFIG_ENV):
        return env, f"{CONFIG_ENV}={env}"
    if Path(DEFAULT_CONFIG).exists():
        return DEFAULT_CONFIG, f"the default {DEFAULT_CONFIG}"
    return None, f"the built-in defaults (no --config, {CONFIG_ENV} unset, no {DEFAULT_CONFIG})"


CONTROL_SOCKET = "control.sock"


def control_endpoint_of(daemon: DaemonSection) -> str:
    """The control endpoint the daemon binds and the CLI connects to: the configured one, or by
    default an ipc:// socket in the state directory, where file modes decide who may connect."""
    return daemon.control_endpoint or f"ipc://{Path(daemon.state_dir).absolute() / CONTROL_SOCKET}"


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses; a host name or interface name is exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on a loopback address."""
    url = urlparse(endpoint)
    if url.scheme in ("ipc", "inproc"):
        return True
    if url.scheme != "tcp" or url.hostname is None:
        return False
    return is_loopback_host(url.hostname)


def _check(cfg: Config) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            problems.append((key, why))

    d, g, c = cfg.daemon, cfg.guards, cfg.core
    for key, value in (("daemon.tick_interval_s", d.tick_interval_s),
                       ("daemon.heartbeat_interval_s", d.heartbeat_interval_s),
                       ("core.heartbeat_timeout_s", c.heartbeat_timeout_s),
                       ("core.op_timeout_s", c.op_timeout_s),
                       ("core.op_resend_s", c.op_resend_s),
                       ("core.reconcile_retry_s", c.reconcile_retry_s)):
        need(math.isfinite(value) and value > 0, key, f"must be a positive number of seconds, got {value}")
    need(c.op_resend_s < c.op_timeout_s, "core.op_resend_s",
         f"must be under core.op_timeout_s ({c.op_timeout_s}): an op is re-sent several times before it times out")
    need(math.isfinite(c.audit_interval_s) and c.audit_interval_s >= 0, "core.audit_interval_s",
         "must be >= 0 seconds (0: never ask)")
    need(math.isfinite(d.drain_timeout_s) and d.drain_timeout_s >= 0, "daemon.drain_timeout_s", "must be >= 0")
    need(c.heartbeat_timeout_s > d.heartbeat_interval_s, "core.heartbeat_timeout_s",
         f"must exceed daemon.heartbeat_interval_s ({d.heartbeat_interval_s})")
    need(math.isfinite(d.time_scale) and d.time_scale > 0, "daemon.time_scale", "must be > 0")
    need(d.snapshot_every > 0, "daemon.snapshot_every", "must be > 0")
    st = cfg.store
    need(math.isfinite(st.retention_s) and st.retention_s >= 0, "store.retention_s",
         f"must be a number of seconds >= 0 (0: no age bound), got {st.retention_s}")
    need(st.retention_bytes == 0 or st.retention_bytes >= MIN_RETENTION_BYTES, "store.retention_bytes",
         f"must be 0 (no size bound) or at least {MIN_RETENTION_BYTES} (64 MiB: the facts since the last snapshot "
         f"are always kept), got {st.retention_bytes}")
    need(math.isfinite(d.batch_window_ms) and 0 <= d.batch_window_ms <= 100, "daemon.batch_window_ms",
         "must be in [0, 100] milliseconds")
    need(0 <= d.io_threads <= 64, "daemon.io_threads", "must be in [0, 64] (0: one per 1,024 worker connections)")
    need(1024 <= d.max_message_bytes <= 64 * 1024 * 1024, "daemon.max_message_bytes", "must be in [1 KiB, 64 MiB]")
    need(10 <= d.receive_hwm <= 1_000_000, "daemon.receive_hwm", "must be in [10, 1000000] messages")
    need(1 <= d.junk_budget <= 1_000_000, "daemon.junk_budget", "must be in [1, 1000000] refused frames")
    need(math.isfinite(d.junk_window_s) and 0 < d.junk_window_s <= 3600, "daemon.junk_window_s",
         "must be in (0, 3600] seconds")
    need(math.isfinite(d.report_rate) and d.report_rate > 0, "daemon.report_rate", "must be > 0 reports a second")
    need(d.report_burst >= 1, "daemon.report_burst", "must be >= 1")
    need(0 <= d.metrics_port <= 65535, "daemon.metrics_port", "must be a TCP port or 0 to disable")
    need(d.log_format in ("auto", "json", "console"), "daemon.log_format", "must be auto, json or console")
    need(d.log_level in ("debug", "info", "warning", "error"), "daemon.log_level",
         "must be debug, info, warning or error")
    for key, ep in (("worker_endpoint", d.worker_endpoint), ("control_endpoint", control_endpoint_of(d))):
        need(urlparse(ep).scheme in ("tcp", "ipc", "inproc"), f"daemon.{key}",
             f"{ep!r} is not a ZeroMQ endpoint (tcp://host:port or ipc:///path)")
    need(is_loopback_endpoint(control_endpoint_of(d)), "daemon.control_endpoint",
         f"{d.control_endpoint!r} must be loopback (tcp://127.0.0.1:PORT) or ipc://: run the CLI on the daemon's host")
    need(g.cooldown_steps >= 0, "guards.cooldown_steps", f"must be >= 0, got {g.cooldown_steps}")
    need(g.min_dwell_s >= 0, "guards.min_dwell_s", f"must be >= 0, got {g.min_dwell_s}")
    need(g.signal_run >= 1, "guards.signal_run", f"must be >= 1, got {g.signal_run}")
    need(0 <= g.imbalance_threshold < 1, "guards.imbalance_threshold", "must be in [0, 1)")
    need(g.payback_horizon_steps >= 1, "guards.payback_horizon_steps", "must be >= 1")
    need(g.payback_safety >= 0, "guards.payback_safety", "must be >= 0")
    need(g.verify_steps >= 1, "guards.verify_steps", f"must be >= 1, got {g.verify_steps}")
    need(math.isfinite(g.payback_backoff) and g.payback_backoff >= 1, "guards.payback_backoff",
         f"must be >= 1 (1: never learn), got {g.payback_backoff}")
    need(math.isfinite(g.payback_backoff_max) and g.payback_backoff_max >= 1, "guards.payback_backoff_max",
         f"must be >= 1, got {g.payback_backoff_max}")
    need(g.min_rollout >= 0 and g.min_train >= 0, "guards.min_rollout", "pool minimums must be >= 0")
    need(c.steps_total is None or c.steps_total > 0, "core.steps_total", "must be > 0 when set")
    need(cfg.costs.to_training_s >= 0 and cfg.costs.to_rollout_s >= 0, "costs", "costs must be >= 0")
    need(all(v >= 0 for v in msgspec.structs.astuple(cfg.loan_costs)), "loan_costs", "loan costs must be >= 0")

    sec = cfg.security
    need(bool(sec.server_secret_key) == bool(sec.authorized_keys_dir), "security",
         "set both server_secret_key and authorized_keys_dir, or neither")
    if sec.control_group:
        try:
            grp.getgrnam(sec.control_group)
        except KeyError:
            problems.append(("security.control_group", f"no group {sec.control_group!r} on this host"))

    devices = cfg.cluster.devices
    need(len(devices) > 0, "cluster.devices", "list the devices this daemon manages, e.g. [\"node0:gpu0\", ...]")
    need(len(set(devices)) == len(devices), "cluster.devices", "device ids must be distinct")
    unknown = sorted(set(cfg.cluster.training) - set(devices))
    need(not unknown, "cluster.training", f"{', '.join(unknown)} not in cluster.devices")
    if len(set(devices)) != len(devices):
        return problems  # the device count is unknown: checks against it would only echo this error
    n = len(devices)
    need(g.min_rollout + g.min_train <= n, "guards.min_rollout",
         f"min_rollout ({g.min_rollout}) + min_train ({g.min_train}) exceeds the {n} devices in cluster.devices")
    for text in cfg.cluster.candidates:
        try:
            split = Split.parse(text)
        except ValueError as exc:
            problems.append(("cluster.candidates", str(exc)))
            continue
        need(split.total == n and split.train >= 0 and split.rollout >= 0, "cluster.candidates",
             f"{text!r} must add up to the {n} devices")
    return problems


def config_warnings(cfg: Config) -> list[tuple[str, str]]:
    """What is allowed but exposed: `check-config` prints these and the daemon logs them."""
    warnings: list[tuple[str, str]] = []
    d = cfg.daemon
    if d.metrics_port and not is_loopback_host(d.metrics_host):
        warnings.append(("daemon.metrics_host",
                         f"{d.metrics_host!r} is not loopback: the Prometheus endpoint has no authentication, so "
                         "anyone who can reach the port reads the daemon's metrics (docs/security.md)"))
    return warnings


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; name the TOML file in it, e.g. {path / 'config.toml'}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return config_from_dict(raw, source=str(path))


_UNKNOWN_KEY = re.compile(r"unknown field `([^`]*)`(?: - at `\$((?:\.\w+)*)`)?")


def _nearest_key(error: str) -> str:
    """"; did you mean 'state_dir'?" for msgspec's "unknown field `stat_dir` - at `$.daemon`"."""
    match = _UNKNOWN_KEY.search(error)
    if match is None:
        return ""
    section: Any = Config
    for name in (match.group(2) or "").split(".")[1:]:
        fields = {f.name: f.type for f in msgspec.structs.fields(section)}
        section = fields.get(name)
        if not (isinstance(section, type) and issubclass(section, msgspec.Struct)):
            return ""
    return did_you_mean(match.group(1), [f.name for f in msgspec.structs.fields(section)])


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> Config:
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        # msgspec names the key as `$.section.key`; say it in the TOML's terms.
        text = str(exc).replace("`$.", "`").replace("`$`", "the top level")
        raise ConfigError(f"{source}: {text}{_nearest_key(str(exc))}") from None
    problems = _check(cfg)
    if problems:
        lines = "\n".join(f"  {key}: {why}" for key, why in problems)
        raise ConfigError(f"{source}: invalid configuration\n{lines}")
    return cfg
