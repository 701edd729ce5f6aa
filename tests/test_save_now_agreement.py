"""step.save_now on 2 ranks that ask differently: the recorded reason is the asking rank's (rank 0 writes
COMPLETE.json and recorded its own, though it had not asked), a tensor or numpy bool is a wish, twice in one
update keeps the first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import TORCHRUN, clean_env

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).with_name("dist_save_now.py")
CHECKS = ("reason_of_the_asking_rank", "tensor_and_numpy_bool", "twice_keeps_the_first", "nobody_asks")


def test_save_now_records_the_reason_of_the_rank_that_asked() -> None:
    out = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    results = {line.split()[1]: line.split(maxsplit=2)[2] for line in lines}
    expected = [f"{name}@{rank}" for name in CHECKS for rank in (0, 1)]
    assert out.returncode == 0 and all(results.get(name) == "ok" for name in expected), (
        results,
        out.stdout[-3000:],
        out.stderr[-3000:],
    )


def test_save_now_on_one_rank_only_says_it_is_a_collective() -> None:
    out = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(SCRIPT), "alone"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(TORCHRELAY_COLLECTIVE_TIMEOUT_S="3"),
    )
    assert "CHECK one_rank_alone_is_refused@0 ok" in out.stdout, (out.stdout[-3000:], out.stderr[-3000:])
