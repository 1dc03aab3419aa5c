"""Composes verl's fully-async Hydra config with the command-line overrides given as arguments
and prints, as one JSON object, the policy name and the `ray.init` runtime_env that
`verl.trainer.main_ppo.run_ppo` would build from them. Run by the verl environment's python."""

from __future__ import annotations

import json
import os
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl.experimental.fully_async_policy as fully_async
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env


def main(overrides: list[str]) -> int:
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(fully_async.__file__), "config"),
                               version_base=None):
        config = compose("fully_async_ppo_trainer", overrides=overrides)
    # The merge run_ppo does before ray.init.
    ray_init = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}))
    print(json.dumps({"use_dynamic_resource_scheduling": config.async_training.use_dynamic_resource_scheduling,
                      "dynamic_schedule_policy": config.async_training.dynamic_schedule_policy,
                      "runtime_env": kwargs["runtime_env"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
