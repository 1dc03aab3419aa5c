"""Suite-wide rules. On a laptop without an optional extra (torch, vllm, plot, systemd-analyze)
those tests skip with a reason; in CI (CI=true) every test must run, so any skip fails the run.

Property tests never fail for the machine's speed: no deadline, and no health check on slow
data generation (a loaded CI machine generates slowly). In CI their examples are drawn from a
fixed seed, so a run there is repeatable; elsewhere each run explores new ones."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

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


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """`small_tmpfs("2m")` mounts a tmpfs of that size in tmp_path and returns it (unmounted after
    the test): a disk a test can fill. Skipped with the reason where mounting is not permitted."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root and mount permission): {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
