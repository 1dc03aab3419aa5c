"""Composes verl's Hydra config with the command-line overrides given as arguments and prints, as
one JSON object, what selects dynaresized and the `ray.init` runtime_env that
`verl.trainer.main_ppo.run_ppo` would build from them: the fully-async trainer's config
(`fully_async_ppo_trainer`: the policy name), or with `--v1` first, the V1 trainer's
(`ppo_trainer`: the trainer mode and the hybrid-rollout switch). Run by the verl environment's
python."""

from __future__ import annotations

import json
import os
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl.experimental.fully_async_policy as fully_async
import verl.trainer.main_ppo as main_ppo
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env


def main(overrides: list[str]) -> int:
    v1 = overrides[:1] == ["--v1"]
    if v1:
        overrides = overrides[1:]
    package, name = (main_ppo, "ppo_trainer") if v1 else (fully_async, "fully_async_ppo_trainer")
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(package.__file__), "config"),
                               version_base=None):
        config = compose(name, overrides=overrides)
    # The merge run_ppo does before ray.init.
    ray_init = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}))
    if v1:
        selects = {"trainer_mode": config.trainer.v1.trainer_mode,
                   "enable_switch": config.trainer.v1.separate_async.hybrid_rollout.enable_switch}
    else:
        selects = {"use_dynamic_resource_scheduling": config.async_training.use_dynamic_resource_scheduling,
                   "dynamic_schedule_policy": config.async_training.dynamic_schedule_policy}
    print(json.dumps({**selects, "runtime_env": kwargs["runtime_env"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
