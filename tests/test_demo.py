"""The README's first command: the demo stops a real run twice, continues it and finds it bit-for-bit equal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, clean_env, segments

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch


def test_demo_stops_twice_continues_and_is_equal(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=clean_env(COLUMNS="200"),
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-for-bit EQUAL" in out.stdout and "LEDGER_OK" in out.stdout
    run = tmp_path / "demo" / "run"
    ended = [(s["ended"], s["exit_code"]) for s in segments(run)]
    assert ended == [("request", 4), ("budget", 3), ("finished", 0)]
    assert segments(run)[1]["runtime_changes"]["num_workers"] == [0, 2]
    assert (tmp_path / "demo" / "report" / "report.html").is_file()
