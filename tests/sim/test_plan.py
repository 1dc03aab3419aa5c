"""ReaL's plan search (issue 22, item 3): the configuration space, the three searches (exhaustive,
the exact branch and bound, MCMC), phases of alike response lengths, the per-phase plan checked
against the run simulated, where a dynamic run starts, and the `plan` / `simulate --layout plan`
commands."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynaresized.core import facts as f
from dynaresized.core import fold
from dynaresized.core.policy import load_policy
from dynaresized.domain import Split
from dynaresized.sim.pipeline import DynamicPipeline, best_static_config, static_total, static_windows
from dynaresized.sim.plan import Config, Replanner, extrapolate, phases, plan, plan_start, search, space
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import guards_for, scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import StepBatch, Trace, scenario_trace
from tests.sim.test_cli import cli

PROFILE = load_profile("qwen3-8b-h20x8")
BUILTIN = ("longtail-stationary", "longtail-drift", "shrinking", "bimodal", "noisy", "verl-dapo")


def pilot(name: str, *, profile=PROFILE, steps: int = 10, seed: int = 0) -> StageModel:
    return StageModel(profile, scenario_trace(name, scenario_shape(profile), seed=seed, steps=steps))


def step_change(before: int, after: int, *, switch: int, steps: int, samples: int = 64) -> Trace:
    """Every sample `before` tokens long until step `switch`, `after` from then on."""
    rng = np.random.default_rng(0)
    batches = []
    for s in range(steps):
        length = before if s < switch else after
        batches.append(StepBatch(s, np.full(samples, 256, dtype=np.int64),
                                 rng.integers(length // 2, length * 3 // 2, samples).astype(np.int64)))
    return Trace("step-change", tuple(batches))


def test_the_space_is_every_split_in_whole_engines_of_each_size():
    configs = space(pilot("noisy"), 8)
    # TP-1: 7 splits; TP-2: rollout 2, 4, 6; TP-4: rollout 4; TP-8 leaves no training device
    assert len(configs) == 11
    assert {c.tp for c in configs} == {1, 2, 4}
    assert all(c.rollout % c.tp == 0 and c.train >= 1 and c.train + c.rollout == 8 for c in configs)
    assert str(Config(4, 4, 2)) == "4:4/TP-2"


@pytest.mark.parametrize("name", BUILTIN)
def test_the_bound_finds_what_simulating_every_configuration_finds(name):
    model = pilot(name)
    every = search(model, 8, method="exhaustive")
    bound = search(model, 8, method="bound")
    assert every.simulated == every.space == 11
    assert bound.simulated < every.simulated
    assert (bound.best, bound.predicted_s) == (every.best, every.predicted_s)
    assert every.predicted_s == pytest.approx(static_total(model.at_tp(every.best.tp), every.best.split))
    assert every.predicted_s == min(t for t, _ in every.ranked)
    # and it is the hindsight search's best configuration on the same steps
    best, _ = best_static_config(model, 8)
    assert (every.best.split, every.best.tp) == (best.split, best.tp)


def test_mcmc_finds_the_exact_best_of_a_large_space_simulating_few():
    profile = PROFILE.with_gpus(128)
    model = pilot("bimodal", profile=profile)
    exact = search(model, 128, method="bound")
    chain = search(pilot("bimodal", profile=profile), 128, method="mcmc", seed=3)
    assert chain.space == exact.space == 127 + 63 + 31 + 15
    assert chain.simulated <= 64 < chain.space
    assert chain.best == exact.best
    assert chain.predicted_s == pytest.approx(exact.predicted_s)
    again = search(pilot("bimodal", profile=profile), 128, method="mcmc", seed=3)
    assert (again.best, again.simulated) == (chain.best, chain.simulated)  # seeded: deterministic


def test_the_default_method_depends_on_the_space():
    assert search(pilot("noisy"), 8).method == "exhaustive"
    assert search(pilot("noisy", profile=PROFILE.with_gpus(64)), 64).method == "bound"  # 63 + 31 + 15 + 7
    big = PROFILE.with_gpus(256).with_samples(256)
    assert search(pilot("noisy", profile=big, steps=2), 256).method == "mcmc"


def test_search_rejects_what_it_cannot_search():
    with pytest.raises(ValueError, match="unknown search method 'anneal'"):
        search(pilot("noisy"), 8, method="anneal")
    with pytest.raises(ValueError, match="no configuration of 1 devices"):
        search(pilot("noisy"), 1)


def test_phases_cut_where_the_lengths_change():
    assert phases(step_change(400, 400, switch=0, steps=40)) == [(0, 40)]
    assert phases(step_change(400, 2000, switch=20, steps=50)) == [(0, 20), (20, 50)]
    # a change inside a window opens the phase at that window
    assert phases(step_change(400, 2000, switch=25, steps=50), window=10) == [(0, 20), (20, 30), (30, 50)]
    with pytest.raises(ValueError, match="at least one step"):
        phases(step_change(400, 400, switch=0, steps=5), window=0)


def test_extrapolate_charges_the_fill_and_drain_only_at_the_run_s_ends():
    windows = np.array([5.0, 10.0, 12.0, 3.0])  # fill, two steady windows, drain
    assert extrapolate(windows, 6) == pytest.approx(5.0 + 11.0 * 5 + 3.0)
    assert extrapolate(windows, 6, first=False, last=False) == pytest.approx(11.0 * 6)
    assert extrapolate(windows, 6, first=False) == pytest.approx(11.0 * 6 + 3.0)


def test_a_plan_is_checked_against_the_run_it_plans():
    trace = scenario_trace("longtail-stationary", scenario_shape(PROFILE), seed=0, steps=60)
    p = plan(PROFILE, trace)
    assert [ph.start for ph in p.phases][0] == 0 and sum(ph.steps for ph in p.phases) == 60
    assert p.predicted_total_s == pytest.approx(sum(ph.predicted_s for ph in p.phases), abs=0.01)
    assert p.prediction_error == pytest.approx(p.predicted_total_s / p.simulated_total_s - 1, abs=1e-4)
    assert abs(p.prediction_error) < 0.05
    # one configuration throughout: the simulated total is that static run's, exactly
    assert p.changes == 0 and p.phases[0].config == "4:4/TP-4"
    model = StageModel(PROFILE, trace).at_tp(4)
    assert p.simulated_total_s == pytest.approx(static_total(model, Split(4, 4)), abs=0.01)


def test_a_plan_follows_a_change_of_workload():
    """Short responses then long ones: the rollout needs more devices after the change, and
    the plan's phases are spliced from each configuration's own windows."""
    trace = step_change(200, 3000, switch=30, steps=60, samples=256)
    p = plan(PROFILE, trace)
    assert [ph.start for ph in p.phases] == [0, 30]
    before, after = (Config(*map(int, ph.config.replace("/TP-", ":").split(":"))) for ph in p.phases)
    assert after.rollout > before.rollout and after.tp > before.tp  # 6:2/TP-2, then 4:4/TP-4
    model = StageModel(PROFILE, trace)
    w = {c: static_windows(model.at_tp(c.tp), c.split) for c in (before, after)}
    assert p.phases[0].simulated_s == pytest.approx(w[before][:30].sum(), abs=0.01)
    assert p.phases[1].simulated_s == pytest.approx(w[after][30:].sum(), abs=0.01)
    assert p.changes == 1 and Config.parse(p.phases[1].config) == after
    # the change is a regroup (TP-2 -> TP-4) and a resize (6:2 -> 4:4), charged in both totals
    r, c = PROFILE.resize.regroup, PROFILE.resize.to_rollout
    regroup_s = r.drain_s + r.release_s + r.join_s + r.restore_s + r.commit_s + r.first_step_s
    assert r.sequence_s() == pytest.approx(regroup_s)
    assert p.change_s == pytest.approx(regroup_s + c.commit_s + c.first_step_s)
    assert p.simulated_total_s == pytest.approx(sum(ph.simulated_s for ph in p.phases) + p.change_s, abs=0.01)


def test_plan_start_runs_the_policy_from_the_searchs_best_few_and_is_deterministic():
    trace = scenario_trace("noisy", scenario_shape(PROFILE), seed=0, steps=30)
    guards = guards_for(PROFILE)
    start, seconds = plan_start(PROFILE, trace, lambda: load_policy("hysteresis"), guards)
    top = search(StageModel(PROFILE, trace.head(10)), 8).ranked[:4]
    assert start in {c for _, c in top}
    assert seconds > 0
    assert plan_start(PROFILE, trace, lambda: load_policy("hysteresis"), guards) == (start, seconds)


def test_the_plan_command_prints_one_object_or_a_table():
    code, text = cli("plan", "--scenario", "bimodal", "--steps", "30", "--json")
    assert code == 0 and len(text.splitlines()) == 1
    p = json.loads(text)
    assert {"phases", "predicted_total_s", "simulated_total_s", "prediction_error", "search_s", "changes"} <= set(p)
    assert p["phases"][0]["method"] == "exhaustive" and p["gpus"] == 8
    code, text = cli("plan", "--scenario", "bimodal", "--steps", "30", "--method", "bound")
    assert code == 0 and "total" in text and "bound" in text and "TP-" in text


@pytest.mark.parametrize("extra", [(), ("--gpus", "16")])
def test_plan_prints_the_start_simulate_uses_beside_the_best_static_configuration(extra):
    """Issue 43 item 5: `plan` and `simulate` start from one configuration: plan names it
    (`start.planned_start`), with the fastest static configuration of the pilot and the
    predicted totals of both beside it."""
    argv = ("--scenario", "noisy", "--steps", "30", *extra, "--json")
    code, text = cli("plan", *argv)
    assert code == 0
    p = json.loads(text)
    start = p["start"]
    simulated = json.loads(cli("simulate", *argv)[1])
    assert start["planned_start"] == simulated["planned_start"] == simulated["start"]
    assert start["policy"] == simulated["policy"] == "hysteresis"
    assert start["best_static"] == p["phases"][0]["config"]  # the first phase is a pilot long or more
    assert start["planned_start"] in {c["config"] for c in start["candidates"]}
    chosen = next(c for c in start["candidates"] if c["config"] == start["planned_start"])
    assert chosen["dynamic_pilot_s"] == min(c["dynamic_pilot_s"] for c in start["candidates"])
    assert start["predicted_dynamic_total_s"] > start["planned_start_pilot_s"] > 0
    assert start["best_static_predicted_total_s"] > 0 and start["steps"] == 30
    # the prediction is the pilot's: within 15% of the run simulated whole (not a hindsight figure)
    assert start["predicted_dynamic_total_s"] == pytest.approx(simulated["total_time_s"], rel=0.15)
    code, table = cli("plan", *argv[:-1])
    assert code == 0
    assert "planned_start" in table and start["planned_start"] in table.splitlines()[1]
    assert "best_static_predicted_total_s" in table and "static plan of" in table


def test_plan_plans_the_start_of_the_policy_it_is_given():
    argv = ("--scenario", "noisy", "--steps", "12", "--policy", "verl-default", "--json")
    p = json.loads(cli("plan", *argv)[1])
    simulated = json.loads(cli("simulate", *argv)[1])
    assert p["start"]["policy"] == "verl-default"
    assert p["start"]["planned_start"] == simulated["planned_start"] == simulated["verl_dynamic_own_start"]


def test_simulate_from_the_planned_layout_keeps_the_profiles_baselines():
    argv = ("simulate", "--scenario", "noisy", "--steps", "20", "--json")
    _, plain_text = cli(*argv, "--layout", "profile")
    code, text = cli(*argv, "--layout", "plan")
    assert code == 0
    assert cli(*argv)[1] == text  # the plan's start is the default
    plain, planned = json.loads(plain_text), json.loads(text)
    assert (plain["layout"], plain["planned_start"]) == ("profile", "")
    assert planned["layout"] == "plan"
    assert planned["planned_start"] == f"{planned['initial_split']}/TP-{planned['tp']}"
    for key in ("best_static", "best_static_tp1", "best_split_per_step_tp1_total_time_s", "fluid_bound_s"):
        assert planned[key] == plain[key], key
    _, manual = cli(*argv, "--tp", "2", "--initial-split", "4:4")
    assert json.loads(manual)["layout"] == "manual"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("simulate", "--scenario", "noisy", "--steps", "2", "--layout", "plan", "--tp", "2"), "drop --tp"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--pilot-steps", "0"), "--pilot-steps must be >= 1"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--replan-every", "-1"), "--replan-every must be >= 0"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--replan-every", "5", "--naive"), "drop --naive"),
        (("plan", "--scenario", "nope"), "unknown scenario"),
        (("plan", "--scenario", "noisy", "--gpus", "1"), "at least 2 devices"),
        (("plan", "--scenario", "noisy", "--pilot-steps", "0"), "--pilot-steps must be >= 1"),
        (("plan", "--scenario", "noisy", "--steps", "2", "--policy", "nope"), "unknown policy"),
    ],
)
def test_bad_plan_input_is_a_clear_error(argv, message, capsys):
    code, _ = cli(*argv)
    assert code == 2
    assert message in capsys.readouterr().err


def _replanned(trace: Trace, start: Config, **options):
    profile = PROFILE.with_layout(start.tp, start.split)
    guards = guards_for(profile)
    replanner = Replanner(profile, trace, **options)
    model = StageModel(profile, trace)
    run = DynamicPipeline(model, load_policy("hysteresis"), guards=guards, layout=replanner).run()
    still = DynamicPipeline(StageModel(profile, trace), load_policy("hysteresis"), guards=guards).run()
    return run, still, replanner


def test_a_run_regroups_its_rollout_pool_when_the_re_plan_says_it_pays():
    """Short responses, then few long ones from step 30 (the tail decodes faster on wider
    engines): the search on the last 10 steps seen says TP-4 engines from step 39 on, where the
    run had TP-1 engines, and the run regroups its rollout pool into them through the
    core (a `regroup_started` and `regroup_committed` in its log, which replays to its state);
    the pool serves nothing for the regroup's ops and first step, and the run still ends sooner
    than the one that kept its TP-1 engines."""
    trace = step_change(200, 3000, switch=30, steps=60, samples=32)
    run, still, replanner = _replanned(trace, Config(4, 4, 1), every=10, margin=2.0)
    started = [x for x in run.facts if isinstance(x, f.RegroupStarted)]
    assert len(started) == 1 and started[0].source == "planner" and "re-planned on steps 30-39" in started[0].reason
    assert [len(g) for g in started[0].plan.engines] == [4] * (len(started[0].plan.devices) // 4)
    assert any(isinstance(x, f.RegroupCommitted) for x in run.facts)
    assert fold(run.facts).durable() == run.state.durable()
    assert [s for s, _, _ in replanner.searches] == [9, 19, 29, 39, 49]  # every 10 steps, none before the pilot
    window = next(w for w in run.windows if w.start_s >= started[0].at)
    assert window.rollout_s >= PROFILE.resize.regroup.ready_s()
    assert run.total_time_s < still.total_time_s / 1.2


def test_a_re_plan_confirmed_twice_waits_a_search_and_one_that_does_not_pay_is_no_regroup():
    trace = step_change(200, 3000, switch=30, steps=60, samples=32)
    run, _, _ = _replanned(trace, Config(4, 4, 1), every=10, confirm=2)
    [started] = [x for x in run.facts if isinstance(x, f.RegroupStarted)]
    assert "re-planned on steps 40-49" in started.reason
    # TP-2 engines where TP-4 would be a little faster: not by twice the regroup's cost
    trace = step_change(200, 3000, switch=30, steps=60, samples=256)
    run, still, replanner = _replanned(trace, Config(6, 2, 2))
    assert replanner.searches[3][1] == "4:4/TP-4"
    # no regroup of the planner's: the core learns the job's TP-2 engines before its first step,
    # and those that resizes start on devices brought to the rollout, at no cost
    regroups = [x for x in run.facts if isinstance(x, f.RegroupStarted)]
    assert {x.source for x in regroups} == {"profile"}
    assert regroups[0].at == 0.0 and [len(g) for g in regroups[0].plan.engines] == [2]
    assert all(len(g) == 2 for x in regroups for g in x.plan.engines)
    assert run.total_time_s == still.total_time_s


def test_regroups_are_simulated_pipelined_only():
    with pytest.raises(ValueError, match="pipelined only"):
        DynamicPipeline(pilot("noisy"), load_policy("hysteresis"), guards=guards_for(PROFILE), naive=True,
                        layout=lambda step, tp: None)


def test_simulate_re_plans_on_request_and_counts_its_regroups():
    """`simulate --layout plan --replan-every 10` on bimodal (long and short phases): the run
    starts on the planned TP-4 engines and regroups when two searches in a row say so; without
    `--replan-every` it never regroups after its start."""
    argv = ("simulate", "--scenario", "bimodal", "--layout", "plan", "--json")
    _, text = cli(*argv, "--replan-every", "10")
    replanned = json.loads(text)
    _, text = cli(*argv)
    kept = json.loads(text)
    assert replanned["planned_start"] == kept["planned_start"] and kept["regroups"] == 0
    assert replanned["regroups"] >= 1 and replanned["total_time_s"] != kept["total_time_s"]
