"""`make example` ends with how the run compares with the static split it started on, or says
plainly why it cannot without another run (issue 45): the logic, without torch or vLLM."""

from __future__ import annotations

from examples.grpo_tiny.compare import static_comparison


def test_a_run_the_daemon_left_alone_is_its_own_static_run() -> None:
    line = static_comparison({"resizes": {"committed": 0}, "events": [], "loop_s": 41.25}, "2:1")
    assert line == ("against the static split 2:1: the same run (the daemon moved and lent nothing, so it ran on "
                    "2:1 throughout: 41.2s either way)")


def test_a_run_that_moved_or_lent_says_the_static_split_needs_its_own_run() -> None:
    for resizes, events in (({"committed": 1}, []), ({"committed": 0}, ["LoanStarted: loan l1 started ..."])):
        line = static_comparison({"resizes": resizes, "events": events, "loop_s": 41.25}, "2:1")
        assert line.startswith("against the static split 2:1: not measured; the daemon moved or lent devices")
        assert "add --compare-static" in line
