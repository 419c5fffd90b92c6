"""Lint that runs: ruff over the whole repository with the rules pinned in pyproject.toml
(``[tool.ruff.lint]``), so CI fails on an unused import or a misordered import block."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_ruff_passes_on_the_repository():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                            text=True, timeout=300, check=False, cwd=REPO)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
