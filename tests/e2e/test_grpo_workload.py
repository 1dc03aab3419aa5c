"""The GRPO example's workloads without engines: the shifting workload's phases, the answer that
a sampling budget leaves unchanged, and the KL term's forward pass of the reference model."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the GRPO loss needs the torch extra")
pytest.importorskip("transformers", reason="the tiny Llama needs transformers")

from examples.grpo_tiny import task  # noqa: E402
from examples.grpo_tiny.job import TrainSample, grpo_loss  # noqa: E402

pytestmark = [pytest.mark.torch]


def test_the_shift_workload_is_training_heavy_then_rollout_heavy() -> None:
    w = task.workload("shift", 16)
    assert [w.phase(s) for s in (0, 7, 8, 15)] == [1, 1, 2, 2]
    assert w.kl_coef(7) > 0 and w.kl_coef(8) == 0  # the teacher's pass only in phase 1
    assert w.sampling_budget(7) is None and w.sampling_budget(8) == 32
    copy = task.workload("copy", 16)
    assert copy.kl_coef(3) == 0 and copy.sampling_budget(3) is None
    # the same prompts as before for the default workload: the draws did not change
    assert task.prompts_for_step(0, 3, 4, copy) == task.prompts_for_step(0, 3, 4, task.Curriculum(steps=16))
    with pytest.raises(ValueError, match="unknown workload 'long'; workloads: copy, shift"):
        task.workload("long", 16)


def test_a_sampling_budget_leaves_the_answer_unchanged() -> None:
    prompt = task.prompt_ids([1, 2, 3])  # room: 3 digits, </s> and one more = 5 = len(prompt)
    eos = 2
    budget_run = (5, 6, 7, eos, 9, 9, 9, 9, 9, 9)  # decoded past </s>
    assert task.answer_part(prompt, budget_run) == (5, 6, 7, eos)
    assert task.answer_part(prompt, (5, 6, 7, 8, 9, eos, 9)) == (5, 6, 7, 8, 9)  # no </s> in the room
    assert task.reward(prompt, task.answer_part(prompt, budget_run)) == task.reward(prompt, budget_run[:4])


def test_the_kl_term_runs_the_reference_and_vanishes_against_itself(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from dynaresized.backends.vllm.tiny_model import build_tiny_model

    policy = LlamaForCausalLM.from_pretrained(build_tiny_model(tmp_path / "p", task.SPEC))
    other = LlamaForCausalLM.from_pretrained(build_tiny_model(tmp_path / "t", task.TEACHER_SPEC))
    samples = [TrainSample(f"s{i}", task.prompt_ids([i, 1]), (4 + i, 5, 2), 4, 0.5, a, 0)
               for i, a in enumerate((1.0, -1.0, 0.5))]
    base = grpo_loss(policy, samples)
    assert torch.equal(grpo_loss(policy, samples, policy, 0.1), base)  # KL to itself is 0
    assert float(grpo_loss(policy, samples, other, 0.1).detach()) > float(base.detach())  # k3 >= 0, > 0 when they differ
    with pytest.raises(ValueError, match="needs the reference model"):
        grpo_loss(policy, samples, None, 0.1)
