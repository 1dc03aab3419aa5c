"""Device slots on the real cgroup filesystem: made with their quota, processes and their later
children inside, the kernel holding a slot to its quota, cleanup on close, at exit and after a
SIGKILL of the owner, a clear refusal for a user who cannot write cgroups, and the pinning
fallback. Detection is also checked on the mountinfo of hosts we cannot run on (v2-only, a
container's nested cgroup)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynaresized.backends.cpu.device_slots import (
    CgroupMount,
    CgroupSlot,
    DeviceSlots,
    PinnedSlot,
    SlotMechanism,
    SlotsUnavailable,
    detect_cpu_cgroup,
    parse_cpu_cgroups,
)

REPO = Path(__file__).parents[3]

# -- detection from mountinfo (pure) --------------------------------------------------------------
HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "4:memory:/process_api/9f61\n2:cpuacct:/\n1:cpu:/\n0::/\n"


def test_hybrid_host_puts_slots_in_the_v1_cpu_hierarchy() -> None:
    mounts = parse_cpu_cgroups(HYBRID_MOUNTINFO, HYBRID_CGROUP)
    assert mounts[0] == CgroupMount(SlotMechanism.CGROUP_V1, "/sys/fs/cgroup/cpu", "")
    assert mounts[1].version is SlotMechanism.CGROUP_V2  # a candidate only if it lists cpu
    assert [m.version for m in mounts] == [SlotMechanism.CGROUP_V1, SlotMechanism.CGROUP_V2]


def test_v2_only_host_with_a_nested_home() -> None:
    mountinfo = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    mounts = parse_cpu_cgroups(mountinfo, "0::/system.slice/dynaresized.service\n")
    assert mounts == [CgroupMount(SlotMechanism.CGROUP_V2, "/sys/fs/cgroup", "system.slice/dynaresized.service")]
    assert mounts[0].home_path == Path("/sys/fs/cgroup/system.slice/dynaresized.service")


def test_co_mounted_v1_controllers_in_a_container() -> None:
    # The container sees the host's cgroup /docker/abc as its mount's root: home is relative to it.
    mountinfo = ("700 690 0:40 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup "
                 "rw,cpu,cpuacct\n")
    mounts = parse_cpu_cgroups(mountinfo, "3:cpu,cpuacct:/docker/abc/job\n")
    assert mounts == [CgroupMount(SlotMechanism.CGROUP_V1, "/sys/fs/cgroup/cpu,cpuacct", "job")]


def test_no_cpu_controller_means_no_candidate() -> None:
    mountinfo = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    assert parse_cpu_cgroups(mountinfo, "4:memory:/\n") == []
    assert parse_cpu_cgroups("", "") == []


def test_cpuacct_alone_is_not_the_cpu_controller() -> None:
    mountinfo = "33 31 0:30 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct\n"
    assert parse_cpu_cgroups(mountinfo, "2:cpuacct:/\n") == []


def test_bad_arguments_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="cannot name a cgroup"):
        DeviceSlots.cgroups(["ok", "../escape"], 0.5)
    with pytest.raises(ValueError, match="repeat"):
        DeviceSlots.cgroups(["d0", "d0"], 0.5)
    with pytest.raises(ValueError, match="at least one"):
        DeviceSlots.cgroups([], 0.5)
    with pytest.raises(ValueError, match="cpus must be > 0"):
        DeviceSlots.cgroups(["d0"], 0.0)
    with pytest.raises(ValueError, match="1 ms minimum"):
        DeviceSlots.cgroups(["d0"], 0.001)
    with pytest.raises(ValueError, match="weight must be within"):
        DeviceSlots.cgroups(["d0"], 0.5, weight=1)


# -- real cgroups -------------------------------------------------------------------------------
def _writable_mount() -> CgroupMount:
    mount = detect_cpu_cgroup()
    if mount is None:
        pytest.skip("no cgroup hierarchy with the cpu controller is mounted")
    if os.geteuid() != 0:
        pytest.skip("writing cgroups needs root (CI runs as root)")
    return mount


@pytest.fixture
def parent() -> Iterator[str]:
    """A parent directory of this test's own, so that tests never see another run's slots."""
    mount = _writable_mount()
    name = f"dynaresized-test-{uuid.uuid4().hex[:8]}"
    yield name
    path = mount.home_path / name
    leftovers = [p.name for p in path.iterdir() if p.is_dir()] if path.is_dir() else []
    if path.is_dir():
        path.rmdir()
    assert leftovers == [], f"runs left behind under {path}"


def _cpu_cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        mount = detect_cpu_cgroup()
        assert mount is not None
        if mount.version is SlotMechanism.CGROUP_V1 and "cpu" in controllers.split(","):
            return path
        if mount.version is SlotMechanism.CGROUP_V2 and hierarchy == "0":
            return path
    raise AssertionError(f"process {pid} has no cpu cgroup")


def _relative_to_mount(slot: CgroupSlot) -> str:
    mount = detect_cpu_cgroup()
    assert mount is not None
    return "/" + str(slot.path.relative_to(mount.mount_point))


def test_slots_get_their_quota_and_close_removes_them(parent: str) -> None:
    slots = DeviceSlots.cgroups(["node0:cpu0", "node0:cpu1"], 0.25, parent=parent, period_us=50_000, weight=8192)
    assert slots.mechanism in (SlotMechanism.CGROUP_V1, SlotMechanism.CGROUP_V2)
    assert slots.devices == ["node0:cpu0", "node0:cpu1"]
    for slot in slots:
        assert isinstance(slot, CgroupSlot) and slot.path.is_dir()
        if slot.mechanism is SlotMechanism.CGROUP_V1:
            assert (slot.path / "cpu.cfs_quota_us").read_text().strip() == "12500"
            assert (slot.path / "cpu.cfs_period_us").read_text().strip() == "50000"
            # The weight is set on every level: the parent competes for all its devices.
            for level in (slot.path, slot.path.parent, slot.path.parent.parent):
                assert (level / "cpu.shares").read_text().strip() == "8192"
        else:
            assert (slot.path / "cpu.max").read_text().split() == ["12500", "50000"]
            for level in (slot.path, slot.path.parent, slot.path.parent.parent):
                assert (level / "cpu.weight").read_text().strip() == "800"
    first = slots["node0:cpu0"]
    assert isinstance(first, CgroupSlot)
    first.set_cpus(1.5)
    if first.mechanism is SlotMechanism.CGROUP_V1:
        assert (first.path / "cpu.cfs_quota_us").read_text().strip() == "75000"
    assert first.cpus == 1.5
    run_dir = slots.run_dir
    assert run_dir is not None and run_dir.name.startswith(f"run-{os.getpid()}-")
    slots.close()
    slots.close()  # idempotent
    assert not run_dir.exists()
    with pytest.raises(KeyError, match="no slot for device 'gpu9'"):
        slots["gpu9"]


def test_two_runs_of_one_process_share_the_parent_and_keep_apart(parent: str) -> None:
    with DeviceSlots.cgroups(["d0"], 0.5, parent=parent, weight=4096) as a, DeviceSlots.cgroups(["d0"], 0.5, parent=parent) as b:
        assert a.run_dir != b.run_dir and a.run_dir is not None and b.run_dir is not None
        assert a.run_dir.is_dir() and b.run_dir.is_dir()  # b's start left a's live run alone
        if b.mechanism is SlotMechanism.CGROUP_V1:
            # b's default weight replaced the one a gave the shared parent: no stale weight lingers.
            assert (b.run_dir.parent / "cpu.shares").read_text().strip() == "1024"
            assert (a.run_dir / "cpu.shares").read_text().strip() == "4096"


def test_children_forked_after_assign_stay_in_the_slot(parent: str) -> None:
    # The process waits for a line on stdin, so it is assigned before it forks its child.
    script = "import subprocess, sys; sys.stdin.readline(); c = subprocess.Popen(['sleep', '30']); print(c.pid, flush=True); sys.stdin.readline(); c.kill()"
    with DeviceSlots.cgroups(["d0", "d1"], 0.5, parent=parent) as slots:
        slot = slots["d1"]
        assert isinstance(slot, CgroupSlot)
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            slot.assign(proc.pid)
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("fork\n")
            proc.stdin.flush()
            child = int(proc.stdout.readline())
            assert _cpu_cgroup_of(proc.pid) == _relative_to_mount(slot)
            assert _cpu_cgroup_of(child) == _relative_to_mount(slot)
            assert sorted(slot.pids()) == sorted([proc.pid, child])
            proc.stdin.write("done\n")
            proc.stdin.flush()
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            proc.wait()
        with pytest.raises(ProcessLookupError, match="no process"):
            slot.assign(proc.pid)


def test_wrapped_command_and_its_children_run_in_the_slot(parent: str) -> None:
    with DeviceSlots.cgroups(["d0"], 0.5, parent=parent) as slots:
        slot = slots["d0"]
        assert isinstance(slot, CgroupSlot)
        out = subprocess.run(slot.wrap(["sh", "-c", "cat /proc/self/cgroup; sh -c 'cat /proc/self/cgroup'"]),
                             capture_output=True, text=True, check=True).stdout
        expected = _relative_to_mount(slot)
        mine = [line.split(":", 2)[2] for line in out.splitlines()
                if (slot.mechanism is SlotMechanism.CGROUP_V2 and line.startswith("0::"))
                or (slot.mechanism is SlotMechanism.CGROUP_V1 and "cpu" in line.split(":")[1].split(","))]
        assert mine == [expected, expected]  # the command and the child it forked


def test_the_kernel_holds_a_busy_slot_to_its_quota(parent: str) -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.1: pass"
    with DeviceSlots.cgroups(["d0"], 0.1, parent=parent) as slots:
        slot = slots["d0"]
        assert isinstance(slot, CgroupSlot)
        before = slot.cpu_stat()
        subprocess.run(slot.wrap([sys.executable, "-c", busy]), check=True, timeout=120)
        after = slot.cpu_stat()
    # 0.1 CPU-s at 10 ms per 100 ms period cannot finish inside one period: it was throttled.
    assert after.throttled_periods > before.throttled_periods
    assert after.throttled_s > before.throttled_s


DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from dynaresized.backends.cpu.device_slots import DeviceSlots
    slots = DeviceSlots.cgroups(["d0", "d1"], 0.5, parent=sys.argv[1])
    child = subprocess.Popen(slots["d0"].wrap(["sleep", "60"]), start_new_session=True)
    while not slots["d0"].pids():
        time.sleep(0.01)
    print("RUN", slots.run_dir, child.pid, flush=True)
    if sys.argv[2] == "wait":
        time.sleep(120)
    child.kill()
    child.wait()
""")


def _start_driver(parent: str, mode: str) -> tuple[subprocess.Popen[str], Path, int]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, parent, mode], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    assert driver.stdout is not None
    printed = []
    for line in driver.stdout:  # structlog's lines come first
        printed.append(line)
        if line.startswith("RUN "):
            _, run_dir, child = line.split()
            return driver, Path(run_dir), int(child)
    driver.kill()
    raise AssertionError(f"the driver exited with {driver.wait()} after printing {printed}")


def test_a_sigkilled_owners_slots_are_removed_at_the_next_start(parent: str) -> None:
    driver, run_dir, child = _start_driver(parent, "wait")
    try:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        assert run_dir.is_dir()  # a SIGKILL leaves no chance to clean up
        assert str(child) in (run_dir / "d0" / "cgroup.procs").read_text().split()
        with DeviceSlots.cgroups(["d0"], 0.5, parent=parent) as slots:
            assert not run_dir.exists()
            assert slots.run_dir is not None and slots.run_dir.is_dir()
            # The orphan still runs, back in the cgroup of whoever cleaned up.
            assert _cpu_cgroup_of(child) == _cpu_cgroup_of(os.getpid())
    finally:
        os.kill(child, signal.SIGKILL)
        driver.kill()


def test_a_live_owners_slots_are_left_alone(parent: str) -> None:
    driver, run_dir, child = _start_driver(parent, "wait")
    try:
        with DeviceSlots.cgroups(["d0"], 0.5, parent=parent):
            assert run_dir.is_dir()
            assert str(child) in (run_dir / "d0" / "cgroup.procs").read_text().split()
    finally:
        driver.kill()
        driver.wait(timeout=30)
        os.kill(child, signal.SIGKILL)
    with DeviceSlots.cgroups(["d0"], 0.5, parent=parent):
        assert not run_dir.exists()


def test_a_driver_that_exits_without_close_leaves_nothing(parent: str) -> None:
    driver, run_dir, _ = _start_driver(parent, "exit")
    assert driver.wait(timeout=60) == 0
    assert not run_dir.exists()


# The interpreter lives under /root here, which nobody may not read: the child starts as root,
# imports what it needs, then becomes nobody for good (setuid from root drops every capability).
REFUSAL = textwrap.dedent("""
    import os, sys
    from dynaresized.backends.cpu.device_slots import DeviceSlots, SlotsUnavailable
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    assert os.geteuid() == 65534 and os.getuid() == 65534
    try:
        DeviceSlots.cgroups(["d0"], 0.5, parent=sys.argv[1])
    except SlotsUnavailable as exc:
        print("refused:", exc)
    slots = DeviceSlots.open(["d0"], 0.5, parent=sys.argv[1])
    print("open:", slots.mechanism.value)
""")


def test_a_user_who_cannot_write_cgroups_gets_a_clear_refusal_and_the_fallback(parent: str) -> None:
    out = subprocess.run([sys.executable, "-c", REFUSAL, parent], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    refused = next(line for line in out.stdout.splitlines() if line.startswith("refused:"))
    assert "Permission denied" in refused
    assert "write access to the cpu cgroup" in refused and "DeviceSlots.pinned" in refused
    assert "open: pinned" in out.stdout
    assert "fall back to one pinned core per device" in out.stdout + out.stderr


# -- the pinning fallback -----------------------------------------------------------------------
def test_pinned_slots_put_each_device_on_a_core_of_its_own() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    devices = [f"node0:cpu{i}" for i in range(len(allowed))]
    slots = DeviceSlots.pinned(devices)
    assert slots.mechanism is SlotMechanism.PINNED
    cores = []
    for slot in slots:
        assert isinstance(slot, PinnedSlot) and slot.cpus == 1.0
        out = subprocess.run(slot.wrap([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]),
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"[{slot.core}]"
        cores.append(slot.core)
    assert cores == allowed
    with pytest.raises(SlotsUnavailable, match=f"needs {len(allowed) + 1} cores"):
        DeviceSlots.pinned([*devices, "one-too-many"])


def test_assign_pins_every_thread_and_later_children() -> None:
    script = textwrap.dedent("""
        import os, subprocess, sys, threading
        seen = []
        threading.Thread(target=lambda: (sys.stdin.readline(), seen.append(os.sched_getaffinity(0)))).start()
        sys.stdin.readline()
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True).stdout.strip()
        print(sorted(os.sched_getaffinity(0)), child, flush=True)
        sys.stdin.readline()
        print(sorted(seen[0]) if seen else None, flush=True)
    """)
    core = sorted(os.sched_getaffinity(0))[-1]
    slot = DeviceSlots.pinned(["d0"], cores=[core])["d0"]
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        slot.assign(proc.pid)
        out, _ = proc.communicate("go\nthread\n", timeout=60)
    finally:
        proc.kill()
    lines = out.splitlines()
    assert lines[0] == f"[{core}] [{core}]"  # the main thread and a child forked after assign
    assert lines[1] == f"[{core}]"  # the thread that already ran when it was assigned
