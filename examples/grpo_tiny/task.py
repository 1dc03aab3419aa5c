"""The toy task, its programmatic reward, the tiny policy and its supervised warm start.

Task: copy a digit string. The prompt is `<s> d1 .. dn SEP`; the right answer is `d1 .. dn </s>`.
The reward checks the answer position by position (partial credit): matching digits divided
by max(n, digits produced), so both wrong digits and extra or missing ones cost. Nothing
about the reward is learned or estimated: it is a pure function of the prompt and response.

The policy is the vLLM backend's tiny Llama (`build_tiny_model`) with a 32-token vocabulary.
Its warm start is a short supervised phase on a *different* distribution: copies of strings
of 1 to `sft_max_len` digits only. RL then trains on longer strings (a curriculum that grows
their length over the run), which the warm start does not solve: the reward on them improves
only through RL.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from dynaresized.backends.vllm.tiny_model import BOS_ID, EOS_ID, PAD_ID, TinyModelSpec

DIGIT0 = 4  # token id of digit 0; digits are 4..13
SEP = 14
VOCAB = 32
SPEC = TinyModelSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                     initializer_range=0.02, seed=0)
# The teacher of the `shift` workload's first phase: the same vocabulary, about 20x the policy's
# parameters, warm-started on the task itself (copies of 1-6 digits), so that the KL term pulls
# the policy toward a model that can copy, and its forward pass is the expensive part of training.
TEACHER_SPEC = TinyModelSpec(vocab_size=VOCAB, hidden_size=192, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                             initializer_range=0.02, seed=1)


class Curriculum(msgspec.Struct, frozen=True):
    """String lengths over the run: step s draws n uniformly from [min_len, max_len(s)], where
    max_len grows linearly from `start_max` to `end_max`. Responses get longer as it goes."""

    min_len: int = 2
    start_max: int = 4
    end_max: int = 6
    steps: int = 30

    def max_len(self, step: int) -> int:
        frac = min(step / max(self.steps - 1, 1), 1.0)
        return round(self.start_max + frac * (self.end_max - self.start_max))


    def length_range(self, step: int) -> tuple[int, int]:
        return self.min_len, self.max_len(step)

    def kl_coef(self, step: int) -> float:  # noqa: ARG002 - the same loss at every step
        return 0.0

    def sampling_budget(self, step: int) -> int | None:  # noqa: ARG002 - answers end at </s>
        return None


class ShiftingWorkload(msgspec.Struct, frozen=True):
    """A workload whose best split changes halfway (`--workload shift`).

    Phase 1 (steps before `switch_step`): GRPO plus on-policy distillation, a KL penalty toward
    a larger teacher (`TEACHER_SPEC`), so every training micro-batch also runs the teacher's
    forward pass: training is the heavy stage. Phase 2: GRPO alone, and every sample is decoded
    to a fixed budget of `second_budget` tokens (vLLM's ignore_eos, as a long reasoning answer
    would): rollout does several times more engine iterations per step, while training, which
    reads each answer only up to its first </s> (what the reward reads too), stays light, so
    rollout becomes the heavy stage. String lengths stay those of the held-out set (2-6)."""

    steps: int = 30
    lengths: tuple[int, int] = (2, 6)
    first_kl: float = 0.1
    second_budget: int = 32
    switch_fraction: float = 0.5

    @property
    def switch_step(self) -> int:
        return round(self.steps * self.switch_fraction)

    def phase(self, step: int) -> int:
        return 1 if step < self.switch_step else 2

    def length_range(self, step: int) -> tuple[int, int]:  # noqa: ARG002 - the same in both phases
        return self.lengths

    def max_len(self, step: int) -> int:
        return self.length_range(step)[1]

    def kl_coef(self, step: int) -> float:
        return self.first_kl if self.phase(step) == 1 else 0.0

    def sampling_budget(self, step: int) -> int | None:
        """Tokens every sample of `step` decodes regardless of </s> (None: up to </s>)."""
        return self.second_budget if self.phase(step) == 2 else None


WORKLOADS = ("copy", "shift")


def workload(name: str, steps: int) -> Curriculum | ShiftingWorkload:
    """The curriculum `--workload NAME` runs: `copy` (the default: lengths grow slowly, the same
    loss throughout) or `shift` (`ShiftingWorkload`: training-heavy, then rollout-heavy)."""
    if name == "copy":
        return Curriculum(steps=steps)
    if name == "shift":
        return ShiftingWorkload(steps=steps)
    raise ValueError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")


def digits_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10) for _ in range(n)]


def prompt_ids(digits: list[int]) -> tuple[int, ...]:
    return (BOS_ID, *(DIGIT0 + d for d in digits), SEP)


def digits_from_prompt(prompt: tuple[int, ...] | list[int]) -> list[int]:
    if len(prompt) < 3 or prompt[0] != BOS_ID or prompt[-1] != SEP:
        raise ValueError(f"not a task prompt: {list(prompt)}")
    return [t - DIGIT0 for t in prompt[1:-1]]


def reward(prompt: tuple[int, ...] | list[int], response: tuple[int, ...] | list[int]) -> float:
    """Partial credit: digits in the right place / max(n, digits produced before </s>)."""
    target = digits_from_prompt(prompt)
    out = list(response)
    if EOS_ID in out:
        out = out[: out.index(EOS_ID)]
    produced = [t - DIGIT0 if DIGIT0 <= t < DIGIT0 + 10 else -1 for t in out]
    hits = sum(1 for a, b in zip(produced, target, strict=False) if a == b)
    return hits / max(len(target), len(produced))


def prompts_for_step(seed: int, step: int, count: int,
                     curriculum: Curriculum | ShiftingWorkload) -> list[tuple[int, ...]]:
    rng = random.Random(seed * 1_000_003 + step)
    low, top = curriculum.length_range(step)
    return [prompt_ids(digits_of(rng, rng.randint(low, top))) for _ in range(count)]


def eval_prompts(seed: int, count: int, min_len: int, max_len: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed + 7_777)
    return [prompt_ids(digits_of(rng, rng.randint(min_len, max_len))) for _ in range(count)]


def answer_part(prompt: tuple[int, ...], response: tuple[int, ...]) -> tuple[int, ...]:
    """What the reward reads and training trains: the response up to and including its first
    </s>, and at most the answer's room (n digits, </s> and one more: `len(prompt)` tokens, the
    `max_tokens` of a request without a sampling budget). With a budget the engine decodes
    further; the answer is the same tokens a request without one would have returned."""
    room = response[: len(prompt)]
    return room[: room.index(EOS_ID) + 1] if EOS_ID in room else room


def build_policy(directory: str | Path, *, sft_steps: int = 300, sft_max_len: int = 3, seed: int = 0,
                 spec: TinyModelSpec = SPEC, lr: float = 3e-3) -> Path:
    """Build the tiny Llama in `directory`, warm-start it on short copies, save it there."""
    import torch
    from transformers import LlamaForCausalLM

    from dynaresized.backends.vllm.tiny_model import build_tiny_model

    out = build_tiny_model(directory, spec)
    if sft_steps <= 0:
        return out
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(sft_steps):
            rows = []
            for _ in range(32):
                d = digits_of(rng, rng.randint(1, sft_max_len))
                rows.append(list(prompt_ids(d)) + [DIGIT0 + x for x in d] + [EOS_ID])
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])
            mask = (ids != PAD_ID).long()
            labels = ids.clone()
            for i, r in enumerate(rows):  # learn only the answer: prompt and padding are masked
                n = (len(r) - 3) // 2
                labels[i, : n + 2] = -100
                labels[i, len(r):] = -100
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    return out
