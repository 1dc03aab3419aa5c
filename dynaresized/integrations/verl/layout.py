"""How a verl fully-async job appears to dynaresized: its devices, pools and allowed splits, and
what each resize operation asks of verl's hybrid rollout replicas. No verl import: the daemon's
host prints its `[cluster]` section from here (`python -m dynaresized.integrations.verl`).

A dynaresized device here is a verl replica slot, not a GPU:

* `verl:trainer`: the trainer's own share of the trainer GPUs. verl never shrinks its FSDP
  group, so this device never leaves the training pool (it has no rollout worker).
* `verl:hybrid_<i>`: hybrid replica `hybrid_<i>` (verl's resource id), which time-shares the
  trainer GPUs. In the training pool while it sleeps, in the rollout pool while verl has it
  active. verl activates and deactivates all hybrid replicas together, so every resize moves
  all of them: the only allowed splits are "asleep" and "active".
* `verl:standalone_<j>`: a standalone rollout replica on its own GPUs. verl never trains on
  those, so it never leaves the rollout pool (it has no trainer worker).
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from dynaresized.domain import DeviceId, OpKind, Pool, Split

POLICY_NAME = "dynaresized"
"""The name verl's `async_training.dynamic_schedule_policy` selects."""

TRAINER_WORKER = "verl-trainer"
ROLLOUT_WORKER = "verl-rollout"


class VerlLayout(msgspec.Struct, frozen=True):
    hybrid: int  # hybrid rollout replicas (verl: trainer GPUs / rollout parallel size)
    standalone: int  # standalone rollout replicas (verl: rollout GPUs / rollout parallel size)

    def __post_init__(self) -> None:
        if self.hybrid < 1:
            raise ValueError(f"a verl job needs at least one hybrid replica to move, got hybrid={self.hybrid}")
        if self.standalone < 0:
            raise ValueError(f"standalone replicas must be >= 0, got {self.standalone}")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> VerlLayout:
        """From DYNARESIZED_VERL_HYBRID and DYNARESIZED_VERL_STANDALONE (verl passes the policy
        no configuration of its own, so the layout arrives through the Ray runtime_env)."""
        env = dict(os.environ if env is None else env)
        try:
            return VerlLayout(hybrid=int(env.get("DYNARESIZED_VERL_HYBRID", "1")),
                              standalone=int(env.get("DYNARESIZED_VERL_STANDALONE", "0")))
        except ValueError as exc:
            raise ValueError(f"DYNARESIZED_VERL_HYBRID / DYNARESIZED_VERL_STANDALONE: {exc}") from None

    @property
    def trainer_device(self) -> DeviceId:
        return "verl:trainer"

    @property
    def hybrid_devices(self) -> tuple[DeviceId, ...]:
        return tuple(f"verl:hybrid_{i}" for i in range(self.hybrid))

    @property
    def standalone_devices(self) -> tuple[DeviceId, ...]:
        return tuple(f"verl:standalone_{j}" for j in range(self.standalone))

    @property
    def devices(self) -> tuple[DeviceId, ...]:
        return (self.trainer_device, *self.hybrid_devices, *self.standalone_devices)

    @property
    def trainer_worker_devices(self) -> tuple[DeviceId, ...]:
        return (self.trainer_device, *self.hybrid_devices)

    @property
    def rollout_worker_devices(self) -> tuple[DeviceId, ...]:
        return (*self.hybrid_devices, *self.standalone_devices)

    @property
    def asleep(self) -> Split:
        """The split while verl's hybrid replicas sleep (how verl starts)."""
        return Split(train=1 + self.hybrid, rollout=self.standalone)

    @property
    def active(self) -> Split:
        return Split(train=1, rollout=self.hybrid + self.standalone)

    def cluster_section(self) -> dict[str, object]:
        """The daemon's `[cluster]` keys for this job. Without standalone replicas (verl's
        only_hybrid) the daemon only observes; the "active" split is still listed so that the
        hybrid slots' would-be move shows in `events` as refused for want of a rollout worker."""
        return {"devices": list(self.devices), "training": list(self.trainer_worker_devices),
                "candidates": [str(self.asleep), str(self.active)]}

    def cluster_toml(self) -> str:
        def value(v: object) -> str:
            return "[" + ", ".join(f'"{x}"' for x in v) + "]" if isinstance(v, list) else f'"{v}"'

        lines = ["[cluster]", *(f"{k} = {value(v)}" for k, v in self.cluster_section().items())]
        return "\n".join(lines) + "\n"


def hybrid_wanted(kind: OpKind, from_pool: Pool, to_pool: Pool) -> bool | None:
    """What the rollout worker's op asks of verl's hybrid replicas: True = active, False = asleep,
    None = nothing. Level-triggered: an op names the state it needs, never a toggle, so a
    re-sent op or a rollback asks for a state verl may already be in."""
    if to_pool is Pool.ROLLOUT:  # training -> rollout: the rollout side JOINs, EVICT undoes it
        return {OpKind.JOIN: True, OpKind.RESTORE: True, OpKind.EVICT: False}.get(kind)
    # rollout -> training: the rollout side DRAINs and RELEASEs; RESUME and RECLAIM undo them
    return {OpKind.DRAIN: False, OpKind.RELEASE: False, OpKind.RESUME: True, OpKind.RECLAIM: True}.get(kind)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynaresized.integrations.verl",
                                     description="print the daemon's [cluster] section for a verl fully-async job")
    parser.add_argument("--hybrid", type=int, required=True,
                        help="hybrid replicas: trainer GPUs / rollout tensor x pipeline parallel size")
    parser.add_argument("--standalone", type=int, required=True,
                        help="standalone replicas: rollout GPUs / rollout parallel size (0 if rollout.nnodes=0)")
    args = parser.parse_args(argv)
    try:
        layout = VerlLayout(hybrid=args.hybrid, standalone=args.standalone)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(layout.cluster_toml())
    return 0
