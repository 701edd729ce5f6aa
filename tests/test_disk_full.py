"""A full disk during a save: a clear error naming it, no partial checkpoint, the last complete one survives,
and after space is freed the run continues to the same bits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import assert_same_final_state, launch, segments
from torchrelay.checkpoint.select import list_checkpoints

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.fixture
def small_disk(tmp_path: Path):
    mnt = tmp_path / "disk"
    if not _mount_tmpfs(mnt, "3m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save_keeps_last_checkpoint(
    example: dict[str, Path], baseline: Path, small_disk: Path
) -> None:
    ckpt_bytes = list_checkpoints(baseline)[-1].size
    # room for the run's small files and one checkpoint, not two
    subprocess.run(["mount", "-o", f"remount,size={int(ckpt_bytes * 1.6)}", str(small_disk)], check=True)
    run = small_disk / "run"
    out = launch(example["code"], run, config=example["config"], sets={"save_every": 4, "keep": 2})
    assert out.returncode != 0
    # one message (rank 0's), no traceback of a rank (issue 9 defect 6), DiskFull's exit code on every rank
    said = [line for line in out.stderr.splitlines() if line.startswith("torchrelay")]
    assert len(said) == 1 and said[0].startswith("torchrelay: saving checkpoint-"), out.stderr[:3000]
    assert "(disk full)" in said[0] and "  hint: the previous complete checkpoint is untouched" in out.stderr
    frames = [line for line in out.stderr.splitlines() if line.strip().startswith('File "')]
    assert all("site-packages" in f or "bin/torchrun" in f for f in frames), frames
    ckpts = list_checkpoints(run)
    assert ckpts and all(c.complete for c in ckpts), ckpts
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-")]
    # the failed save's temporary is gone before the segment is recorded, so its end is on record
    assert segments(run)[-1]["ended"] == "error"
    # free space and continue: same bits as the uninterrupted run
    subprocess.run(["mount", "-o", "remount,size=200m", str(small_disk)], check=True)
    out = launch(example["code"], run)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_final_state(baseline, run, 16)
