"""`dynaresized conformance`: the project's own client passes every check, and a worker
that breaks one rule fails the check of that rule (and not the others)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from dynaresized import conformance
from dynaresized.protocol_doc import CONFORMANCE

WORKER = [sys.executable, str(Path(__file__).with_name("conformance_worker.py")), "{endpoint}"]
NAMES = [name for name, _ in CONFORMANCE]


def check(capsys, *options: str, worker: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    """Run the checker on a free loopback port against the test worker; (exit status, outcomes)."""
    argv = ["tcp://127.0.0.1:*", "--json", *options]
    if worker is not None:
        argv += ["--", *WORKER, *worker]
    status = conformance.main(argv)
    report = json.loads(capsys.readouterr().out)  # the worker's output goes to stderr
    return status, report


def outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["outcome"] for c in report["checks"]}


def test_every_documented_check_is_implemented_in_the_documented_order() -> None:
    checker = conformance.Checker(cast(conformance.Conversation, None), round_trip=False)
    assert list(checker.checks()) == NAMES


def test_the_projects_client_passes_every_check(capsys) -> None:
    status, report = check(capsys, "--round-trip", worker=[])
    got = outcomes(report)
    assert got == dict.fromkeys(NAMES, "passed"), report
    assert status == 0, report


@pytest.mark.slow
def test_the_sim_backend_passes_every_check(capsys) -> None:
    # a real backend: one process with an engine and a trainer worker (the checker talks to the
    # first to say hello and keeps the other registered)
    sim = [sys.executable, "-m", "dynaresized.backends.sim", "--endpoint", "{endpoint}", "--device", "node0:gpu3",
           "--speedup", "3600"]
    conformance.main(["tcp://127.0.0.1:*", "--json", "--round-trip", "--", *sim])
    report = json.loads(capsys.readouterr().out)
    got = outcomes(report)
    assert got["hello"] == "passed" and "engine-node0-gpu3" in report["checks"][0]["detail"], report
    assert got == dict.fromkeys(NAMES, "passed"), report


def test_the_client_takes_the_newest_of_two_welcomes_that_arrive_back_to_back(capsys) -> None:
    for _ in range(3):  # a race: the welcomes crossed were lost in most runs before the fix
        status, report = check(capsys, "--only", "welcomes-crossing", worker=[])
        assert outcomes(report)["welcomes-crossing"] == "passed", report


def test_a_released_trainer_passes_the_ops_the_round_trip_and_the_loan_into_its_pool(capsys) -> None:
    checks = ["op", "round-trip", "loan", "loan-return"]
    status, report = check(capsys, "--round-trip", *(a for name in checks for a in ("--only", name)),
                           worker=["--kind", "trainer-rank", "--released"])
    assert outcomes(report) == dict.fromkeys(["hello", *checks], "passed"), report
    detail = {c["name"]: c["detail"] for c in report["checks"]}
    assert detail["round-trip"] == "join -> serving, restore -> serving, evict -> released"
    assert detail["loan"] == "as the lent-to worker: join -> serving, state_report serving"
    assert detail["loan-return"] == ("as the lent-to worker: drain -> drained, release -> released, "
                                     "state_report released")
    assert status == 0


def test_the_return_lends_first_when_run_alone(capsys) -> None:
    status, report = check(capsys, "--round-trip", "--only", "loan-return", worker=[])
    assert outcomes(report) == {"hello": "passed", "loan-return": "passed"}, report
    assert report["checks"][1]["detail"] == "as the lent-from worker: join -> serving, state_report serving"


@pytest.mark.parametrize(("released", "fails", "then"), [
    (False, "loan-return", "passed"),  # the lent-from engine: its join is the return's
    (True, "loan", "skipped"),  # the lent-to trainer: its join is the loan's, and nothing is lent
])
def test_a_worker_that_stays_drained_after_a_loans_join_fails_the_loan_checks(capsys, released: bool, fails: str,
                                                                              then: str) -> None:
    worker = ["--break", "drained-after-join"] + (["--kind", "trainer-rank", "--released"] if released else [])
    status, report = check(capsys, "--round-trip", "--timeout", "5", "--only", "loan", "--only", "loan-return",
                           worker=worker)
    other = "loan" if fails == "loan-return" else "loan-return"
    assert outcomes(report) == {"hello": "passed", fails: "failed", other: then}, report
    detail = next(c["detail"] for c in report["checks"] if c["name"] == fails)
    plan = "loan" if fails == "loan" else "return"
    assert detail.startswith(f"after the {plan}'s join the worker reports holding drained; the protocol's {plan} "
                             "table says serving"), detail
    assert "reconciles it with a resume after every loan and return" in detail
    assert status == 1


@pytest.mark.parametrize(("broken", "checks", "fails"), [
    ("rerun", ["op", "op-resent"], "op-resent"),
    ("ignore-stale-token", ["heartbeat", "stale-token"], "stale-token"),
    ("old-token", ["new-boot-id", "op-resent-after-reregistration"], "op-resent-after-reregistration"),
])
def test_a_worker_that_breaks_a_rule_fails_its_check(capsys, broken: str, checks: list[str], fails: str) -> None:
    only = [arg for name in checks for arg in ("--only", name)]
    status, report = check(capsys, "--timeout", "5", *only, worker=["--break", broken])
    expected = {name: "failed" if name == fails else "passed" for name in ["hello", *checks]}
    assert outcomes(report) == expected, report
    assert status == 1 and not report["passed"]


def test_no_worker_fails_hello_and_skips_the_rest(capsys) -> None:
    status, report = check(capsys, "--hello-timeout", "0.3", "--only", "heartbeat")
    assert outcomes(report) == {"hello": "failed", "heartbeat": "skipped"}
    assert "no hello within 0.3s" in report["checks"][0]["detail"]
    assert status == 1


def test_an_unknown_check_is_refused(capsys) -> None:
    assert conformance.main(["tcp://127.0.0.1:*", "--only", "no-such-check"]) == 2
    assert "no check named no-such-check" in capsys.readouterr().err


def test_another_worker_on_the_endpoint_is_not_listened_to(capsys) -> None:
    with socket.socket() as probe:  # a free port, for a second worker started before the checker
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    other = subprocess.Popen([*(a.replace("{endpoint}", endpoint) for a in WORKER), "--worker-id", "other-0",
                              "--device", "node0:gpu1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        status = conformance.main([endpoint, "--json", "--only", "heartbeat", "--only", "op", "--only", "op-resent",
                                   "--", *WORKER])
    finally:
        other.kill()  # it may still wait for a welcome: nothing to close cleanly
        other.wait(timeout=10)
    report = json.loads(capsys.readouterr().out)
    assert outcomes(report) == dict.fromkeys(["hello", "heartbeat", "op", "op-resent"], "passed"), report
    assert status == 0


def test_an_endpoint_in_use_is_refused(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert conformance.main([f"tcp://127.0.0.1:{busy.getsockname()[1]}", "--timeout", "0.1"]) == 2
    assert "cannot bind" in capsys.readouterr().err
