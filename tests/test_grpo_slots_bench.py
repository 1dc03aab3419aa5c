"""`benchmarks/grpo_slots.py`'s bookkeeping of repeated runs (issue 43, item 6): per repeat, verl's
run over the policy run of the same repeat; the median and every run. The runs themselves are
real engines (minutes each): `python benchmarks/grpo_slots.py --repeat N`."""

from __future__ import annotations

import statistics

import pytest

from tests.benchmark_module import load

pytest.importorskip("torch")  # the benchmark imports the example, which imports torch
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def bench():
    return load("grpo_slots")


def test_speedups_are_paired_per_repeat_with_the_median_and_every_run(bench):
    policy = [{"loop_s": 10.0}, {"loop_s": 20.0}, {"loop_s": 12.0}]
    verl = [{"loop_s": 11.0}, {"loop_s": 18.0}, {"loop_s": 15.0}]
    out = bench.paired("verl_dynamic", verl, policy)
    assert out["speedup_vs_verl_dynamic_runs"] == [1.1, 0.9, 1.25]
    assert out["speedup_vs_verl_dynamic_median"] == statistics.median([1.1, 0.9, 1.25]) == 1.1
    with pytest.raises(ValueError):
        bench.paired("verl_dynamic", verl[:2], policy)  # a repeat without its pair


def test_the_policy_runs_of_a_result_old_and_new(bench):
    runs = [{"name": n} for n in ("policy-1", "verl-default-1", "verl-default-seeded-1", "policy-2", "static-2",
                                  "policy-10")]
    assert bench.policy_runs({"runs": runs}) == ["policy-1", "policy-2", "policy-10"]
    assert bench.policy_runs({"runs": [{"name": "policy"}, {"name": "static-1"}]}) == ["policy"]


def test_a_fit_without_a_phase_says_to_run_more_steps(bench):
    detail = [{"step": k, "rollout_s": 1.0, "train_s": 1.0 if k == 2 else 0.0, "rollout": 1, "train": 2,
               "prompt_tokens": [4, 4], "response_tokens": [3, 5]} for k in range(4)]
    with pytest.raises(ValueError, match=r"phase\(s\) \[2\].*too few --steps"):
        bench.fit([{"_detail": detail}], lambda step: 1 if step < 2 else 2)
