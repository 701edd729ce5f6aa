"""The tiers are declared: a test that starts ranks without the `launch` marker fails, in the fast tier and in the
full suite, naming the marker; a marked one is left out of the fast tier before it starts (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import REPO

TESTS = """
import subprocess

import pytest


def test_unmarked_starts_torchrun():
    subprocess.run(["torchrun", "--help"], capture_output=True)


@pytest.mark.launch
def test_marked_starts_torchrun():
    subprocess.run(["torchrun", "--help"], capture_output=True)


def test_starts_nothing():
    subprocess.run(["true"])
"""


def _pytest(folder: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *args, str(folder)]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300).stdout


def test_an_unmarked_launch_fails_and_a_marked_one_is_left_out_of_the_fast_tier(tmp_path: Path) -> None:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_some.py").write_text(TESTS)
    full = _pytest(tmp_path)
    assert "FAILED test_some.py::test_unmarked_starts_torchrun" in full, full
    assert "add @pytest.mark.launch" in full and "2 passed" in full, full
    fast = _pytest(tmp_path, "--fast")
    assert "FAILED test_some.py::test_unmarked_starts_torchrun" in fast, fast
    assert "SKIPPED [1] test_some.py:" in fast and "marked launch" in fast and "1 passed" in fast, fast
