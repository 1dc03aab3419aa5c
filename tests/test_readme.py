"""The README says what a run prints and gives: its demo sample is a cut of a run with lines the
demo prints now, and its table of simulated results (and
docs/results.md's) is what the simulator gives now (`python -m tests.readme_results --write`
regenerates them)."""

from __future__ import annotations

import re

import pytest

from tests import readme_demo
from tests import readme_results as results

README = (results.ROOT / "README.md").read_text()

_DEVICES = r"gpu\d+(, gpu\d+)*"
_LENT = rf"  lent (to training {_DEVICES}(; to rollout {_DEVICES})?|to rollout {_DEVICES})"
# Every line `dynaresized demo` prints, as a pattern (tests/test_demo.py holds a real run to these).
DEMO_LINES = [
    r"dynaresized demo: \S+ on \S+ \(\d+ devices, start \d+:\d+\), policy \S+, \d+ steps at [\d.]+x",
    r"  daemon: tcp://\S+ \(control tcp://\S+\), event log \S+/events\.sqlite",
    r"  \d+ device processes started \(engine \+ trainer worker each\); training\.\.\.",
    r"",
    rf"step +\d+  T■* R□*( ~\d+)? +rollout +[\d.]+s  train +[\d.]+s  step +[\d.]+s({_LENT})?",
    r"  >> \S.*",
    r"  \.\. \S.*",
    r"done: \d+ steps, \d+ resize\(s\), final split \d+:\d+, \d+ loan\(s\) of idle devices inside steps "
    r"\(\d+ device-steps\)",
    r"  simulated time with \S+: +[\d.]+ h",
    r"  on the static split \d+:\d+: +[\d.]+ h  \(dynamic is [\d.]+x faster\)",
    r"  on the best static split \d+:\d+ \(chosen with hindsight, same \S+ router\): [\d.]+ h  \([\d.]+x\)",
    r"  on the best static configuration \d+:\d+/TP-\d+ \(split x engine size, hindsight\): [\d.]+ h  "
    r"\([\d.]+x(; below 1: the demo's engines are one device each, `dynaresized plan` says where to start)?\)",
    r"  idle (rollout |training) +([\d.]+%|unknown) of its device time \([\d.]+ of [\d.]+ device-hours; "
    r"\d+ steps accounted, \d+ unknown\)",
    r"  wall time [\d.]+s.*",
]


def unmatched_demo_lines(lines: list[str]) -> list[str]:
    return [x for x in lines if not any(re.fullmatch(p, x) for p in DEMO_LINES)]


def demo_sample() -> list[str]:
    return readme_demo.block_of(README)


def test_the_readme_demo_sample_is_a_cut_of_a_run_with_lines_the_demo_prints() -> None:
    """Cut by `python -m tests.readme_demo` (its first line and step, its first resize, its
    summary); tests/test_demo.py cuts a real run the same way."""
    sample = demo_sample()
    lines = [x for x in sample if x != readme_demo.GAP]
    assert unmatched_demo_lines(lines) == []
    assert readme_demo.excerpt(lines) == sample
    assert len(sample) <= 14  # short: the whole run is `make demo`


@pytest.mark.slow  # 18 simulator runs
def test_the_tables_of_simulated_results_are_what_the_simulator_gives() -> None:
    r = results.runs()
    for path, make in results.DOCS.items():
        assert results.block_of(path.read_text()) == make(r), \
            f"{path.name}'s table is stale: run `python -m tests.readme_results --write`"
