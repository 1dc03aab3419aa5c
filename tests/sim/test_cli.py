"""`simulate` and `bench` as a user runs them."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys

import pytest

from dynaresized.sim.cli import ProgressBar, add_parsers, run_cli
from dynaresized.sim.profile import load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.workload import dump_trace, scenario_trace

REQUIRED = {"policy", "gpus", "steps", "total_time_s", "mean_step_s", "resizes", "best_static",
            "colocated_total_time_s", "lower_bound_s", "speedup_vs_best_static", "gap_to_lower_bound"}


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    code = run_cli(parser.parse_args(list(argv)), out=out)
    return code, out.getvalue()


def test_simulate_json_is_exactly_one_object_with_the_documented_fields():
    code, text = cli("simulate", "--scenario", "longtail-drift", "--profile", "qwen3-8b-h20x8",
                     "--policy", "hysteresis", "--steps", "30", "--json")
    assert code == 0
    lines = text.splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert REQUIRED <= set(report)
    assert set(report["best_static"]) == {"train", "rollout", "total_time_s", "tp"}
    assert set(report["best_static_tp1"]) == {"train", "rollout", "total_time_s", "tp"}
    assert report["steps"] == 30 and report["gpus"] == 8 and report["policy"] == "hysteresis"
    assert report["speedup_vs_best_static"] == pytest.approx(report["best_static"]["total_time_s"]
                                                             / report["total_time_s"], rel=1e-3)
    assert report["gap_to_lower_bound"] == pytest.approx(report["total_time_s"] / report["lower_bound_s"] - 1,
                                                         abs=1e-3)
    best = report["best_static"]["total_time_s"]
    tp1 = report["best_static_tp1"]["total_time_s"]  # the resizing headroom is over splits of TP-1 engines
    assert report["headroom_vs_best_static"] == pytest.approx(tp1 / report["best_split_per_step_tp1_total_time_s"], rel=1e-3)
    assert report["bound_vs_best_static"] == pytest.approx(best / report["lower_bound_s"], rel=1e-3)


def test_a_run_on_wider_engines_keeps_the_profiles_baselines():
    """`--tp` and `--initial-split` change the run's layout, not what it is compared with."""
    argv = ("simulate", "--scenario", "longtail-drift", "--steps", "20", "--json")
    _, plain_text = cli(*argv, "--layout", "profile")
    code, text = cli(*argv, "--tp", "2", "--initial-split", "4:4")
    assert code == 0
    plain, wide = json.loads(plain_text), json.loads(text)
    assert (plain["tp"], plain["initial_split"]) == (1, "6:2")
    assert (wide["tp"], wide["initial_split"]) == (2, "4:4")
    for key in ("best_static", "best_static_tp1", "best_split_per_step_tp1_total_time_s", "fluid_bound_s", "lower_bound_s"):
        assert wide[key] == plain[key], key
    assert wide["best_static_tp1"]["tp"] == 1
    assert wide["total_time_s"] != plain["total_time_s"]
    assert wide["speedup_vs_best_static"] == pytest.approx(wide["best_static"]["total_time_s"]
                                                           / wide["total_time_s"], rel=1e-3)


def test_simulate_summary_is_readable():
    code, text = cli("simulate", "--scenario", "noisy", "--policy", "greedy", "--steps", "12", "--gpus", "4",
                     "--layout", "profile")
    assert code == 0
    assert "resize r1" in text and "TP-1" in text
    report = json.loads(cli("simulate", "--scenario", "noisy", "--policy", "greedy", "--steps", "12", "--gpus", "4",
                            "--layout", "profile", "--json")[1])
    # every figure's label is its --json key, and every speedup printed is one of the report's
    speedups = dict(re.findall(r"(speedup_vs_\w+) ([\d.]+)x", text))
    assert len(speedups) >= 8
    for key, value in speedups.items():
        assert f"{report[key]:.3f}" == value, key
    for key in ("best_static", "best_static_tp1", "colocated", "best_split_per_step_tp1", "lower_bound_s",
                "fluid_bound_s", "headroom_vs_best_static", "bound_vs_best_static", "idle_ratio"):
        assert re.search(rf"^  {key}\b", text, re.M) or f" {key} " in text, key
    assert "oracle" not in text


def test_simulate_says_why_it_held(tmp_path):
    """A run where nothing moves says which guard or the policy's own reason held it."""
    argv = ("simulate", "--scenario", "noisy", "--steps", "12", "--initial-split", "4:4", "--tp", "4")
    code, text = cli(*argv)
    report = json.loads(cli(*argv, "--json")[1])
    assert code == 0 and report["resizes"] == 0
    assert "why it held: no resize" in text
    assert f"last_hold_reason: {report['last_hold_reason']}" in text and report["last_hold_reason"]
    assert report["rejections"] and set(report["rejection_reasons"]) == set(report["rejections"])
    for guard, reason in report["rejection_reasons"].items():
        assert f"rejections[{guard}]" in text and f"last: {reason}" in text


def test_simulate_a_users_trace_file(tmp_path):
    profile = load_profile("qwen3-8b-h20x8")
    path = tmp_path / "run.jsonl"
    dump_trace(scenario_trace("bimodal", scenario_shape(profile), steps=8), path)
    code, text = cli("simulate", "--trace", str(path), "--policy", "planner", "--json", "--guard", "cooldown_steps=2")
    assert code == 0
    report = json.loads(text)
    assert report["workload"] == "run" and report["steps"] == 8 and report["seed"] is None
    assert report["cooldown_steps"] == 2


def test_a_bad_trace_line_is_an_error_naming_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 0, "prompt_tokens": [1], "response_tokens": [5]}\n{"step": 1}\n')
    code, _ = cli("simulate", "--trace", str(path), "--json")
    assert code == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("simulate", "--scenario", "nope"), "unknown scenario"),
        (("simulate", "--scenario", "noisy", "--policy", "nope"), "unknown policy"),
        (("simulate", "--scenario", "noisy", "--policy", "hysterisis"), "; did you mean 'hysteresis'?"),
        (("simulate", "--scenario", "noisy", "--profile", "nope"), "no profile"),
        (("simulate", "--scenario", "noisy", "--steps", "0"), "--steps must be >= 1"),
        (("simulate", "--scenario", "noisy", "--guard", "cooldown_steps"), "KEY=VALUE"),
        (("simulate", "--scenario", "noisy", "--guard", "nope=1", "--steps", "2"), "bad guard setting"),
        (("simulate", "--scenario", "noisy", "--policy", "planner", "--policy-option", "nope=1", "--steps", "2"),
         "bad options for policy"),
        (("bench", "--policies", "static,nope"), "unknown policy"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--tp", "3"), "engines of 3 device(s) are not allowed"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--tp", "4", "--initial-split", "6:2"),
         "smaller than one engine of 4"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--initial-split", "9:2"), "must cover the cluster's 8"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--initial-split", "4-4"), "4-4"),
        (("simulate", "--scenario", "noisy", "--steps", "2", "--jobs", "0"), "--jobs must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    code, _ = cli(*argv)
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("policy", "layout"), [("hysteresis", "plan"), ("verl-default", "plan"),
                                               ("hysteresis", "profile")])
def test_verl_rules_in_processes_of_their_own_give_the_same_report(policy, layout):
    """--jobs 3: verl's rules run in forked processes beside the policy's run (a verl rule as
    the policy is run once, here), verl's rule from its own planned start too where that is not
    the run's; the report is the same, byte for byte."""
    argv = ("simulate", "--scenario", "noisy", "--steps", "12", "--gpus", "16", "--policy", policy,
            "--layout", layout, "--json")
    code, alone = cli(*argv, "--jobs", "1")
    assert code == 0
    assert cli(*argv, "--jobs", "3") == (0, alone)
    report = json.loads(alone)
    assert report["verl_dynamic_same_start_total_time_s"] > 0 and report["verl_dynamic_own_start_total_time_s"] > 0
    if layout == "profile":
        assert report["verl_dynamic_own_start"] != report["start"]


def test_samples_only_applies_to_scenarios(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "prompt_tokens": [1], "response_tokens": [5]}\n')
    assert cli("simulate", "--trace", str(path), "--samples", "8")[0] == 2
    assert "--samples" in capsys.readouterr().err


def test_bench_prints_one_row_per_scenario_and_policy():
    code, text = cli("bench", "--steps", "6", "--json", "--scenarios", "noisy,shrinking", "--policies",
                     "static,greedy")
    assert code == 0
    rows = [json.loads(line) for line in text.splitlines()]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("noisy", "static"), ("noisy", "greedy"), ("shrinking", "static"), ("shrinking", "greedy")]
    code, table = cli("bench", "--steps", "6", "--scenarios", "noisy", "--policies", "static")
    assert code == 0 and "noisy" in table and "gap LB" in table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    path = tmp_path / "run.png"
    code, _ = cli("simulate", "--scenario", "shrinking", "--steps", "25", "--policy", "greedy", "--plot", str(path))
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal():
    tty, pipe = FakeTty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar("simulate", stream=stream)
        for i in range(1, 6):
            bar(i, 5)
    assert "\rsimulate [" in tty.getvalue() and "5/5" in tty.getvalue()
    assert pipe.getvalue() == ""


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "dynaresized.sim", "simulate", "--scenario", "bimodal", "--steps", "5",
                           "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 5
    assert done.stderr == ""  # no progress bar when stderr is not a terminal
    # Another process, the same JSON bit for bit.
    assert done.stdout == cli("simulate", "--scenario", "bimodal", "--steps", "5", "--json")[1]


def test_the_dynaresized_command_runs_simulate(capsys):
    from dynaresized.cli import main as dynaresized_main

    assert dynaresized_main(["simulate", "--scenario", "bimodal", "--steps", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 4


def test_a_trace_longer_than_the_profiles_max_response_tokens_is_taken_with_a_warning(tmp_path, capsys):
    """Issue 45 item 5: 32,768-token responses against qwen3-8b-h20x8's 16,384 are not taken
    without a word (simulate and plan); a trace within the limit gets no warning."""
    path = tmp_path / "long.jsonl"
    path.write_text('{"step": 0, "prompt_tokens": [10, 10], "response_tokens": [32768, 500]}\n'
                    '{"step": 1, "prompt_tokens": [10, 10], "response_tokens": [400, 500]}\n')
    for command in ("simulate", "plan"):
        code, _ = cli(command, "--trace", str(path), "--json")
        err = capsys.readouterr().err
        assert code == 0
        assert "warning: long: 1 of 4 responses (1 of 2 steps) are longer than profile qwen3-8b-h20x8's " \
               "max_response_tokens = 16384 (the longest: 32768)" in err, command
    path.write_text('{"step": 0, "prompt_tokens": [10], "response_tokens": [16384]}\n')
    assert cli("simulate", "--trace", str(path), "--json")[0] == 0
    assert "warning" not in capsys.readouterr().err
