"""The layering in .importlinter holds: a lower layer never imports a higher one, and the core
imports nothing that does IO."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def test_import_contracts_are_kept() -> None:
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    exe = shutil.which("lint-imports")
    assert exe is not None
    result = subprocess.run([exe], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROKEN" not in result.stdout
