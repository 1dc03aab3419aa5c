"""The layering in .importlinter holds: a lower layer never imports a higher one, and the core
imports nothing that does IO."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_import_contracts_are_kept() -> None:
    pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
    exe = Path(sys.executable).parent / "lint-imports"  # the venv's script; the venv need not be on PATH
    assert exe.exists(), f"lint-imports is installed next to {sys.executable}"
    result = subprocess.run([str(exe)], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROKEN" not in result.stdout
