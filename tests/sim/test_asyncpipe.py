"""verl's fully-async pipeline in the simulator (issue 44, item 1): a staleness budget, partial
rollout and streaming mini-batches, with the per-sample ledger, verl's hybrid replicas and the
daemon's loans as the verl integration asks for them."""

from __future__ import annotations

import argparse
import io
import json
from importlib import resources

import msgspec
import pytest

from dynaresized.core.policy import load_policy
from dynaresized.domain import PipelineSpec, Split
from dynaresized.sim.asyncpipe import AsyncPipeline, async_fluid_bound
from dynaresized.sim.cli import add_parsers, run_cli
from dynaresized.sim.pipeline import static_total
from dynaresized.sim.profile import ProfileError, load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import lognormal_trace, scenario_trace

PROFILE = load_profile("qwen3-8b-h20x8")
VERL = PipelineSpec(mode="fully-async", staleness=0.5, partial_rollout=True, sync_every=4)


def model(scenario: str = "noisy", steps: int = 30, tp: int = 2) -> StageModel:
    return StageModel(PROFILE, scenario_trace(scenario, scenario_shape(PROFILE), seed=0, steps=steps)).at_tp(tp)


def run(spec: PipelineSpec, split: Split = Split(4, 4), m: StageModel | None = None, **kw) -> object:
    return AsyncPipeline(m if m is not None else model(), split, spec, **kw).run()


def assert_ledger_holds(r) -> None:
    ledger = r.ledger
    assert ledger.generated_once and ledger.trained_once and ledger.never_future_weights, ledger


@pytest.mark.parametrize("split", [Split(4, 4), Split(6, 2), Split(2, 6)])
def test_one_batch_of_staleness_without_partial_rollout_is_the_one_step_off_pipeline(split):
    """staleness 1, no partial rollout, one sync a step: the rollouter is one batch ahead and no
    response spans versions, as in the one-step-off windows; the totals agree to 1.5%."""
    m = model(tp=2)
    r = run(PipelineSpec(mode="fully-async", staleness=1.0), split, m)
    windows = static_total(m, split)
    assert abs(r.total_time_s / windows - 1.0) < 0.015, (r.total_time_s, windows)
    assert_ledger_holds(r)
    assert r.ledger.spanning_versions == 0 and r.ledger.resumed == 0
    assert r.ledger.max_staleness <= 1


def test_partial_rollout_carries_unfinished_responses_across_versions_and_loses_none():
    r = run(VERL, Split(6, 2))  # rollout-bound: requests run at every sync
    assert_ledger_holds(r)
    assert r.ledger.resumed > 0 and r.ledger.spanning_versions > 0
    assert r.ledger.samples == sum(model().samples)


def test_synchronous_training_never_trains_on_old_weights_and_is_slower():
    sync = run(PipelineSpec(mode="synchronous", staleness=0.0, sync_every=4), Split(4, 4))
    assert_ledger_holds(sync)
    assert sync.ledger.max_staleness == 0 and sync.ledger.spanning_versions == 0
    assert sync.total_time_s > run(VERL, Split(4, 4)).total_time_s


def test_the_fluid_bound_holds_for_every_split():
    m = model()
    bound = async_fluid_bound(m, 8, VERL)
    for t in (2, 4, 6):
        assert run(VERL, Split(t, 8 - t), m).total_time_s >= bound


def test_verls_rule_lends_its_trainers_as_hybrid_replicas_while_the_trainer_waits():
    """On a rollout-bound split verl's default rule activates hybrid replicas after a step and
    takes them back at its deactivate ratio; every sample is still generated and trained once."""
    r = run(VERL, Split(6, 2), loan_policy=load_policy("verl-default", {"deactivate_ratio": 0.6}))
    still = run(VERL, Split(6, 2))
    assert r.loans > 0 and r.hybrid_device_s > 0
    assert r.loan_reasons[0].startswith("verl-default:")
    assert_ledger_holds(r)
    assert r.total_time_s < still.total_time_s  # 6:2 starves the rollout: the hybrids help


def test_the_daemon_decides_activations_from_cycle_reports_and_verl_takes_the_replicas_back():
    """The daemon's policy (no take-back rule of its own) lends only where the saving it predicts
    from verl's cycle reports beats the cost by the core's margin; a margin no loan meets lends
    nothing, as standing still."""
    policy = load_policy("hysteresis")
    r = run(VERL, Split(6, 2), loan_policy=policy, loan_safety=1.5)
    assert r.loans > 0 and "to the rollout" in r.loan_reasons[0]
    assert_ledger_holds(r)
    never = run(VERL, Split(6, 2), loan_policy=load_policy("hysteresis"), loan_safety=1e9)
    assert never.loans == 0
    assert never.total_time_s == run(VERL, Split(6, 2)).total_time_s


def test_the_same_inputs_give_the_same_run():
    a = run(VERL, Split(6, 2), loan_policy=load_policy("verl-default"))
    b = run(VERL, Split(6, 2), loan_policy=load_policy("verl-default"))
    assert msgspec.json.encode(a) == msgspec.json.encode(b)


@pytest.mark.parametrize("fields, message", [
    ({"mode": "streaming"}, "unknown pipeline 'streaming'"),
    ({"mode": "fully-async", "staleness": -1.0}, "staleness must be a finite number >= 0"),
    ({"mode": "fully-async", "sync_every": 0}, "sync_every (trigger_parameter_sync_step) must be >= 1"),
    ({"mode": "synchronous", "staleness": 0.5}, "a synchronous pipeline has staleness 0"),
    ({"mode": "one-step-off", "partial_rollout": True}, "use --pipeline fully-async"),
])
def test_a_pipeline_that_cannot_be_is_refused_with_the_reason(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PipelineSpec(**fields)


def test_a_profile_says_its_pipeline_and_a_bad_one_is_a_clear_error(tmp_path):
    published = load_profile("qwen3.5-35b-a3b-h20x32").pipeline
    assert (published.mode, published.staleness, published.partial_rollout, published.sync_every) == (
        "fully-async", 0.5, True, 4)
    assert load_profile("qwen3-8b-h20x8").pipeline.windowed
    source = (resources.files("dynaresized.sim") / "profiles" / "qwen3-8b-h20x8.toml").read_text()
    path = tmp_path / "p.toml"
    path.write_text(source + '\n[pipeline]\nmode = "fully-async"\nstaleness = -2.0\n')
    with pytest.raises(ProfileError, match="staleness must be a finite number >= 0"):
        load_profile(path)


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    return run_cli(parser.parse_args(list(argv)), out=out), out.getvalue()


def test_simulate_in_verls_semantics_prints_ours_verls_rule_and_the_bound():
    code, text = cli("simulate", "--scenario", "noisy", "--steps", "12", "--pipeline", "fully-async",
                     "--staleness", "0.5", "--partial-rollout", "--sync-every", "4", "--pilot-steps", "4", "--json")
    assert code == 0 and len(text.splitlines()) == 1
    report = json.loads(text)
    assert (report["pipeline"], report["staleness"], report["partial_rollout"], report["sync_every"]) == (
        "fully-async", 0.5, True, 4)
    assert report["gap_to_fluid_bound"] == pytest.approx(report["total_time_s"] / report["fluid_bound_s"] - 1, abs=1e-3)
    assert report["speedup_vs_verl_dynamic"] == pytest.approx(
        report["verl_dynamic_total_time_s"] / report["total_time_s"], abs=1e-3)
    assert report["planned_start"] == report["start"] and report["resizes"] == 0
    assert set(report["best_static"]) == {"train", "rollout", "total_time_s", "tp"}  # as one-step-off's
    assert report["ledger"]["trained_once"] and report["verl_ledger"]["trained_once"]
    code, text = cli("simulate", "--scenario", "noisy", "--steps", "12", "--pipeline", "fully-async",
                     "--staleness", "0.5", "--partial-rollout", "--sync-every", "4", "--pilot-steps", "4")
    assert code == 0 and "speedup_vs_verl_dynamic" in text and "gap_to_fluid_bound" in text


def test_verls_knobs_without_its_pipeline_are_a_clear_error(capsys):
    assert cli("simulate", "--scenario", "noisy", "--steps", "4", "--staleness", "0.5")[0] == 2
    assert "add --pipeline fully-async" in capsys.readouterr().err
    assert cli("plan", "--scenario", "noisy", "--profile", "qwen3.5-35b-a3b-h20x32")[0] == 2
    assert "`plan` models the one-step-off pipeline" in capsys.readouterr().err


def test_the_published_setup_runs_in_verls_semantics_by_its_profile():
    profile = load_profile("qwen3.5-35b-a3b-h20x32")
    trace = lognormal_trace("verl-qwen35-dapo", scenario_shape(profile), median=6000, steps=6)
    m = StageModel(profile, trace)
    r = AsyncPipeline(m, Split(16, 16), profile.pipeline,
                      loan_policy=load_policy("verl-default", {"deactivate_ratio": 0.6})).run()
    assert_ledger_holds(r)
    assert r.loans > 0


def test_the_pipelines_benchmark_prints_one_json_object_with_its_keys(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "pipelines.py"
    spec = importlib.util.spec_from_file_location("pipelines", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert module.main(["--gpus", "8", "--scenarios", "noisy", "--steps", "8", "--jobs", "1"]) == 0
    out = msgspec.json.decode(capsys.readouterr().out)
    assert {"rows", "gap_to_fluid_bound_max", "speedup_vs_verl_dynamic_min", "ledger_ok"} <= set(out)
    assert out["ledger_ok"] and len(out["rows"]) == 1
