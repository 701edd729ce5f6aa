"""step.micro_batches(model): gradient sync only in the last micro-step, equal to the synced path (2 ranks)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import TORCHRUN, clean_env

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).with_name("dist_micro_batches.py")
CHECKS = (
    "ddp_equals_synced_path",
    "ddp_ranks_agree_after_last",
    "ddp_no_sync_before_last",
    "ddp_equals_hand_written_no_sync",
    "fsdp2_equals_synced_path",
    "fsdp2_no_reduce_before_last",
    "fsdp2_sync_restored_after_break",
)


def test_micro_batches_defer_gradient_sync_under_ddp_and_fsdp2() -> None:
    out = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    results = {line.split()[1]: line.split(maxsplit=2)[2] for line in lines}
    assert out.returncode == 0 and all(results.get(name) == "ok" for name in CHECKS), (
        results,
        out.stdout[-3000:],
        out.stderr[-3000:],
    )
