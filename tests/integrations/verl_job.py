"""A verl fully-async job on CPU for the integration tests, run by the verl virtual environment's
python (`.venv-verl/bin/python tests/integrations/verl_job.py ...`).

Real: Ray (a local cluster), verl's `DynamicResourceController`, verl's policy registry and our
policy, registered by the Ray `worker_process_setup_hook` inside the trainer actor, which
drives policy and controller in the order verl's `FullyAsyncTrainer.fit_step` and
`_fit_update_weights` do. Faked, as in verl's own CPU tests, only what needs GPUs:

* the rollouter actor: verl's replica lists and `add_replicas` / `remove_replicas` /
  `rebalance_requests` / `wait_for_enough_samples`, over a queue that fills in real time at one
  rate per generating replica (standalone ones always, hybrid ones while active);
* the hybrid checkpoint manager, which checks verl's precondition instead of recording calls:
  the hybrid replicas are asleep at `update_weights` ("Rollout must be in sleep mode before this
  call", verl/workers/engine_workers.py) and while the trainer trains;
* training, which takes the time a phase gives it.

Every step prints one JSON line; the last line has the rollouter's calls and the violations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Per phase: one replica's seconds (in units) per sample, and training units per step.
PHASES = {"rollout": (1.5, 1.0), "train": (0.1, 2.0)}
REQUIRED_SAMPLES = 8
MAX_QUEUE = 2 * REQUIRED_SAMPLES  # verl's staleness bound on samples generated ahead


class Rollouter:
    """The GPU-bound rollouter's surface that verl's controller and trainer call (the actor is
    `FakeRollouter`; verl_v1_job.py's generation extends it)."""

    def __init__(self, hybrid: int, standalone: int) -> None:
        self.hybrid = {f"hybrid_{i}": f"replica-{i}" for i in range(hybrid)}
        self.standalone = [f"standalone-{j}" for j in range(standalone)]
        self.alive: set[str] = set()
        self.per_sample_s = 1.0
        self.queue = 0.0
        self.hybrid_made = 0.0  # samples the hybrid replicas generated since the last collection
        self.produced = 0.0
        self.completed = 0
        self.at = time.monotonic()
        self.calls: list[tuple[str, list[str]]] = []

    def _advance(self) -> None:
        now = time.monotonic()
        rate = 1.0 / self.per_sample_s
        room = max(MAX_QUEUE - self.queue, 0.0)
        standalone = min(len(self.standalone) * rate * (now - self.at), room)
        hybrid = min(self.hybrid_generating() * rate * (now - self.at), room - standalone)
        self.queue += standalone + hybrid
        self.produced += standalone + hybrid
        self.hybrid_made += hybrid
        self.at = now

    def hybrid_generating(self) -> int:
        return len(self.alive)

    def set_pace(self, per_sample_s: float) -> None:
        self._advance()
        self.per_sample_s = per_sample_s

    def get_all_hybrid_replicas(self) -> dict[str, str]:
        return dict(self.hybrid)

    def get_standalone_replicas(self) -> list[str]:
        return list(self.standalone)

    async def add_replicas(self, resource_ids: list[str]) -> int:
        self._advance()
        self.calls.append(("add_replicas", list(resource_ids)))
        new = [r for r in resource_ids if r in self.hybrid and r not in self.alive]  # verl skips active ones
        self.alive.update(new)
        return len(new)

    async def remove_replicas(self, resource_ids: list[str]) -> int:
        self._advance()
        self.calls.append(("remove_replicas", list(resource_ids)))
        gone = [r for r in resource_ids if r in self.alive]
        self.alive.difference_update(gone)
        return len(gone)

    async def rebalance_requests(self) -> dict[str, object]:
        self.calls.append(("rebalance_requests", sorted(self.alive)))
        return {"cleared_entries": 0, "server_loads": {}}

    async def wait_for_enough_samples(self, threshold: int) -> int:
        while True:
            self._advance()
            if self.queue >= threshold:
                return int(self.queue)
            await asyncio.sleep(0.005)

    async def collect(self, samples: int) -> dict[str, float]:
        """The trainer takes one collection: how long it waited, the samples it waited for, and
        how long it would have waited had no hybrid replica generated since the last one."""
        self._advance()
        queued, hybrid_made = self.queue, self.hybrid_made
        started = time.monotonic()
        while self.queue < samples:
            await asyncio.sleep(0.005)
            self._advance()
        wait = time.monotonic() - started
        standalone_rate = len(self.standalone) / self.per_sample_s
        alone = max(samples - (queued - hybrid_made), 0.0) / standalone_rate if standalone_rate else float("inf")
        self.queue -= samples
        self.hybrid_made = 0.0
        self.completed += 1
        return {"wait": wait, "wait_samples": max(samples - int(queued), 0), "wait_alone": alone}

    def get_total_produced_samples(self) -> int:
        self._advance()
        return int(self.produced)

    def get_completed_steps(self) -> int:
        return self.completed

    def active_replicas(self) -> int:
        return len(self.alive)

    def calls_made(self) -> list[tuple[str, list[str]]]:
        return list(self.calls)


FakeRollouter = ray.remote(num_cpus=0)(Rollouter)


class ContractViolation(AssertionError):
    pass


class CheckedHybridCheckpointManager:
    """verl's naive-backend CheckpointEngineManager for hybrid replicas, without GPUs: it checks
    the state verl documents for each call instead of recording calls."""

    def __init__(self, replicas: list[str]) -> None:
        self.replicas = list(replicas)
        self.awake = True  # verl's trainer puts them to sleep once at start (_setup_hybrid_checkpoint_manager)
        self.updates: list[int] = []
        self.sleeps = 0

    def check_asleep(self, what: str) -> None:
        if self.awake:
            raise ContractViolation(f"{what} with the hybrid replicas awake: verl puts them to sleep before "
                                    "every training step and weight update, to give training their GPU memory")

    async def abort_replicas(self) -> None:
        pass

    async def sleep_replicas(self) -> None:
        self.awake = False
        self.sleeps += 1

    async def resume_generation_replicas(self) -> None:
        self.awake = True

    async def update_weights(self, global_steps: int) -> None:
        # verl/workers/engine_workers.py: "Rollout must be in sleep mode before this call."
        self.check_asleep(f"update_weights at step {global_steps}")
        self.updates.append(global_steps)


@ray.remote(num_cpus=1)
class Trainer:
    """Stands where verl's FullyAsyncTrainer stands: builds the policy by name and runs steps."""

    def __init__(self, rollouter: ray.actor.ActorHandle, policy: str) -> None:
        from verl.experimental.fully_async_policy.dynamic_schedule import (
            DynamicResourceController,
            DynamicScheduleContext,
            build_policy,
        )

        self.rollouter = rollouter
        hybrid = ray.get(rollouter.get_all_hybrid_replicas.remote())
        standalone = ray.get(rollouter.get_standalone_replicas.remote())
        self.checkpoints = CheckedHybridCheckpointManager(list(hybrid.values()))
        only_hybrid = not standalone  # as FullyAsyncTrainer._setup_dynamic_resource_controller
        built = build_policy(policy, deactivate_ratio=0.3, only_hybrid=only_hybrid)
        self.ctrl = DynamicResourceController(rollouter=rollouter, hybrid_checkpoint_manager=self.checkpoints,
                                              num_standalone_replicas=len(standalone), num_hybrid_replicas=len(hybrid),
                                              policy=built)
        self.ctx = DynamicScheduleContext(required_samples=REQUIRED_SAMPLES, trigger_parameter_sync_step=1,
                                          total_generated_samples=0, expected_samples=0, buffer_samples=0,
                                          only_hybrid=only_hybrid)
        self.version = 0

    async def start(self) -> str:
        await self.checkpoints.sleep_replicas()  # _setup_hybrid_checkpoint_manager's initial sleep
        if self.ctx.only_hybrid:  # the hybrid replicas are the only rollout: the first version wakes them
            await self.ctrl.sync_hybrid_weights(global_steps=0)
            await self.ctrl.activate_hybrid_replicas(0)
        p = self.ctrl.policy
        return f"{type(p).__module__}.{type(p).__name__}"

    async def step(self, phase: str, noise: float, unit_s: float) -> dict[str, object]:
        ctrl, ctx, policy = self.ctrl, self.ctx, self.ctrl.policy
        per_sample, train = PHASES[phase]
        ray.get(self.rollouter.set_pace.remote(per_sample * noise * unit_s))
        started = time.monotonic()
        threshold = None  # the queued samples at which verl took the hybrid replicas back
        if policy.should_deactivate(global_steps=self.version, is_hybrid_active=ctrl.is_hybrid_active, ctx=ctx):
            threshold = policy.deactivate_wait_samples(ctx)
            ray.get(self.rollouter.wait_for_enough_samples.remote(threshold))
            t = time.time()
            await ctrl.deactivate_hybrid_replicas(self.version)
            ctx.last_deactivate_duration_s += time.time() - t
        got = ray.get(self.rollouter.collect.remote(REQUIRED_SAMPLES))  # _fit_generate
        self.checkpoints.check_asleep(f"training step {self.version + 1}")
        await asyncio.sleep(train * unit_s / noise)  # log-probs, advantages, the actor update
        self.checkpoints.check_asleep(f"the end of training step {self.version + 1}")
        self.version += 1
        # _fit_update_weights, in verl's order
        total, completed = ray.get([self.rollouter.get_total_produced_samples.remote(),
                                    self.rollouter.get_completed_steps.remote()])
        ctx.total_generated_samples = total
        ctx.expected_samples = ctx.step_required_samples * completed
        ctx.buffer_samples = ctx.step_required_samples
        ctx.step_wait_times = [got["wait"]]
        ctx.step_wait_samples = [got["wait_samples"]]
        activate = policy.should_activate_after_step(global_steps=self.version,
                                                     is_hybrid_active=ctrl.is_hybrid_active, ctx=ctx)
        if activate:
            t = time.time()
            await ctrl.sync_hybrid_weights(global_steps=self.version)
            await ctrl.activate_hybrid_replicas(self.version)
            policy.request_rebalance(global_steps=self.version, ctx=ctx)
            ctx.last_activate_duration_s += time.time() - t
        policy.update_after_step(global_steps=self.version, ctx=ctx)
        ctx.last_activate_duration_s = ctx.last_deactivate_duration_s = 0.0
        return {"step": self.version, "phase": phase, "active": ctrl.is_hybrid_active, "lent": bool(activate),
                "wait": round(got["wait"], 4), "wait_alone": round(got["wait_alone"], 4), "deactivated_at": threshold,
                "train": round(train * unit_s / noise, 4), "wall": round(time.monotonic() - started, 4),
                "activations": ctrl.activate_count, "deactivations": ctrl.deactivate_count,
                "decider": getattr(policy, "decided_by", ""), "at": time.time()}

    def summary(self) -> dict[str, object]:
        return {"updates": list(self.checkpoints.updates), "sleeps": self.checkpoints.sleeps}


def job_arguments() -> argparse.ArgumentParser:
    """The command line of a fake verl job (this one and verl_v1_job.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--hybrid", type=int, default=2)
    parser.add_argument("--standalone", type=int, default=1)
    parser.add_argument("--phases", default="", help="comma-separated phase per step (rollout/train)")
    parser.add_argument("--phase-file", type=Path,
                        help="read each step's phase (and a time scale) from this file; 'stop' ends the job")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--unit-s", type=float, default=0.2)
    parser.add_argument("--noise", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the Ray runtime_env")
    return parser


def start_ray(hook: str, args: argparse.Namespace) -> None:
    """A local Ray whose workers run `hook` at start, with the daemon's endpoint in their env.
    Their PYTHONPATH puts this checkout's dynaresized and these test modules first."""
    env_vars = {"DYNARESIZED_ENDPOINT": args.endpoint, "DYNARESIZED_VERL_DECISION_WAIT_S": "0.5",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH")) if p)}
    env_vars.update(kv.split("=", 1) for kv in args.env)
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s to register, too little on a loaded machine
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
                     runtime_env={"worker_process_setup_hook": hook, "env_vars": env_vars})
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            print(f"ray.init: {exc}; trying again", file=sys.stderr, flush=True)
            ray.shutdown()


def phase_plan(args: argparse.Namespace) -> Iterator[tuple[str, float, float]]:
    """Each step's (phase, noise, time unit): from --phases, or read from --phase-file before
    each step until it says 'stop'."""
    rng = random.Random(args.seed)
    phases = [p for p in args.phases.split(",") if p]
    for k in range(args.max_steps):
        unit_s = args.unit_s
        if args.phase_file is not None:  # "<phase> [time scale]", or "stop"
            phase, *scale = args.phase_file.read_text().split() or ["stop"]
            if phase == "stop":
                return
            unit_s *= float(scale[0]) if scale else 1.0
        elif k < len(phases):
            phase = phases[k]
        else:
            return
        yield phase, 1.0 + rng.uniform(-args.noise, args.noise), unit_s


def emit(row: dict) -> None:
    """One JSON line in one write: Ray's thread that forwards the workers' logs writes to the
    same file, and a line printed in two writes (`print`: the text, then the newline) could have
    a log line land between them, and the test would lose that step's line."""
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = job_arguments().parse_args(argv)
    start_ray("dynaresized.integrations.verl.register", args)
    try:
        rollouter = FakeRollouter.remote(args.hybrid, args.standalone)
        trainer = Trainer.remote(rollouter, "dynaresized")
        emit({"policy": ray.get(trainer.start.remote()), "required_samples": REQUIRED_SAMPLES})
        for phase, noise, unit_s in phase_plan(args):
            emit(ray.get(trainer.step.remote(phase, noise, unit_s)))
        emit({"rollouter": ray.get(rollouter.calls_made.remote()), **ray.get(trainer.summary.remote())})
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
