"""A verl V1 separate-async job on CPU for tests/integrations/test_verl_v1.py, run by the verl
virtual environment's python (`.venv-verl/bin/python tests/integrations/verl_v1_job.py ...`).

Real: Ray (a local cluster) with the `worker_process_setup_hook` docs/verl.md gives; verl's
Hydra config composed with `trainer.v1.trainer_mode=dynaresized_separate_async`; verl's trainer
registry (`get_trainer_cls`) and the trainer's own `__init__`, inside an actor that stands where
verl's `TaskRunnerV1` stands; verl's `on_init_end`, `on_step_begin`, `step` / `prepare_step`
(its wait for sampleable groups), `on_sample_begin` / `on_sample_end`, `on_step_end`,
`switch_to_rollout` / `switch_to_trainer` and its load-balancer calls, called in the order
`PPOTrainer.fit` calls them. Faked, as in verl's own CPU tests, only what `_setup` builds on GPUs:

* the rollout servers behind verl's global load balancer (an actor with its `add_servers` /
  `remove_servers` / `clear_sticky_cache`): groups finish in real time at one rate per replica
  generating (standalone ones always, hybrid ones while in the balancer and awake), up to a
  staleness bound;
* the replay buffer over those groups (`get_sampleable_count`, `wait_for_sampleable`, `sample`);
* the hybrid checkpoint manager, which checks verl's precondition instead of recording calls:
  the hybrid replicas are asleep at `update_weights` and while the trainer trains;
* one local update (`_step_once`): it samples its mini-batch, then takes the time a phase gives it.

The queue, the checks, the command line and the step loop are verl_job.py's. Every step prints
one JSON line; the last line has the balancer's calls and the updates.
"""

from __future__ import annotations

import os
import sys
import time
import types

import ray
from verl_job import (  # the script's directory is on sys.path, and on the Ray workers' (start_ray)
    PHASES,
    REQUIRED_SAMPLES,
    CheckedHybridCheckpointManager,
    Rollouter,
    emit,
    job_arguments,
    phase_plan,
    start_ray,
)

TRAIN_BATCH = REQUIRED_SAMPLES  # groups per step (data.train_batch_size)
SYNC_STEPS = 2  # local updates per weight sync (trainer.v1.separate_async.parameter_sync_step)


@ray.remote(num_cpus=0)
class FakeGeneration(Rollouter):
    """The rollout servers behind verl's global load balancer, and the balancer's surface: the
    hybrid servers generate while in the balancer and awake."""

    def __init__(self, hybrid: list[str], standalone: int) -> None:
        super().__init__(0, standalone)
        self.addresses = set(hybrid)
        self.servers: set[str] = set()  # hybrid servers in the balancer
        self.awake = False  # the hybrid replicas (the checkpoint manager says)

    def hybrid_generating(self) -> int:
        return len(self.servers & self.addresses) if self.awake else 0

    def set_awake(self, awake: bool) -> None:
        self._advance()
        self.awake = awake

    def add_servers(self, servers: dict[str, object]) -> None:
        self._advance()
        self.calls.append(("add_servers", sorted(servers)))
        self.servers.update(servers)

    def remove_servers(self, addresses: list[str]) -> None:
        self._advance()
        self.calls.append(("remove_servers", sorted(addresses)))
        self.servers.difference_update(addresses)

    def clear_sticky_cache(self) -> dict[str, int]:
        self.calls.append(("clear_sticky_cache", []))
        return {"cleared_entries": 0}

    def sampleable(self) -> int:
        self._advance()
        return int(self.queue)


class CheckedV1CheckpointManager(CheckedHybridCheckpointManager):
    """The same checks, called as verl's V1 trainer calls its CheckpointEngineManager (its
    methods are awaited for the caller), and telling the generation whether the hybrid replicas
    generate."""

    def __init__(self, generation: ray.actor.ActorHandle) -> None:
        super().__init__([])
        self.generation = generation

    def _set(self, awake: bool) -> None:
        self.awake = awake
        ray.get(self.generation.set_awake.remote(awake))

    def abort_replicas(self, reject_request: bool = False) -> None:  # type: ignore[override]
        pass

    def sleep_replicas(self) -> None:  # type: ignore[override]
        self._set(False)
        self.sleeps += 1

    def resume_generation_replicas(self) -> None:  # type: ignore[override]
        self._set(True)

    def update_weights(self, global_steps: int | None = None) -> dict[str, float]:  # type: ignore[override]
        self.check_asleep(f"update_weights at step {global_steps}")
        self.updates.append(int(global_steps or 0))
        self._set(True)  # as verl's manager, which resumes generation after the sync
        return {}


class StandaloneCheckpointManager:
    def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        return {}


class FakeReplayBuffer:
    """verl's ReplayBufferAsync surface over the fake groups."""

    poll_interval = 0.05

    def __init__(self, generation: ray.actor.ActorHandle) -> None:
        self.generation = generation
        self.taken = 0

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        return ray.get(self.generation.sampleable.remote())

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> tuple[set[str], dict]:
        ray.get(self.generation.wait_for_enough_samples.remote(target_count))
        return set(), {}

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[object, dict]:
        from transfer_queue import KVBatchMeta

        got = ray.get(self.generation.collect.remote(batch_size))
        keys = [f"group-{self.taken + i}" for i in range(batch_size)]
        self.taken += batch_size
        return KVBatchMeta(keys=keys, tags=[{} for _ in keys], partition_id=partition_id), got


class Servers:
    """An LLMServerManager's surface verl's separate-async trainer reads."""

    def __init__(self, addresses: list[str], balancer: ray.actor.ActorHandle | None = None) -> None:
        self.server_addresses = list(addresses)
        self.server_handles = list(addresses)
        self.rollout_replicas = list(addresses)
        self.global_load_balancer = balancer

    def get_replicas(self) -> list[str]:
        return list(self.rollout_replicas)


def compose_config(overrides: list[str]):  # type: ignore[no-untyped-def]
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl.trainer.main_ppo as main_ppo

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"),
                               version_base=None):
        config = compose("ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)  # as TaskRunnerV1.run
    return config


@ray.remote(num_cpus=1)
class TaskRunner:
    """Stands where verl's TaskRunnerV1 stands: looks the trainer up by name and builds it."""

    def __init__(self, generation: ray.actor.ActorHandle, hybrid: int, standalone: int, total_steps: int) -> None:
        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        self.generation = generation
        config = compose_config([
            "trainer.v1.trainer_mode=dynaresized_separate_async",
            "trainer.v1.separate_async.hybrid_rollout.enable_switch=True",
            f"trainer.v1.separate_async.parameter_sync_step={SYNC_STEPS}",
            f"data.train_batch_size={TRAIN_BATCH}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={TRAIN_BATCH // SYNC_STEPS}",
            "trainer.nnodes=1", f"trainer.n_gpus_per_node={hybrid}",
            "actor_rollout_ref.rollout.nnodes=1", f"actor_rollout_ref.rollout.n_gpus_per_node={standalone}",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ])
        trainer_cls = get_trainer_cls(config.trainer.v1.trainer_mode)
        trainer = trainer_cls(config=config)
        self.mode = config.trainer.v1.trainer_mode
        self.trainer = trainer
        # what _setup builds on GPUs
        hybrid_addresses = [f"hybrid-{i}" for i in range(hybrid)]
        trainer.llm_server_manager = Servers(hybrid_addresses)
        trainer.standalone_server_manager = Servers([f"standalone-{j}" for j in range(standalone)], generation)
        self.checkpoints = CheckedV1CheckpointManager(generation)
        trainer.checkpoint_manager = self.checkpoints
        trainer.standalone_checkpoint_manager = StandaloneCheckpointManager()
        trainer.replay_buffer = FakeReplayBuffer(generation)
        trainer.total_training_steps = total_steps
        trainer.global_steps = 0
        trainer._add_prompts_to_generate = lambda n: n  # the fake servers need no prompts
        trainer._add_batch_to_generate = lambda: None
        trainer._step_once = types.MethodType(train_once, trainer)
        trainer.train_s, trainer.waits = 0.0, [0.0, 0.0]
        # _setup's end: PPOTrainer sleeps the hybrid replicas to load the checkpoint; the
        # separate-async trainer puts them in rollout mode, in the balancer. Then init() ends.
        self.checkpoints.sleep_replicas()
        trainer.current_mode = HybridEngineMode.ROLLOUT
        trainer.add_replicas_to_balancer()
        trainer.on_init_end()
        # fit()
        trainer.global_steps = 1
        trainer.prev_step_profile = False
        trainer.on_train_begin()
        self.activations = 0

    def describe(self) -> dict[str, str]:
        cls = type(self.trainer)
        return {"trainer": f"{cls.__module__}.{cls.__name__}", "trainer_mode": self.mode}

    def step(self, phase: str, noise: float, unit_s: float) -> dict[str, object]:
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        trainer = self.trainer
        per_group, train = PHASES[phase]
        ray.get(self.generation.set_pace.remote(per_group * noise * unit_s))
        trainer.train_s = train * unit_s / noise
        started = time.monotonic()
        metrics: dict = {}
        trainer.timing_raw = {}
        trainer.on_step_begin()
        trainer.step(metrics, trainer.timing_raw)
        trainer.on_step_end()
        metrics.update(trainer._consume_sync_metrics())
        lent = trainer.current_mode is HybridEngineMode.ROLLOUT
        self.activations += lent
        row = {"step": trainer.global_steps, "phase": phase, "lent": lent, "decider": trainer.decided_by,
               "by_dynaresized": metrics.get("separate_async/decision/by_dynaresized"),
               "verl_should_switch": metrics.get("separate_async/decision/should_switch_to_rollout"),
               "wait": round(trainer.waits[0], 4), "wait_alone": round(trainer.waits[1], 4),
               "switch_wait": round(trainer.timing_raw.get("switch_wait", 0.0), 4),
               "wall": round(time.monotonic() - started, 4), "activations": self.activations, "at": time.time()}
        trainer.global_steps += 1
        return row

    def summary(self) -> dict[str, object]:
        return {"updates": list(self.checkpoints.updates), "sleeps": self.checkpoints.sleeps,
                "balancer": ray.get(self.generation.calls_made.remote())}


def train_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int):  # type: ignore[no-untyped-def]
    """PPOTrainer._step_once without GPUs: sample one mini-batch, then train for the phase's time."""
    if self.local_trigger_step == 0:
        self.waits = [0.0, 0.0]
    self.on_sample_begin()
    batch, got = self.replay_buffer.sample(global_steps=self.global_steps, partition_id="train",
                                           batch_size=sample_batch_size)
    self.on_sample_end()
    self.waits = [self.waits[0] + got["wait"], self.waits[1] + got["wait_alone"]]
    checkpoints = self.checkpoint_manager
    checkpoints.check_asleep(f"training step {self.global_steps}")
    time.sleep(self.train_s / self.parameter_sync_step)  # log-probs, advantages, the actor update
    checkpoints.check_asleep(f"the end of training step {self.global_steps}")
    return batch


def main(argv: list[str] | None = None) -> int:
    args = job_arguments().parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    start_ray("dynaresized.integrations.verl.register_v1", args)
    try:
        generation = FakeGeneration.remote([f"hybrid-{i}" for i in range(args.hybrid)], args.standalone)
        runner = TaskRunner.remote(generation, args.hybrid, args.standalone, len(phases) or args.max_steps)
        emit(ray.get(runner.describe.remote()))
        for phase, noise, unit_s in phase_plan(args):
            emit(ray.get(runner.step.remote(phase, noise, unit_s)))
        emit(ray.get(runner.summary.remote()))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
