"""A verl fully-async job on CPU for the integration tests, run by the verl virtual environment's
python (`.venv-verl/bin/python tests/integrations/verl_job.py ...`).

Real: Ray (a local cluster), verl's `DynamicResourceController`, verl's policy registry and our
policy, registered by the Ray `worker_process_setup_hook` inside the trainer actor, which
drives the controller in the order verl's `FullyAsyncTrainer.fit_step` and
`_fit_update_weights` do. Faked, as in verl's own CPU tests, only what needs GPUs: the rollouter
actor's replica lists and `add_replicas` / `remove_replicas`, the hybrid checkpoint manager's
abort / sleep / resume / update, and generation and training themselves, which take the time a
phase gives them (rollout work spread over the active replicas; training slowed while hybrid
replicas share its GPUs). Every step prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import ray

# Rollout work (time units on one replica) and training time per phase, per step.
PHASES = {"rollout": (6.0, 1.0), "train": (1.0, 1.0)}
SHARED_TRAIN_SLOWDOWN = 1.5  # training shares its GPUs with active hybrid replicas
REQUIRED_SAMPLES = 8


@ray.remote(num_cpus=0)
class FakeRollouter:
    """The GPU-bound rollouter's surface that verl's controller and trainer call."""

    def __init__(self, hybrid: int) -> None:
        self.hybrid = {f"hybrid_{i}": f"replica-{i}" for i in range(hybrid)}
        self.alive: set[str] = set()
        self.produced = 0
        self.completed = 0
        self.calls: list[tuple[str, list[str]]] = []

    def get_all_hybrid_replicas(self) -> dict[str, str]:
        return dict(self.hybrid)

    async def add_replicas(self, resource_ids: list[str]) -> int:
        self.calls.append(("add_replicas", list(resource_ids)))
        new = [r for r in resource_ids if r in self.hybrid and r not in self.alive]  # verl skips active ones
        self.alive.update(new)
        return len(new)

    async def remove_replicas(self, resource_ids: list[str]) -> int:
        self.calls.append(("remove_replicas", list(resource_ids)))
        gone = [r for r in resource_ids if r in self.alive]
        self.alive.difference_update(gone)
        return len(gone)

    async def rebalance_requests(self) -> dict[str, object]:
        self.calls.append(("rebalance_requests", sorted(self.alive)))
        return {"cleared_entries": 0, "server_loads": {}}

    def wait_for_enough_samples(self, threshold: int) -> bool:
        return True

    def generated(self, samples: int) -> None:
        self.produced += samples
        self.completed += 1

    def get_total_produced_samples(self) -> int:
        return self.produced

    def get_completed_steps(self) -> int:
        return self.completed

    def active_replicas(self) -> int:
        return len(self.alive)

    def calls_made(self) -> list[tuple[str, list[str]]]:
        return list(self.calls)


class FakeHybridCheckpointManager:
    """verl's naive-backend CheckpointEngineManager for hybrid replicas, without GPUs."""

    def __init__(self, replicas: list[str]) -> None:
        self.replicas = list(replicas)
        self.calls: list[str] = []

    async def abort_replicas(self) -> None:
        self.calls.append("abort")

    async def sleep_replicas(self) -> None:
        self.calls.append("sleep")
        await asyncio.sleep(0.01)

    async def resume_generation_replicas(self) -> None:
        self.calls.append("resume")

    async def update_weights(self, global_steps: int) -> None:
        self.calls.append(f"update@{global_steps}")
        await asyncio.sleep(0.01)


@ray.remote(num_cpus=1)
class Trainer:
    """Stands where verl's FullyAsyncTrainer stands: builds the policy by name and runs steps."""

    def __init__(self, rollouter: ray.actor.ActorHandle, hybrid: int, standalone: int, policy: str) -> None:
        from verl.experimental.fully_async_policy.dynamic_schedule import (
            DynamicResourceController,
            DynamicScheduleContext,
            build_policy,
        )

        self.rollouter = rollouter
        self.hybrid, self.standalone = hybrid, standalone
        self.checkpoints = FakeHybridCheckpointManager(list(ray.get(rollouter.get_all_hybrid_replicas.remote())))
        built = build_policy(policy, deactivate_ratio=0.3, only_hybrid=standalone == 0)
        self.ctrl = DynamicResourceController(rollouter=rollouter, hybrid_checkpoint_manager=self.checkpoints,
                                              num_standalone_replicas=standalone, num_hybrid_replicas=hybrid,
                                              policy=built)
        self.ctx = DynamicScheduleContext(required_samples=REQUIRED_SAMPLES, trigger_parameter_sync_step=1,
                                          total_generated_samples=0, expected_samples=0, buffer_samples=0,
                                          only_hybrid=standalone == 0)
        self.version = 0

    def policy_class(self) -> str:
        p = self.ctrl.policy
        return f"{type(p).__module__}.{type(p).__name__}"

    async def step(self, phase: str, noise: float, unit_s: float) -> dict[str, object]:
        ctrl, ctx, policy = self.ctrl, self.ctx, self.ctrl.policy
        if policy.should_deactivate(global_steps=self.version, is_hybrid_active=ctrl.is_hybrid_active, ctx=ctx):
            threshold = policy.deactivate_wait_samples(ctx)
            ray.get(self.rollouter.wait_for_enough_samples.remote(threshold))
            started = time.time()
            await ctrl.deactivate_hybrid_replicas(self.version)
            ctx.last_deactivate_duration_s += time.time() - started
        active = ctrl.is_hybrid_active
        work, train = PHASES[phase]
        replicas = self.standalone + (self.hybrid if active else 0)
        rollout_s = work / max(replicas, 1) * noise
        train_s = train * (SHARED_TRAIN_SLOWDOWN if active else 1.0) / noise
        wait_s = max(rollout_s - train_s, 0.0)
        await asyncio.sleep(wait_s * unit_s)  # _fit_generate: the trainer waits for its samples
        self._step_wait_times = [wait_s * unit_s]
        await asyncio.sleep(train_s * unit_s)  # log-probs, advantages, the actor update
        produced = REQUIRED_SAMPLES if wait_s > 0 else int(REQUIRED_SAMPLES * train_s / rollout_s)
        ray.get(self.rollouter.generated.remote(produced))
        self.version += 1
        # _fit_update_weights, in verl's order
        total, completed = ray.get([self.rollouter.get_total_produced_samples.remote(),
                                    self.rollouter.get_completed_steps.remote()])
        ctx.total_generated_samples = total
        ctx.expected_samples = ctx.step_required_samples * completed
        ctx.step_wait_times = list(self._step_wait_times)
        ctx.step_wait_samples = [REQUIRED_SAMPLES if wait_s > 0 else 0]
        activate = policy.should_activate_after_step(global_steps=self.version, is_hybrid_active=ctrl.is_hybrid_active,
                                                     ctx=ctx)
        if activate:
            started = time.time()
            await ctrl.sync_hybrid_weights(global_steps=self.version)
            await ctrl.activate_hybrid_replicas(self.version)
            policy.request_rebalance(global_steps=self.version, ctx=ctx)
            ctx.last_activate_duration_s += time.time() - started
        policy.update_after_step(global_steps=self.version, ctx=ctx)
        ctx.last_activate_duration_s = ctx.last_deactivate_duration_s = 0.0
        return {"step": self.version, "phase": phase, "active": ctrl.is_hybrid_active,
                "rollout": round(rollout_s, 3), "train": round(train_s, 3), "activations": ctrl.activate_count,
                "deactivations": ctrl.deactivate_count, "alive": ray.get(self.rollouter.active_replicas.remote()),
                "at": time.time()}

    def checkpoint_calls(self) -> list[str]:
        return list(self.checkpoints.calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--hybrid", type=int, default=2)
    parser.add_argument("--standalone", type=int, default=1)
    parser.add_argument("--phases", default="", help="comma-separated phase per step (rollout/train)")
    parser.add_argument("--phase-file", type=Path,
                        help="read each step's phase (and a time scale) from this file; 'stop' ends the job")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--unit-s", type=float, default=0.05)
    parser.add_argument("--noise", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"worker_process_setup_hook": "dynaresized.integrations.verl.register",
                          "env_vars": {"DYNARESIZED_ENDPOINT": args.endpoint,
                                       "DYNARESIZED_VERL_HYBRID": str(args.hybrid),
                                       "DYNARESIZED_VERL_STANDALONE": str(args.standalone)}})
    try:
        rollouter = FakeRollouter.remote(args.hybrid)
        trainer = Trainer.remote(rollouter, args.hybrid, args.standalone, "dynaresized")
        print(json.dumps({"policy": ray.get(trainer.policy_class.remote())}), flush=True)
        phases = [p for p in args.phases.split(",") if p]
        for k in range(args.max_steps):
            unit_s = args.unit_s
            if args.phase_file is not None:  # "<phase> [time scale]", or "stop"
                phase, *scale = args.phase_file.read_text().split() or ["stop"]
                if phase == "stop":
                    break
                unit_s *= float(scale[0]) if scale else 1.0
            elif k < len(phases):
                phase = phases[k]
            else:
                break
            noise = 1.0 + rng.uniform(-args.noise, args.noise)
            print(json.dumps(ray.get(trainer.step.remote(phase, noise, unit_s))), flush=True)
        print(json.dumps({"rollouter": ray.get(rollouter.calls_made.remote()),
                          "checkpoints": ray.get(trainer.checkpoint_calls.remote())}), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
