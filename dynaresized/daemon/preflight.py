"""What `serve` checks before it binds a socket or writes the log, and `check-config` runs too.

One path for both, so `check-config` answers "ok" only to what `serve` starts, and refuses
with the same words. Each check reports a root cause once; a check that depends on another
(the log's inventory needs a readable state directory) is skipped when that one failed.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import msgspec

from dynaresized.core.policy import Policy, UnknownPolicyError, available_policies, load_policy
from dynaresized.core.state import ClusterState
from dynaresized.daemon.config import Config, is_loopback_endpoint
from dynaresized.daemon.security import SecurityError, load_server_keys
from dynaresized.store import CorruptLogError, FactLog, StoreLockedError, open_recorder, writer_lock_problem
from dynaresized.spelling import did_you_mean

EVENTS_FILE = "events.sqlite"


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to change."""


def configured_policy(config: Config) -> Policy:
    """The policy `[policy]` names, built with its options."""
    try:
        policy = load_policy(config.policy.name, config.policy.options)
    except UnknownPolicyError as exc:
        raise StartupError(f"policy.name: {exc.args[0]}{did_you_mean(config.policy.name, available_policies())}") \
            from None
    except (ValueError, TypeError) as exc:
        raise StartupError(f"policy.options: {exc}") from None
    if getattr(policy, "regroups_tails", False):
        raise StartupError("policy.options: tail_regroup is simulated only (`dynaresized simulate --policy-option "
                           "tail_regroup=true`): no backend moves a running request's KV cache to a wider engine "
                           "yet; remove the option")
    return policy


def security_problem(config: Config) -> str:
    """Why the worker endpoint may not be bound as configured, or "" when it may."""
    d, sec = config.daemon, config.security
    if not is_loopback_endpoint(d.worker_endpoint) and not sec.server_secret_key:
        return (f"refusing to bind {d.worker_endpoint} without CurveZMQ: set security.server_secret_key and "
                "security.authorized_keys_dir (create keys with `dynaresized keygen`), or bind 127.0.0.1/ipc://")
    if sec.server_secret_key:
        try:
            load_server_keys(sec.server_secret_key, sec.authorized_keys_dir)
        except SecurityError as exc:
            return str(exc)
    return ""


# Kernel filesystems: access(2) says root may write there, yet mkdir fails (/proc) or is refused
# (/sys), and nothing written there would survive a reboot anyway.
KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs",
                                "configfs", "pstore", "bpf", "efivarfs", "fusectl", "devpts", "mqueue",
                                "binfmt_misc", "autofs", "hugetlbfs", "rpc_pipefs", "nsfs"})


def filesystem_of(path: Path, mounts: str = "/proc/self/mounts") -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding the existing `path`, or None where
    the mount table cannot be read (not Linux)."""
    try:
        table = Path(mounts).read_text()
    except OSError:
        return None
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # later mounts hide earlier ones
            best = (point, fields[2])
    return best


def state_dir_problem(config: Config) -> str:
    """Why the daemon could not create or write its state directory, or "" when it could.
    Nothing is created here: the nearest existing ancestor must let us create the rest.
    `serve` runs this before it creates the directory, so both refuse in these words."""
    state_dir = Path(config.daemon.state_dir)
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create state_dir {state_dir}: {existing} is not a directory"
    mount = filesystem_of(existing)
    if mount is not None and mount[1] in KERNEL_FILESYSTEMS:
        return (f"state_dir {state_dir} is on {mount[0]}, a {mount[1]} filesystem the kernel provides: it holds "
                "no files of ours; put the log on a disk, e.g. /var/lib/dynaresized")
    if not os.access(existing, os.W_OK | os.X_OK):
        verb = "write to" if existing == state_dir else f"create {state_dir} in"
        return f"cannot {verb} state_dir {state_dir}: {existing} is not writable by this user (uid {os.getuid()})"
    return ""


DESCRIPTORS_SPARE = 256  # the control socket, the log, libzmq's own, the metrics server


def descriptors_needed(config: Config) -> tuple[int, int]:
    """(the least, what to have) open files for `config`'s inventory: a TCP connection per
    worker, an engine and a trainer per device, and as many again for the old connections a
    reconnect storm leaves open until ZMTP heartbeats drop them."""
    workers = config.worker_connections()
    return workers + DESCRIPTORS_SPARE, 2 * workers + DESCRIPTORS_SPARE


def descriptor_problem(config: Config) -> str:
    """Why this process may not open a connection per worker, or "" when it may (the soft
    limit is raised up to the hard one at start: `raise_open_files`)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    least, want = descriptors_needed(config)
    if hard != resource.RLIM_INFINITY and hard < least:
        return (f"the open-file limit is {hard} (RLIMIT_NOFILE, hard), and {len(config.cluster.devices)} devices need "
                f"at least {least}: a connection per worker, an engine and a trainer per device; raise it "
                f"(systemd: LimitNOFILE={want} or more, as systemd/dynaresized.service does; a shell: ulimit -Hn)")
    return ""


def raise_open_files(config: Config) -> None:
    """Raise the soft open-file limit towards what the inventory needs (at most the hard limit;
    systemd starts services at a soft 1,024, which 512 devices' workers already exceed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, want = descriptors_needed(config)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(hard, want), hard))


def inventory_problem(config: Config, recorded: ClusterState) -> str:
    """Why the log's recorded inventory does not fit `cluster.devices`, or "" when it does."""
    devices = set(config.cluster.devices)
    if not recorded.configured or set(recorded.devices) == devices:
        return ""
    path = Path(config.daemon.state_dir) / EVENTS_FILE
    added, removed = sorted(devices - set(recorded.devices)), sorted(set(recorded.devices) - devices)
    differ = "; ".join(part for part in (
        f"only in the configuration: {', '.join(added)}" if added else "",
        f"only in the log: {', '.join(removed)}" if removed else "") if part)
    return (f"cluster.devices in the configuration ({len(devices)} devices) differ from the inventory in {path} "
            f"({len(recorded.devices)} devices): {differ}; restore the old list, or move the state directory aside "
            "to start a new log")


def log_problem(path: Path, exc: Exception) -> str:
    """What to say when the event log cannot be opened or replayed."""
    if isinstance(exc, CorruptLogError | StoreLockedError):
        return f"event log {path}: {exc} (see docs/store.md: python -m dynaresized.store check)"
    return f"event log {path} cannot be read: {exc}"


LOG_ERRORS = (CorruptLogError, StoreLockedError, ValueError, OSError, msgspec.DecodeError)


def recorded_state(config: Config) -> ClusterState | None:
    """The state an existing log folds to, read without writing; None when there is no log."""
    path = Path(config.daemon.state_dir) / EVENTS_FILE
    if not path.exists():
        return None
    try:
        recorder = open_recorder(path, read_only=True)
    except LOG_ERRORS as exc:
        raise StartupError(log_problem(path, exc)) from None
    try:
        return FactLog(recorder, snapshot_every=config.daemon.snapshot_every).replay()
    except LOG_ERRORS as exc:
        raise StartupError(log_problem(path, exc)) from None
    finally:
        recorder.close()


def startup_problems(config: Config, *, read_log: bool, policy: bool = True) -> list[str]:
    """Every root cause `serve` would refuse to start for. With `read_log`, also replay an
    existing log read-only and compare its inventory (`serve` does that on the log it opens);
    without `policy`, leave out building the policy (a daemon given one has built it)."""
    problems: list[str] = []
    if policy:
        try:
            configured_policy(config)
        except StartupError as exc:
            problems.append(str(exc))
    if problem := security_problem(config):
        problems.append(problem)
    if problem := descriptor_problem(config):
        problems.append(problem)
    if problem := state_dir_problem(config):
        problems.append(problem)
    elif read_log:
        try:
            recorded = recorded_state(config)
        except StartupError as exc:
            problems.append(str(exc))
        else:
            if recorded is not None and (problem := inventory_problem(config, recorded)):
                problems.append(problem)
    return problems


def check_startup(config: Config, *, read_log: bool, policy: bool = True) -> None:
    """Raise StartupError naming every problem `startup_problems` found."""
    problems = startup_problems(config, read_log=read_log, policy=policy)
    if len(problems) == 1:
        raise StartupError(problems[0])
    if problems:
        raise StartupError(f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def held_by(config: Config) -> str:
    """Why a `serve` of this configuration would be refused while another daemon runs on its
    state directory ("" when none does): what `check-config` says beside "ok" (the running
    daemon's own configuration is valid too), and what `serve` checks before it binds anything."""
    return writer_lock_problem(str(Path(config.daemon.state_dir) / EVENTS_FILE))
