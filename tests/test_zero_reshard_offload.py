"""DeepSpeed ZeRO-2 with CPU offload (DeepSpeedCPUAdam) moved 4 -> 2 -> 4 in place (issue 49, item 1):
tests/test_zero_reshard.py's launched move, in a module of its own so that the suite's two workers share the two
(`--dist loadfile` keeps a module on one worker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_zero_reshard import move_4_to_2_to_4, stop_on_four


@pytest.mark.launch
def test_zero2_cpu_offload_moves_4_to_2_to_4_in_place_proven_and_the_ledger_exact(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """examples/train_deepspeed.py with `--offload` (`offload_optimizer: cpu`): the uninterrupted 4-rank run against
    the same run moved 4 -> 2 -> 4 after updates 2 and 4: each move proven at load (the CPU Adam's partitions
    resharded), the ledger exact, each parameter within the audit's bound."""
    from helpers import make_code_repo
    from test_four_ranks import cpu_adam_or_skip

    cpu_adam_or_skip()
    code, run = make_code_repo(tmp_path / "code", ("train_deepspeed.py",)), tmp_path / "run"
    stop_on_four(example, code, run, "--offload")
    move_4_to_2_to_4(example, code, tmp_path / "straight", run, "--offload")
