"""dynaresized: moves GPUs between the rollout and training stages of disaggregated RL
post-training at run time. See README.md; the layers, lowest first: domain, core, wire,
store, client, daemon, sim, cli."""

__version__ = "0.1.0"
