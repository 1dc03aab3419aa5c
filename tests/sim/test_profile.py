"""Cluster profiles: TOML decoded strictly, built-ins shipped as package data."""

from __future__ import annotations

from importlib import resources

import pytest

from dynaresized.domain import OpKind, Pool, Split
from dynaresized.sim.profile import ProfileError, builtin_profiles, load_profile

BUILTIN = "qwen3-8b-h20x8"


def builtin_text() -> str:
    return (resources.files("dynaresized.sim") / "profiles" / f"{BUILTIN}.toml").read_text()


def test_builtins_are_shipped_and_valid():
    assert {"qwen3-8b-h20x8", "qwen2.5-7b-h20"} <= set(builtin_profiles())
    p = load_profile(BUILTIN)
    assert p.cluster.gpus == 8
    assert p.initial_split == Split(train=6, rollout=2)
    assert load_profile("qwen2.5-7b-h20").workload.max_response_tokens == 28672


def test_profile_file_with_a_typo_is_rejected_naming_the_key(tmp_path):
    text = builtin_text()
    path = tmp_path / "p.toml"
    path.write_text(text.replace("max_num_seqs", "max_num_seq"))
    with pytest.raises(ProfileError, match="max_num_seq"):
        load_profile(path)


def test_missing_profile_lists_the_built_ins(tmp_path):
    with pytest.raises(ProfileError, match="qwen3-8b-h20x8"):
        load_profile(tmp_path / "absent.toml")


def test_bad_values_are_rejected(tmp_path):
    text = builtin_text()
    path = tmp_path / "p.toml"
    path.write_text(text.replace("initial_train = 6", "initial_train = 8"))
    with pytest.raises(ProfileError, match="initial_train"):
        load_profile(path)
    path.write_text(text.replace("gpus_per_node = 8", 'gpus_per_node = 8\ncandidates = ["6:2", "3:4"]'))
    with pytest.raises(ProfileError, match="3:4"):
        load_profile(path)
    path.write_text(text + "\n[resize.tail]\nswitch_s = -2.0\n")
    with pytest.raises(ProfileError, match="resize.tail.switch_s and back_s must be >= 0"):
        load_profile(path)
    path.write_text(text + "\n[resize.tail]\nswitch_s = 0.5\nkv_moved = false\n")
    tail = load_profile(path).resize.tail
    assert (tail.switch_s, tail.back_s, tail.kv_moved) == (0.5, 1.0, False)


def test_with_gpus_keeps_the_training_share():
    p = load_profile(BUILTIN).with_gpus(16)
    assert p.cluster.gpus == 16 and p.initial_split == Split(train=12, rollout=4)
    with pytest.raises(ProfileError):
        load_profile(BUILTIN).with_gpus(1)


def test_op_seconds_pipelined_and_naive():
    p = load_profile(BUILTIN)
    assert p.op_seconds(OpKind.JOIN, Pool.TRAINING) == p.resize.to_training.join_s
    assert p.op_seconds(OpKind.JOIN, Pool.ROLLOUT) == p.resize.to_rollout.join_s
    assert p.op_seconds(OpKind.EVICT, Pool.TRAINING) == p.resize.to_training.join_s  # undo costs its op
    assert p.op_seconds(OpKind.JOIN, Pool.TRAINING, naive=True) == p.resize.naive.init_process_group_s
    pipelined = sum(p.op_seconds(k, Pool.TRAINING) for k in (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN))
    naive = sum(p.op_seconds(k, Pool.TRAINING, naive=True) for k in (OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN))
    assert naive > pipelined
