"""Suite-wide rules. On a laptop without an optional extra (torch, vllm, plot, systemd-analyze)
those tests skip with a reason; in CI (CI=true) every test must run, so any skip fails the run.

Property tests never fail for the machine's speed: no deadline, and no health check on slow
data generation (a loaded CI machine generates slowly). In CI their examples are drawn from a
fixed seed, so a run there is repeatable; elsewhere each run explores new ones."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dynaresized", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=bool(os.environ.get("CI")))
settings.load_profile("dynaresized")

_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") and _skips:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"CI must run every test, but {len(_skips)} skipped:", red=True)
            for line in _skips[:20]:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
