"""How a verl job (fully-async, or V1 separate-async) appears to dynaresized: its devices, its one
split, and what each loan operation asks of verl's hybrid rollout replicas. No verl import: the
daemon's host prints its `[cluster]` section from here (`python -m dynaresized.integrations.verl`).

A dynaresized device here is a verl replica slot, not a GPU:

* `verl:hybrid_<i>`: hybrid replica `hybrid_<i>` (verl's resource id) and the trainer GPUs it
  time-shares. Its home is the training pool: verl's FSDP group keeps every trainer GPU, and
  verl puts the hybrid replicas to sleep before every training step. Between training steps
  verl may activate them for the rollout: that is a loan of the slot to the rollout pool, which
  comes home when the next training step begins. verl activates all hybrid replicas together,
  so a loan lends all of them.
* `verl:standalone_<j>`: a standalone rollout replica on its own GPUs. verl never trains on
  those, so it never leaves the rollout pool (it has no trainer worker).

The split never changes (`H:S`, the one candidate): verl never resizes its trainer group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import msgspec

from dynaresized.domain import DeviceId, OpKind, PlanKind, Pool, Split

POLICY_NAME = "dynaresized"
"""The name verl's `async_training.dynamic_schedule_policy` selects."""

V1_TRAINER_NAME = "dynaresized_separate_async"
"""The name verl's V1 `trainer.v1.trainer_mode` selects: verl's separate-async trainer with its
hybrid-rollout switch decided by the daemon."""

TRAINER_WORKER = "verl-trainer"
ROLLOUT_WORKER = "verl-rollout"
WORKERS = (TRAINER_WORKER, ROLLOUT_WORKER)

ENV_HYBRID = "DYNARESIZED_VERL_HYBRID"
ENV_STANDALONE = "DYNARESIZED_VERL_STANDALONE"


class LayoutMismatch(ValueError):
    """What the operator said about the job (env vars) is not what verl has."""


class VerlLayout(msgspec.Struct, frozen=True):
    hybrid: int  # hybrid rollout replicas (verl: trainer GPUs / rollout parallel size)
    standalone: int  # standalone rollout replicas (verl: rollout GPUs / rollout parallel size)

    def __post_init__(self) -> None:
        if self.hybrid < 1:
            raise ValueError(f"a verl job needs at least one hybrid replica to lend, got hybrid={self.hybrid}")
        if self.standalone < 0:
            raise ValueError(f"standalone replicas must be >= 0, got {self.standalone}")

    @staticmethod
    def from_verl(hybrid_ids: list[str], standalone: int, env: Mapping[str, str] | None = None) -> VerlLayout:
        """The layout verl's rollouter reports (`get_all_hybrid_replicas`, `get_standalone_replicas`).
        DYNARESIZED_VERL_HYBRID / _STANDALONE, where set, are checked against it: they say what
        the daemon's [cluster] section was printed for, and a job that differs is refused here
        with both numbers rather than by the daemon with a list of unknown devices."""
        expected = [f"hybrid_{i}" for i in range(len(hybrid_ids))]
        if sorted(hybrid_ids) != expected:
            raise LayoutMismatch(f"verl's hybrid replicas are {sorted(hybrid_ids)}, not {expected}: this integration "
                                 "knows verl's resource ids hybrid_0 .. hybrid_<H-1>")
        return VerlLayout.from_counts(len(hybrid_ids), standalone, env)

    @staticmethod
    def from_counts(hybrid: int, standalone: int, env: Mapping[str, str] | None = None) -> VerlLayout:
        """The layout of a job with `hybrid` and `standalone` replicas (verl's V1 trainer counts its
        server managers' replicas), checked against DYNARESIZED_VERL_HYBRID / _STANDALONE."""
        layout = VerlLayout(hybrid=hybrid, standalone=standalone)
        env = os.environ if env is None else env
        for name, have in ((ENV_HYBRID, layout.hybrid), (ENV_STANDALONE, layout.standalone)):
            text = env.get(name, "").strip()
            if not text:
                continue
            try:
                said = int(text)
            except ValueError:
                raise LayoutMismatch(f"{name}={text!r} is not a number") from None
            if said != have:
                raise LayoutMismatch(
                    f"{name}={said}, but verl has {have} {name.rsplit('_', 1)[1].lower()} replica(s): print the "
                    f"daemon's [cluster] with `python -m dynaresized.integrations.verl --hybrid {layout.hybrid} "
                    f"--standalone {layout.standalone}`, or unset {name}")
        return layout

    @property
    def hybrid_devices(self) -> tuple[DeviceId, ...]:
        return tuple(f"verl:hybrid_{i}" for i in range(self.hybrid))

    @property
    def standalone_devices(self) -> tuple[DeviceId, ...]:
        return tuple(f"verl:standalone_{j}" for j in range(self.standalone))

    @property
    def devices(self) -> tuple[DeviceId, ...]:
        return (*self.hybrid_devices, *self.standalone_devices)

    @property
    def trainer_worker_devices(self) -> tuple[DeviceId, ...]:
        return self.hybrid_devices

    @property
    def rollout_worker_devices(self) -> tuple[DeviceId, ...]:
        return (*self.hybrid_devices, *self.standalone_devices)

    @property
    def split(self) -> Split:
        """verl's only split: the trainer group on every trainer GPU, the standalone replicas."""
        return Split(train=self.hybrid, rollout=self.standalone)

    def cluster_section(self) -> dict[str, object]:
        """The daemon's `[cluster]` keys for this job. Without standalone replicas (verl's
        only_hybrid) the daemon only observes: no rollout worker attaches, so nothing can be lent."""
        return {"devices": list(self.devices), "training": list(self.trainer_worker_devices),
                "candidates": [str(self.split)]}

    def cluster_toml(self) -> str:
        def value(v: object) -> str:
            return "[" + ", ".join(f'"{x}"' for x in v) + "]" if isinstance(v, list) else f'"{v}"'

        lines = ["[cluster]", *(f"{k} = {value(v)}" for k, v in self.cluster_section().items())]
        return "\n".join(lines) + "\n"


def hybrid_wanted(kind: OpKind, plan: PlanKind, to_pool: Pool) -> bool | None:
    """What a rollout-side op asks of verl's hybrid replicas: True = active, False = asleep,
    None = nothing. Level-triggered: an op names the state it needs, never a toggle, so a
    re-sent op or a rollback asks for a state verl may already be in. Only loans and their
    returns reach verl; a resize raises (verl never resizes its trainer group). Reconcile asks
    nothing: verl's hybrid replicas sleep at every training step's start, whatever came before."""
    if plan is PlanKind.RESIZE:
        raise ValueError(f"verl never resizes its trainer group (op {kind.value}): allow only the split "
                         "`python -m dynaresized.integrations.verl` prints")
    if plan is PlanKind.RECONCILE:
        return None
    if to_pool is Pool.ROLLOUT:  # a loan: the rollout side JOINs, EVICT undoes it
        return {OpKind.JOIN: True, OpKind.EVICT: False}.get(kind)
    # its return: the rollout side DRAINs and RELEASEs; RESUME and RECLAIM would undo them
    return {OpKind.DRAIN: False, OpKind.RELEASE: False}.get(kind)


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
