"""The CPU backend: what a "device" is on a machine without accelerators.

`DeviceSlots` gives each device its own CPU-time capacity (a cgroup with a CPU quota, or one
pinned core where cgroups are not writable), so that moving a device between the rollout and
training pools moves capacity with it. See docs/device-slots.md.
"""

from dynaresized.backends.cpu.device_slots import (
    CgroupMount,
    DeviceSlot,
    DeviceSlots,
    SlotCpuStat,
    SlotMechanism,
    SlotsUnavailable,
    detect_cpu_cgroup,
)

__all__ = [
    "CgroupMount",
    "DeviceSlot",
    "DeviceSlots",
    "SlotCpuStat",
    "SlotMechanism",
    "SlotsUnavailable",
    "detect_cpu_cgroup",
]
