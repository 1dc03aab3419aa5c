"""`VirtualCluster`: the numbers the daemon's simulated backend uses are the simulator's."""

from __future__ import annotations

import pytest

from dynaresized.domain import OpKind, Pool
from dynaresized.sim.cluster import VirtualCluster
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import dump_trace, scenario_trace


def test_cluster_exposes_the_simulator_model():
    cluster = VirtualCluster.builtin("longtail-drift", "qwen3-8b-h20x8", seed=1, steps=5)
    profile = load_profile("qwen3-8b-h20x8")
    model = StageModel(profile, scenario_trace("longtail-drift", scenario_shape(profile), seed=1, steps=5))
    assert cluster.steps == 5
    assert cluster.devices == tuple(f"node0:gpu{i}" for i in range(8))
    assert cluster.initial_pools == (Pool.TRAINING,) * 6 + (Pool.ROLLOUT,) * 2
    assert cluster.rollout_seconds(3, 2) == model.rollout_seconds(3, 2)
    assert cluster.train_seconds(3, 6) == model.train_seconds(3, 6)
    assert cluster.weight_sync_seconds() == profile.sync.weight_sync_s
    assert cluster.op_seconds(OpKind.JOIN, Pool.TRAINING) == profile.resize.to_training.join_s
    assert cluster.op_seconds(OpKind.JOIN, Pool.TRAINING, naive=True) == profile.resize.naive.init_process_group_s
    timing = cluster.step_timing(3, rollout_devices=2, train_devices=6)
    assert (timing.rollout_s, timing.train_s) == (model.rollout_seconds(3, 2), model.train_seconds(3, 6))
    assert timing.samples == 1024 and timing.response_tokens > 0
    with pytest.raises(IndexError, match="outside the trace"):
        cluster.rollout_seconds(5, 2)


def test_cluster_from_a_trace_file(tmp_path):
    profile = load_profile("qwen3-8b-h20x8")
    path = tmp_path / "mine.jsonl"
    dump_trace(scenario_trace("bimodal", scenario_shape(profile), steps=3), path)
    cluster = VirtualCluster.builtin(str(path), "qwen3-8b-h20x8", gpus=4)
    assert cluster.steps == 3 and len(cluster.devices) == 4
    assert cluster.initial_pools.count(Pool.TRAINING) == 3
