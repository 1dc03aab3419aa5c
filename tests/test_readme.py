"""The README says what a run prints and gives: its demo sample is a cut of a run with lines the
demo prints now, and its table of simulated results (and
docs/results.md's) is what the simulator gives now (`python -m tests.readme_results --write`
regenerates them)."""

from __future__ import annotations

import os
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
    rf"step +\d+  T■* R□*( ~\d+)? +rollout +[\d.]+s  train +[\d.]+s  window +[\d.]+s({_LENT})?",
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
    r"  predictions (resizes|loans) \d+ checked, mean abs error [\d.]+s \(\d+% of what was measured\)"
    r"(; loans \d+ checked, mean abs error [\d.]+s \(\d+% of what was measured\))?",
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


@pytest.mark.slow  # 39 simulator runs
def test_the_tables_of_simulated_results_are_what_the_simulator_gives() -> None:
    r = results.runs(jobs=max(min(os.cpu_count() or 1, 4), 1))  # each run its own process
    for path, blocks in results.DOCS.items():
        for name, make in blocks.items():
            assert results.block_of(path.read_text(), name) == make(r), \
                f"{path.name}'s table {name or 'main'} is stale: run `make results`"


def test_the_generator_replaces_each_block_and_refuses_a_missing_one() -> None:
    text = "a\n" + "\n".join(results.marker("")) + "\nb\n" + "\nold\n".join(results.marker("scale")) + "\nc\n"
    text = results.replace_block(results.replace_block(text, "T1"), "T2", "scale")
    assert results.block_of(text) == "T1" and results.block_of(text, "scale") == "T2"
    assert text.startswith("a\n") and text.endswith("\nc\n") and "old" not in text
    with pytest.raises(ValueError, match="no block"):
        results.replace_block(text, "T3", "targets")
