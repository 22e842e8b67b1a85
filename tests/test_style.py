"""The Python sources stay ruff-clean (lint and format, pyproject.toml's settings): the style the repo follows,
checked where every change is tested rather than left to memory. ruff is pinned in the test extra, so its
formatting does not drift between machines."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e .[test] installs it)")
    p = subprocess.run([ruff, *args, "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"ruff {' '.join(args)} found:\n{(p.stdout + p.stderr)[-4000:]}"
