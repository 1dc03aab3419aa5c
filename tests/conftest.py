"""Suite-wide rules. On a laptop without an optional extra (torch, vllm) those tests skip with a
reason; in CI (CI=true) every test must run, so a skip for a missing import fails the run."""

from __future__ import annotations

import os

import pytest

_import_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if "could not import" in reason or "No module named" in reason:
            _import_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") and _import_skips:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("CI must run every test, but these skipped for a missing extra:", red=True)
            for line in _import_skips[:20]:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
