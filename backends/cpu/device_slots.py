"""Device slots: each "device" of a CPU machine gets a CPU-time capacity of its own.

Without slots every engine and trainer rank on a CPU machine shares all the cores, so moving a
device between the pools moves no capacity. A slot is a cgroup with a CPU quota (cgroup v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2 `cpu.max`): the processes in it, and every child
they fork afterwards, together get at most `cpus` cores of CPU time per period, whatever else
runs. Where cgroups are not writable, `DeviceSlots.pinned` pins each device to a core of its own
(`sched_setaffinity`, what `taskset` does): devices then no longer compete with each other, but
other load on those cores still competes with them.

Layout: `<cpu hierarchy>/<this process's cgroup>/<parent>/run-<pid>-<start>-<n>/<device>`. The
run directory names its owner (pid and start time, so that a reused pid is not taken for it);
`close()` (also at interpreter exit) removes it, and the next `DeviceSlots.cgroups` removes the
runs whose owner died (a SIGKILL leaves no chance to clean up), first moving any process still
in them back to this process's cgroup. See docs/device-slots.md.
"""

from __future__ import annotations

import abc
import atexit
import enum
import errno
import itertools
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import structlog

log = structlog.get_logger("dynaresized.backends.cpu")

DEFAULT_PARENT = "dynaresized"
DEFAULT_PERIOD_US = 100_000
_MIN_QUOTA_US = 1_000  # the kernel refuses CFS quotas under 1 ms
DEFAULT_WEIGHT = 1024  # v1 cpu.shares of a cgroup nobody set (v2 cpu.weight 100)
_RUN_PREFIX = "run-"
_run_numbers = itertools.count()  # two DeviceSlots of one process get distinct run directories


class SlotMechanism(str, enum.Enum):
    CGROUP_V1 = "cgroup-v1"
    CGROUP_V2 = "cgroup-v2"
    PINNED = "pinned"  # the fallback: one core per device, no quota


class SlotsUnavailable(RuntimeError):
    """Device slots cannot be made here; the message says why and what to use instead."""


class CgroupMount(msgspec.Struct, frozen=True):
    """The cgroup hierarchy that holds the cpu controller, and this process's place in it."""

    version: SlotMechanism  # CGROUP_V1 or CGROUP_V2
    mount_point: str
    home: str  # this process's cgroup relative to mount_point; "" is the hierarchy's root

    @property
    def home_path(self) -> Path:
        return Path(self.mount_point, self.home) if self.home else Path(self.mount_point)


class SlotCpuStat(msgspec.Struct, frozen=True):
    """A slot's `cpu.stat`: how often the kernel held its processes back at the quota."""

    periods: int
    throttled_periods: int
    throttled_s: float


# -- detection ----------------------------------------------------------------------------------
def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _relative(path: str, mount_root: str) -> str:
    """A cgroup path of /proc/<pid>/cgroup, relative to the directory the hierarchy's mount shows."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    return path.strip("/")


def parse_cpu_cgroups(mountinfo: str, proc_cgroup: str) -> list[CgroupMount]:
    """The hierarchies that may hold the cpu controller, v1 first, from the text of
    /proc/self/mountinfo and /proc/self/cgroup.

    A v1 mount is certain to hold it (its options name `cpu`); a v2 mount holds it only if its
    `cgroup.controllers` lists `cpu`, which `detect_cpu_cgroup` checks. On a hybrid host (v1
    controllers plus an empty v2 `unified` mount, as on these machines) v1 comes first.
    """
    v1_home: str | None = None
    v2_home: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_home = path
        elif "cpu" in controllers.split(","):
            v1_home = path
    v1: list[CgroupMount] = []
    v2: list[CgroupMount] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or dash < 5:
            continue
        mount_root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        fstype, super_options = fields[dash + 1], fields[dash + 3].split(",")
        if fstype == "cgroup" and "cpu" in super_options and v1_home is not None:
            v1.append(CgroupMount(SlotMechanism.CGROUP_V1, mount_point, _relative(v1_home, mount_root)))
        elif fstype == "cgroup2" and v2_home is not None:
            v2.append(CgroupMount(SlotMechanism.CGROUP_V2, mount_point, _relative(v2_home, mount_root)))
    return v1 + v2


def detect_cpu_cgroup() -> CgroupMount | None:
    """The hierarchy where this process's device slots would go, or None without a cpu controller."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None  # not Linux, or /proc is not mounted
    for mount in parse_cpu_cgroups(mountinfo, proc_cgroup):
        if mount.version is SlotMechanism.CGROUP_V1:
            return mount
        try:
            controllers = (Path(mount.mount_point) / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in controllers:
            return mount
    return None


# -- processes ----------------------------------------------------------------------------------
def _start_ticks(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), or None if it does not run:
    it does not exist, or it is a zombie (killed, and its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces; after it come
    # the state (field 3) and, 19 fields on, the start time (field 22).
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _owner_alive(run_name: str) -> bool:
    """Whether the process that made run directory `run_name` still runs (True if not ours)."""
    parts = run_name[len(_RUN_PREFIX):].split("-")
    if not run_name.startswith(_RUN_PREFIX) or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return True  # not a name this module writes: leave it alone
    return _start_ticks(int(parts[0])) == int(parts[1])


def _check_device_name(device: str) -> None:
    if not device or device in (".", "..") or any(c in device for c in "/\0\n"):
        raise ValueError(f"device name {device!r} cannot name a cgroup directory")


# -- slots --------------------------------------------------------------------------------------
class DeviceSlot(abc.ABC):
    """The CPU capacity of one device: what its worker processes run in."""

    def __init__(self, device: str, mechanism: SlotMechanism) -> None:
        self.device = device
        self.mechanism = mechanism

    @property
    @abc.abstractmethod
    def cpus(self) -> float:
        """Cores' worth of CPU time this slot's processes may use together."""

    @abc.abstractmethod
    def assign(self, pid: int) -> None:
        """Place running process `pid` (all its threads) in this slot; children it forks from
        now on start here too. Children it forked before stay where they are."""

    @abc.abstractmethod
    def wrap(self, argv: Sequence[str]) -> list[str]:
        """A command line that runs `argv` inside this slot from its first instruction, so that
        nothing it forks escapes (use it with subprocess instead of `assign` after the start)."""


class CgroupSlot(DeviceSlot):
    """A device's cgroup; its quota caps the CPU time of every process in it."""

    def __init__(self, device: str, mechanism: SlotMechanism, path: Path, cpus: float, period_us: int) -> None:
        super().__init__(device, mechanism)
        self.path = path
        self.period_us = period_us
        self._cpus = cpus

    @property
    def cpus(self) -> float:
        return self._cpus

    def set_cpus(self, cpus: float) -> None:
        """Change the quota; the processes in the slot get the new capacity from the next period."""
        quota_us = _quota_us(cpus, self.period_us)
        if self.mechanism is SlotMechanism.CGROUP_V1:
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (self.path / "cpu.max").write_text(f"{quota_us} {self.period_us}")
        self._cpus = cpus

    def assign(self, pid: int) -> None:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            raise ProcessLookupError(f"no process {pid} to place in the slot of {self.device}") from None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        if not argv:
            raise ValueError("wrap needs a command")
        # The shell moves itself into the slot and then becomes the command. If the move fails
        # the shell exits with the error and the command never runs outside its slot.
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def pids(self) -> list[int]:
        """The processes in this slot now."""
        return _procs(self.path)

    def cpu_stat(self) -> SlotCpuStat:
        values: dict[str, int] = {}
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().lstrip("-").isdigit():
                values[key] = int(value)
        if self.mechanism is SlotMechanism.CGROUP_V1:
            throttled_s = values.get("throttled_time", 0) / 1e9
        else:
            throttled_s = values.get("throttled_usec", 0) / 1e6
        return SlotCpuStat(values.get("nr_periods", 0), values.get("nr_throttled", 0), throttled_s)


class PinnedSlot(DeviceSlot):
    """The fallback: a device is one core of its own. No quota; other load may share the core."""

    # What `taskset -c CORE cmd` does, without needing util-linux on the machine.
    _PIN_AND_EXEC = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execvp(sys.argv[2], sys.argv[2:])"

    def __init__(self, device: str, core: int) -> None:
        super().__init__(device, SlotMechanism.PINNED)
        self.core = core

    @property
    def cpus(self) -> float:
        return 1.0

    def assign(self, pid: int) -> None:
        # sched_setaffinity acts on one thread: pin every thread the process has now.
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            raise ProcessLookupError(f"no process {pid} to pin to core {self.core} ({self.device})") from None
        for tid in threads:
            try:
                os.sched_setaffinity(tid, {self.core})
            except ProcessLookupError:
                pass  # the thread ended meanwhile

    def wrap(self, argv: Sequence[str]) -> list[str]:
        if not argv:
            raise ValueError("wrap needs a command")
        return [sys.executable, "-c", self._PIN_AND_EXEC, str(self.core), *argv]


def _quota_us(cpus: float, period_us: int) -> int:
    if not cpus > 0:
        raise ValueError(f"cpus must be > 0, got {cpus}")
    quota_us = round(cpus * period_us)
    if quota_us < _MIN_QUOTA_US:
        raise ValueError(f"{cpus} cpus of a {period_us} µs period is a quota under the kernel's 1 ms minimum")
    return quota_us


def _procs(path: Path) -> list[int]:
    return [int(line) for line in (path / "cgroup.procs").read_text().split()]


def _remove_cgroup(path: Path, home: Path) -> bool:
    """Remove cgroup `path` and the cgroups below it, moving their processes to `home` first.

    True if it is gone. A process may fork while it is moved, and the kernel lets a cgroup go
    only once its last exiting process is reaped, so both steps are retried for a moment.
    """
    if not path.is_dir():
        return True
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        _remove_cgroup(child, home)
    deadline = time.monotonic() + 2.0
    while True:
        try:
            for pid in _procs(path):
                try:
                    (home / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    pass  # it exited meanwhile
            path.rmdir()
            return True
        except FileNotFoundError:
            return True  # another process removed it first
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                log.warning("cannot remove cgroup", path=str(path), error=str(exc))
                return False
            time.sleep(0.02)


class DeviceSlots:
    """One slot per device. Make them with `cgroups`, `pinned`, or `open` (cgroups, else pinning)."""

    def __init__(
        self,
        mechanism: SlotMechanism,
        slots: Sequence[DeviceSlot],
        run_dir: Path | None = None,
        home: Path | None = None,
    ) -> None:
        self.mechanism = mechanism
        self.run_dir = run_dir  # None for pinned slots: nothing to remove
        self._home = home
        self._slots = {slot.device: slot for slot in slots}
        self._owner = os.getpid()
        self._closed = False
        if run_dir is not None:
            atexit.register(self.close)

    # -- making them --------------------------------------------------------------------------
    @classmethod
    def cgroups(
        cls,
        devices: Sequence[str],
        cpus_per_device: float,
        parent: str = DEFAULT_PARENT,
        period_us: int = DEFAULT_PERIOD_US,
        weight: int = DEFAULT_WEIGHT,
        mount: CgroupMount | None = None,
    ) -> DeviceSlots:
        """A cgroup per device with a quota of `cpus_per_device` cores, under
        `<this process's cgroup>/<parent>/`. Removes the runs of dead owners there first.
        Raises `SlotsUnavailable` where there is no cpu controller or it is not writable.

        The quota is a cap. Where the cores are contended, the kernel shares them by weight, and
        the parent competes as ONE task-sized entity (weight 1024) for all its devices together;
        `weight` (in v1 cpu.shares units, 2..262144) raises the parent's, the run's and every
        slot's weight, so that the slots get their quota before other work gets the rest. They
        still never get more than their quota. It is written at every start, so that a weight an
        earlier run gave the shared parent does not outlive it."""
        devices = _checked_devices(devices)
        quota_us = _quota_us(cpus_per_device, period_us)
        _check_device_name(parent)
        if not 2 <= weight <= 262_144:
            raise ValueError(f"weight must be within 2..262144 (v1 cpu.shares), got {weight}")
        mount = mount or detect_cpu_cgroup()
        if mount is None:
            raise SlotsUnavailable(
                "no cgroup hierarchy with the cpu controller is mounted (looked in /proc/self/mountinfo); "
                "use DeviceSlots.pinned(...) to pin one device per core instead"
            )
        home = mount.home_path
        parent_dir = home / parent
        run_dir: Path | None = None

        def write(path: Path, text: str) -> None:
            try:
                path.write_text(text)
            except OSError as exc:
                raise _unavailable(f"write {text!r} to", path, exc) from exc

        def create(path: Path, exist_ok: bool = False) -> None:
            try:
                path.mkdir(exist_ok=exist_ok)
            except OSError as exc:
                raise _unavailable("create the cgroup", path, exc) from exc
            if mount.version is SlotMechanism.CGROUP_V2 and path.parent != run_dir:
                write(path / "cgroup.subtree_control", "+cpu")  # hand the controller down
            if mount.version is SlotMechanism.CGROUP_V1:
                write(path / "cpu.shares", str(weight))
            else:
                # systemd's mapping of shares to weights: 1024 shares is weight 100.
                write(path / "cpu.weight", str(min(10_000, max(1, round(weight * 100 / DEFAULT_WEIGHT)))))

        try:
            if mount.version is SlotMechanism.CGROUP_V2:
                # v2 hands a controller down only where every level above enables it in
                # cgroup.subtree_control, and a non-root cgroup with processes cannot enable it.
                try:
                    enabled = (home / "cgroup.subtree_control").read_text().split()
                except OSError as exc:
                    raise _unavailable("read", home / "cgroup.subtree_control", exc) from exc
                if "cpu" not in enabled:
                    write(home / "cgroup.subtree_control", "+cpu")
            # The parent is shared by every run under it and never removed: removing it could
            # race with another run creating its directory there.
            create(parent_dir, exist_ok=True)
            removed = [run.name for run in _dead_runs(parent_dir) if _remove_cgroup(run, home)]
            if removed:
                log.info("removed device slots of dead runs", runs=removed, parent=str(parent_dir))
            pid = os.getpid()
            run_dir = parent_dir / f"{_RUN_PREFIX}{pid}-{_start_ticks(pid)}-{next(_run_numbers)}"
            create(run_dir)
            slots: list[DeviceSlot] = []
            for device in devices:
                path = run_dir / device
                create(path)
                if mount.version is SlotMechanism.CGROUP_V1:
                    write(path / "cpu.cfs_period_us", str(period_us))
                    write(path / "cpu.cfs_quota_us", str(quota_us))
                else:
                    write(path / "cpu.max", f"{quota_us} {period_us}")
                slots.append(CgroupSlot(device, mount.version, path, cpus_per_device, period_us))
        except BaseException:
            if run_dir is not None:
                _remove_cgroup(run_dir, home)
            raise
        log.info("device slots made", mechanism=mount.version.value, run=str(run_dir), devices=list(devices),
                 cpus_per_device=cpus_per_device, period_us=period_us, weight=weight)
        return cls(mount.version, slots, run_dir, home)

    @classmethod
    def pinned(cls, devices: Sequence[str], cores: Sequence[int] | None = None) -> DeviceSlots:
        """The fallback: device i is pinned to core i of those this process may run on (or of
        `cores`). One core per device; raises `SlotsUnavailable` if there are too few."""
        devices = _checked_devices(devices)
        allowed = sorted(os.sched_getaffinity(0))
        chosen = list(cores) if cores is not None else allowed[: len(devices)]
        if len(chosen) < len(devices):
            raise SlotsUnavailable(
                f"pinning one device per core needs {len(devices)} cores for {len(devices)} devices, "
                f"but this process may run on {len(allowed)} ({allowed})"
            )
        if len(set(chosen)) != len(chosen) or not set(chosen) <= set(allowed):
            raise ValueError(f"cores {chosen} must be distinct cores of {allowed}")
        log.info("device slots pinned", devices=list(devices), cores=chosen[: len(devices)])
        return cls(SlotMechanism.PINNED, [PinnedSlot(d, c) for d, c in zip(devices, chosen)])

    @classmethod
    def open(
        cls,
        devices: Sequence[str],
        cpus_per_device: float,
        parent: str = DEFAULT_PARENT,
        weight: int = DEFAULT_WEIGHT,
        allow_pinning: bool = True,
    ) -> DeviceSlots:
        """Cgroup slots where cgroups are writable; otherwise, if `allow_pinning`, pinned ones
        (logged with the reason, and `mechanism` says which it is)."""
        try:
            return cls.cgroups(devices, cpus_per_device, parent=parent, weight=weight)
        except SlotsUnavailable as exc:
            if not allow_pinning:
                raise
            log.warning("device slots fall back to one pinned core per device", reason=str(exc),
                        cpus_per_device_ignored=cpus_per_device)
            return cls.pinned(devices)

    # -- using them ---------------------------------------------------------------------------
    def __getitem__(self, device: str) -> DeviceSlot:
        try:
            return self._slots[device]
        except KeyError:
            raise KeyError(f"no slot for device {device!r}; slots: {sorted(self._slots)}") from None

    def __iter__(self) -> Iterator[DeviceSlot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def devices(self) -> list[str]:
        return list(self._slots)

    def close(self) -> None:
        """Remove this run's cgroups (processes still in them go back to this process's cgroup).
        Idempotent; also runs at interpreter exit, in the process that made them only."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.run_dir is not None and self._home is not None:
            _remove_cgroup(self.run_dir, self._home)

    def __enter__(self) -> DeviceSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_devices(devices: Sequence[str]) -> list[str]:
    devices = list(devices)
    if not devices:
        raise ValueError("device slots need at least one device")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device names repeat: {devices}")
    for device in devices:
        _check_device_name(device)
    return devices


def _dead_runs(parent_dir: Path) -> list[Path]:
    return sorted(p for p in parent_dir.iterdir()
                  if p.is_dir() and p.name.startswith(_RUN_PREFIX) and not _owner_alive(p.name))


def _unavailable(action: str, path: Path, exc: OSError) -> SlotsUnavailable:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    hint = ""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " (device slots need write access to the cpu cgroup: run as root or in a delegated cgroup)"
    elif exc.errno == errno.EBUSY:
        hint = " (cgroup v2 enables a controller below a cgroup only if that cgroup holds no processes)"
    return SlotsUnavailable(
        f"cannot {action} {path}: {reason}{hint}; without cgroups, DeviceSlots.pinned(...) pins one device per core"
    )
