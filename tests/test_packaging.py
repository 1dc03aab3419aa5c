"""What `pip install .` builds: every package and data file in the wheel, and no warning from
the build backend (each install printed ~45 lines of "Package 'dynaresized.sim.profiles' is
absent from the `packages` configuration")."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # pip fetches the build backend pyproject.toml names, as `pip install .` does
def test_the_wheel_builds_without_warnings_and_carries_the_profiles(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Warning" not in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = tmp_path.glob("dynaresized-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = sorted(p.name for p in (ROOT / "dynaresized" / "sim" / "profiles").glob("*.toml"))
    assert profiles and all(f"dynaresized/sim/profiles/{p}" in names for p in profiles)
    assert "dynaresized/policies/hysteresis.py" in names and "dynaresized/backends/sim.py" in names
    assert not any(n.startswith(("policies/", "backends/", "tests/")) for n in names)


def test_every_install_the_makefile_runs_is_quiet() -> None:
    """`make demo` and `make test-quick` on a fresh clone printed pip's and setuptools' editable-
    install banners (issue 45): every pip run is -q and filters setuptools' "Editable installation"
    warning, which its build backend prints on each `pip install -e`."""
    makefile = (ROOT / "Makefile").read_text()
    assert 'QUIET  := PYTHONWARNINGS="ignore:Editable installation"' in makefile
    assert "PIP    := $(QUIET) $(PY) -m pip --disable-pip-version-check -q" in makefile
    recipes = [x.strip().lstrip("@") for x in makefile.splitlines() if x.startswith("\t")]
    installs = [x for x in recipes if " install " in x and "pip" in x and not x.startswith("echo")]
    assert installs and all(x.startswith("$(PIP) ") or (x.startswith("$(QUIET) ") and " -q " in x)
                            for x in installs), installs

