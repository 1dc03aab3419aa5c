"""The `sim` backend: simulated workers on a virtual cluster, over the real client and daemon.

One process per device, as on a real node: it hosts the device's rollout engine and its
trainer rank (both processes kept; the device's role changes in place). Each resize operation
takes the time the simulator's cost model gives it (`VirtualCluster.op_seconds`), divided by
`speedup`. The trainer on the lowest device also drives the RL loop: every step it sleeps for
max(rollout, training) + weight sync on the current pools (from the model, divided by
`speedup`) and reports the step's timings in simulated seconds. Run the daemon with
`daemon.time_scale = speedup` so that its clock is simulated time too: it then sees what it
would see on a real cluster, only faster. Pools change when a COMMIT op arrives (it carries
the new membership), at the next step boundary.

    python -m dynaresized.backends.sim --endpoint tcp://127.0.0.1:5555 --device node0:gpu3 \
        --scenario longtail-drift --profile qwen3-8b-h20x8 --speedup 3600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from dynaresized.client import OpRequest, WorkerClient
from dynaresized.domain import ActualState, Holding, OpKind, Pool, WorkerKind
from dynaresized.sim.cluster import VirtualCluster

HOLDING_AFTER: dict[OpKind, Holding] = {
    OpKind.DRAIN: Holding.DRAINED,
    OpKind.RELEASE: Holding.RELEASED,
    OpKind.JOIN: Holding.SERVING,
    OpKind.RESTORE: Holding.SERVING,
    OpKind.RESUME: Holding.SERVING,
    OpKind.RECLAIM: Holding.DRAINED,
    OpKind.EVICT: Holding.RELEASED,
}
"""What a simulated worker holds after each op on its device (commit changes nothing on it)."""


def engine_name(device: str) -> str:
    return "engine-" + device.replace(":", "-")


def trainer_name(device: str) -> str:
    return "trainer-" + device.replace(":", "-")


class SimDevice:
    """The two workers of one simulated device, and (on the leader) the RL loop."""

    def __init__(self, cluster: VirtualCluster, endpoint: str, device: str, speedup: float, *,
                 leader: bool = False, steps: int | None = None) -> None:
        self.cluster = cluster
        self.device = device
        self.speedup = speedup
        self.leader = leader
        self.steps = min(steps or cluster.steps, cluster.steps)
        pools = dict(zip(cluster.devices, cluster.initial_pools, strict=True))
        self.training = tuple(d for d, p in pools.items() if p is Pool.TRAINING)
        self.rollout = tuple(d for d, p in pools.items() if p is Pool.ROLLOUT)
        self._pending: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.role = pools[device]
        # What each worker holds, as a fresh process on its launch pool would (after a restart,
        # the daemon converges it with the log: reconciliation).
        self.holding = {kind: Holding.SERVING if kind.pool is self.role else Holding.RELEASED for kind in WorkerKind}
        self.last_op = {kind: "" for kind in WorkerKind}
        self.engine = self._client(endpoint, WorkerKind.ROLLOUT_ENGINE, engine_name(device))
        self.trainer = self._client(endpoint, WorkerKind.TRAINER_RANK, trainer_name(device))
        self.ops: list[str] = []

    def _client(self, endpoint: str, kind: WorkerKind, name: str) -> WorkerClient:
        client = WorkerClient(endpoint, name, kind, (self.device,),
                              actual=lambda: ActualState(holding=self.holding[kind], last_op=self.last_op[kind]))

        async def run(op: OpRequest) -> str:
            detail = await self._op(op)
            if self.device in op.devices and op.kind in HOLDING_AFTER:
                self.holding[kind] = HOLDING_AFTER[op.kind]
            self.last_op[kind] = op.op_id
            return detail

        client.on_all({op_kind: run for op_kind in OpKind})
        return client

    async def _op(self, op: OpRequest) -> str:
        seconds = self.cluster.op_seconds(op.kind, op.to_pool)
        await asyncio.sleep(seconds / self.speedup)
        self.ops.append(op.op_id)
        if op.kind is OpKind.COMMIT:
            self._pending = (op.training, op.rollout)  # takes effect at the next step boundary
        if op.kind is OpKind.JOIN and self.device in op.devices:
            self.role = op.to_pool
        if op.kind is OpKind.EVICT and self.device in op.devices:
            self.role = op.from_pool
        return f"{op.kind.value} on {self.device} took {seconds:.1f}s (simulated)"

    async def run(self) -> int:
        await self.engine.start()
        await self.trainer.start()
        try:
            if self.leader:
                await self._drive()
            else:
                await asyncio.Event().wait()  # serve ops until killed
        finally:
            await self.engine.close(reason="simulation over")
            await self.trainer.close(reason="simulation over")
        return 0

    async def _drive(self) -> None:
        for step in range(self.steps):
            if self._pending is not None:
                self.training, self.rollout = self._pending
                self._pending = None
            timing = self.cluster.step_timing(step, rollout_devices=len(self.rollout),
                                              train_devices=len(self.training))
            step_s = max(timing.rollout_s, timing.train_s) + timing.weight_sync_s
            await asyncio.sleep(step_s / self.speedup)
            await self.trainer.report_step(timing)
            print(json.dumps({"step": step, "step_s": step_s, "train": len(self.training),
                              "rollout": len(self.rollout), "at": time.time()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one simulated device: its engine and trainer workers")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--scenario", default="longtail-drift")
    parser.add_argument("--profile", default="qwen3-8b-h20x8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--speedup", type=float, default=3600.0)
    parser.add_argument("--leader", action="store_true", help="also drive the RL loop and report steps")
    args = parser.parse_args(argv)
    cluster = VirtualCluster.builtin(args.scenario, args.profile, seed=args.seed, steps=args.steps)
    if args.device not in cluster.devices:
        parser.error(f"--device {args.device} is not one of {', '.join(cluster.devices)}")
    sim = SimDevice(cluster, args.endpoint, args.device, args.speedup, leader=args.leader, steps=args.steps)
    try:
        import uvloop

        return uvloop.run(sim.run())
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
