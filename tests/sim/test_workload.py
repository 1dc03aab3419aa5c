"""Trace files (JSON Lines, line-numbered errors) and the built-in seeded scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from dynaresized.sim.workload import (
    SCENARIOS,
    StepBatch,
    Trace,
    Shape,
    TraceError,
    UnknownScenarioError,
    dump_trace,
    load_trace,
    scenario_trace,
)

SMALL = Shape(samples_per_step=256, samples_per_prompt=8, max_response_tokens=16384)


def write(tmp_path, text: str):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    return path


def test_trace_round_trips_through_jsonl(tmp_path):
    trace = scenario_trace("bimodal", SMALL, seed=3, steps=4)
    path = tmp_path / "t.jsonl"
    dump_trace(trace, path)
    back = load_trace(path)
    assert len(back) == 4
    for a, b in zip(trace, back, strict=True):
        assert a.step == b.step
        assert np.array_equal(a.prompt_tokens, b.prompt_tokens)
        assert np.array_equal(a.response_tokens, b.response_tokens)


def test_filtered_samples_round_trip_and_cost_rollout_but_no_training(tmp_path):
    """Dynamic sampling (DAPO): a step generates samples it then drops; they are marked
    `"trained": false`, cost the engines their decode time and the trainer nothing."""
    from dynaresized.sim.profile import load_profile
    from dynaresized.sim.stages import StageModel

    trace = scenario_trace("longtail-stationary", SMALL, seed=1, steps=2)
    first = trace.steps[0]
    keep = np.arange(first.samples) % 2 == 0
    filtered = Trace("f", (StepBatch(0, first.prompt_tokens, first.response_tokens, keep), trace.steps[1]))
    path = tmp_path / "f.jsonl"
    dump_trace(filtered, path)
    assert '"trained"' in path.read_text().splitlines()[0] and '"trained"' not in path.read_text().splitlines()[1]
    back = load_trace(path)
    assert np.array_equal(back.steps[0].trained, keep) and back.steps[1].trained is None
    profile = load_profile("qwen3-8b-h20x8")
    every, half = StageModel(profile, trace), StageModel(profile, back)
    assert half.rollout_seconds(0, 4) == every.rollout_seconds(0, 4)
    seq = (first.prompt_tokens + first.response_tokens).astype(float)
    expected = (seq * (1 + seq / profile.training.attention_tokens))[keep].sum()
    assert half.train_tokens[0] == pytest.approx(expected)
    assert half.train_seconds(0, 4) < every.train_seconds(0, 4)
    assert half.train_seconds(1, 4) == every.train_seconds(1, 4)


def test_unknown_fields_are_ignored(tmp_path):
    path = write(tmp_path, '{"step": 0, "prompt_tokens": [5, 6], "response_tokens": [7, 8], "reward": [1, 0]}\n')
    assert load_trace(path).steps[0].response_tokens.tolist() == [7, 8]


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": [2]}\n{"step": 1, "prompt_tokens": [1]\n',
         ":2:", "not valid JSON"),
        ('{"step": 0, "prompt_tokens": [1, 2], "response_tokens": [2]}\n', ":1:", "prompt_tokens has 2 entries"),
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": [2]}\n{"step": 2, "prompt_tokens": [1], '
         '"response_tokens": [2]}\n', ":2:", "step 1 is missing"),
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": [2]}\n\n{"step": 1, "prompt_tokens": [1], '
         '"response_tokens": [2]}\n', ":2:", "empty line"),
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": [0]}\n', ":1:", "at least one token"),
        ('{"step": 0, "prompt_tokens": [-1], "response_tokens": [3]}\n', ":1:", "negative"),
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": ["x"]}\n', ":1:", "Expected `int`"),
        ('{"step": 0, "prompt_tokens": [], "response_tokens": []}\n', ":1:", "no samples"),
        ('{"prompt_tokens": [1], "response_tokens": [3]}\n', ":1:", "missing required field `step`"),
        ("", "trace.jsonl", "empty"),
        ('{"step": 0, "prompt_tokens": [1, 2], "response_tokens": [2, 3], "trained": [true]}\n', ":1:",
         "trained has 1 entries but response_tokens has 2"),
        ('{"step": 0, "prompt_tokens": [1], "response_tokens": [2], "trained": [1]}\n', ":1:", "Expected `bool`"),
    ],
)
def test_malformed_lines_are_reported_with_their_line_number(tmp_path, text, where, what):
    with pytest.raises(TraceError) as err:
        load_trace(write(tmp_path, text))
    assert where in str(err.value)
    assert what in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_same_seed_same_trace_and_another_seed_another():
    a = scenario_trace("noisy", SMALL, seed=7, steps=3)
    b = scenario_trace("noisy", SMALL, seed=7, steps=3)
    c = scenario_trace("noisy", SMALL, seed=8, steps=3)
    assert all(np.array_equal(x.response_tokens, y.response_tokens) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a.steps[0].response_tokens, c.steps[0].response_tokens)


def test_unknown_scenario_names_the_built_ins():
    with pytest.raises(UnknownScenarioError, match="longtail-drift"):
        scenario_trace("nope", SMALL)


def medians(name: str, shape: Shape = SMALL, steps: int = 200) -> np.ndarray:
    return np.array([np.median(b.response_tokens) for b in scenario_trace(name, shape, seed=0, steps=steps)])


def test_longtail_stationary_has_p99_about_ten_times_the_median():
    wide = Shape(samples_per_step=4096, samples_per_prompt=8, max_response_tokens=10**6)
    lengths = np.concatenate([b.response_tokens for b in scenario_trace("longtail-stationary", wide, steps=5)])
    ratio = np.percentile(lengths, 99) / np.median(lengths)
    assert 8.0 < ratio < 12.5


def test_longtail_drift_median_grows_several_fold():
    m = medians("longtail-drift")
    assert m[-10:].mean() / m[:10].mean() > 4.0


def test_shrinking_median_falls():
    m = medians("shrinking")
    assert m[-10:].mean() / m[:10].mean() < 0.4


def test_bimodal_mixes_short_answers_and_long_reasoning():
    lengths = np.concatenate([b.response_tokens for b in scenario_trace("bimodal", SMALL, steps=20)])
    assert (lengths < 800).mean() > 0.3
    assert (lengths > 3000).mean() > 0.2
    assert ((lengths > 1200) & (lengths < 2500)).mean() < 0.1


def test_noisy_jumps_from_step_to_step_without_a_trend():
    m = medians("noisy")
    assert np.std(np.diff(np.log(m))) > 0.3  # heavy step-to-step noise
    assert 0.7 < m[-50:].mean() / m[:50].mean() < 1.4  # stationary on average


def test_verl_dapo_shape():
    shape = Shape(samples_per_step=8192, samples_per_prompt=16, max_response_tokens=28672)
    batch = scenario_trace("verl-dapo", shape, steps=1).steps[0]
    assert batch.samples == 8192
    assert batch.response_tokens.max() <= 28672
    assert np.all(batch.prompt_tokens.reshape(-1, 16) == batch.prompt_tokens.reshape(-1, 16)[:, :1])


def test_every_scenario_generates():
    for name in SCENARIOS:
        trace = scenario_trace(name, SMALL, steps=2)
        assert len(trace) == 2 and trace.name == name
