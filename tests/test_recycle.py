"""Spare files (checkpoint/recycle.py): the next save writes over the tensor files of the newest checkpoint retention
retired, instead of allocating new ones. The bytes and digests are a new file's; a spare longer or shorter than
the file is cut to it; a spare that is a link, a hard link, a folder, or in a folder linked out of the run is never
written through; the spare is gone when the segment ends and at the next start. Real files, the persist thread and
the writer process, a real training loop."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import assert_same_final_state, assert_same_logs, launch, segments
from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import recycle
from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.commit import clean_stale, commit_checkpoint, stale_bytes, wait_deletions
from torchrelay.checkpoint.host_stage import HostStage
from torchrelay.checkpoint.inventory import read_inventory, validate_complete
from torchrelay.checkpoint.retention import LatestN
from torchrelay.checkpoint.writer_process import WriterProcess
from torchrelay.config.tuning import SaveTuning
from torchrelay.controller.preflight import PreflightFailed, PreflightReport, check_disk
from torchrelay.paths.layout import SPARE_CHECKPOINT, checkpoint_name


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1536), torch.nn.Linear(1536, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    return model, opt


def _save(
    directory: Path, seed: int, process: WriterProcess | None = None, stage: HostStage | None = None
) -> Any:
    """One rank's checkpoint files, written on a thread as the Saver's persist does; {relative path: digest}."""
    model, opt = _model(seed)
    stage = stage or HostStage(tuning=SEVERAL_FILES)
    snap = ckpt_state.capture_state(
        rank=0, model=model, optimizer=opt, statefuls={}, loop={"update": 1}, stage=stage
    )
    snap.plan()
    stage.synchronize()
    directory.mkdir()
    out: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: out.update(
            d=ckpt_state.write_snapshot(snap, directory, background=True, process=process)
        )
    )
    thread.start()
    thread.join()
    return out["d"]


# Files of 1 MiB: a small model's state in several files, as a large one's is.
SEVERAL_FILES = SaveTuning(file_bytes=1 << 20)


def _distcp(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((folder / "model").glob("*.distcp"))}


def _check_digests(folder: Path, digests: dict[str, Any]) -> None:
    for rel, (sha, size, *_parts) in digests.items():
        data = (folder / rel).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, size), rel


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_save_writes_over_the_spare_files_and_its_bytes_are_a_new_files(
    tmp_path: Path, writer: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    fresh = _save(tmp_path / "fresh", seed=1)  # the reference: new files
    old = _save(run / SPARE_CHECKPOINT, seed=2)  # a retired checkpoint of other values
    files = _distcp(run / SPARE_CHECKPOINT)
    assert len(files) >= 2
    names = sorted(files)
    with open(files[names[0]], "ab") as f:  # a spare longer than the file: its tail must go
        f.write(b"\xff" * 123457)
    os.truncate(files[names[1]], 1000)  # a shorter one: written past its end
    inodes = {n: p.stat().st_ino for n, p in files.items()}
    other = run / SPARE_CHECKPOINT / "model" / "__1_0.distcp"  # another rank's: never this rank's to take
    other.write_bytes(b"rank 1")
    stage = HostStage(shared=writer == "process", tuning=SEVERAL_FILES)
    process = WriterProcess(stage) if writer == "process" else None
    try:
        digests = _save(run / ".tmp-checkpoint-7-1-1", seed=1, process=process, stage=stage)
    finally:
        if process is not None:
            process.close()
        stage.release()
    new = run / ".tmp-checkpoint-7-1-1"
    assert {n: p.stat().st_ino for n, p in _distcp(new).items()} == inodes  # every one written over, none new
    assert list(_distcp(run / SPARE_CHECKPOINT)) == [
        other.name
    ]  # ours taken (moved, not copied), not rank 1's
    assert other.read_bytes() == b"rank 1"
    for name, path in _distcp(new).items():
        assert path.read_bytes() == (tmp_path / "fresh" / "model" / name).read_bytes(), name
    _check_digests(new, digests)
    assert {k: v for k, v in digests.items() if "metadata" not in k} == {
        k: v for k, v in fresh.items() if "metadata" not in k
    }
    assert old  # (the spare's own digests: other values, so a copy of it would have failed above)


def test_a_spare_that_is_not_a_plain_file_of_the_run_is_never_written_through(tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    _save(tmp_path / "names", seed=2)
    names = sorted(_distcp(tmp_path / "names"))
    spare = run / SPARE_CHECKPOINT / "model"
    spare.mkdir(parents=True)
    victim, shared = outside / "victim.bin", outside / "shared.bin"
    victim.write_bytes(b"the user's file")
    shared.write_bytes(b"a pack's hard link")
    (spare / names[0]).symlink_to(victim)  # a link out of the run
    os.link(shared, spare / names[1])  # a file another name shares
    for name in names[2:]:
        (spare / name).mkdir()  # a folder where a file was
    digests = _save(run / ".tmp-checkpoint-3-1-1", seed=1)
    assert victim.read_bytes() == b"the user's file" and shared.read_bytes() == b"a pack's hard link"
    new = run / ".tmp-checkpoint-3-1-1"
    assert all(p.is_file() and not p.is_symlink() and p.stat().st_nlink == 1 for p in _distcp(new).values())
    _check_digests(new, digests)

    # a spare folder linked out of the run: nothing in it is taken
    run2 = tmp_path / "run2"
    run2.mkdir()
    _save(outside / "ckpt", seed=2)
    (run2 / SPARE_CHECKPOINT).symlink_to(outside / "ckpt")
    before = {n: p.read_bytes() for n, p in _distcp(outside / "ckpt").items()}
    _save(run2 / ".tmp-checkpoint-3-1-1", seed=1)
    assert {n: p.read_bytes() for n, p in _distcp(outside / "ckpt").items()} == before
    # and the start's sweep removes the link itself, never what it points to
    clean_stale(run2)
    assert not os.path.lexists(run2 / SPARE_CHECKPOINT) and _distcp(outside / "ckpt")


def _config(example: dict[str, Path]) -> RelayConfig:
    return RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=6,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=1,
        keep=2,
        async_save=False,  # each checkpoint committed when its update returns: the hook sees it
        save_tuning=SEVERAL_FILES,
    )


def _train(example: dict[str, Path], run_dir: Path, plant: bool = False) -> dict[int, dict[str, int]]:
    """Six updates saving each, keeping two; the inode of each checkpoint's tensor files as it was committed, and
    whether a spare was there. `plant`: a file where the spare goes, written after update 1."""
    seen: dict[int, dict[str, int]] = {}
    with Run.open(run_dir, _config(example)) as run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, _batch in step.micro_batches():
                model(torch.randn(2, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if plant and step.update == 1:
                (run_dir / SPARE_CHECKPOINT).write_bytes(b"not a folder")
            if step.update > 1:  # the previous update's checkpoint is committed by now
                ckpt = run_dir / checkpoint_name(step.update - 1)
                seen[step.update - 1] = {n: p.stat().st_ino for n, p in _distcp(ckpt).items()}
                seen[step.update - 1]["spare"] = int((run_dir / SPARE_CHECKPOINT).is_dir())
    return seen


@pytest.mark.launch
def test_a_run_writes_each_save_over_the_checkpoint_it_retired_and_ends_as_without(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _train(example, tmp_path / "recycled", plant=True)  # a file in the spare's place is no obstacle
    assert not (tmp_path / "recycled" / SPARE_CHECKPOINT).exists()  # removed when the segment ended
    assert not [
        p.name for p in (tmp_path / "recycled").iterdir() if p.name.startswith((".spare", ".deleting"))
    ]
    # checkpoint-3's commit retired checkpoint-1 as the spare: checkpoint-4 is written over its files, and so on
    files = {u: {n: i for n, i in s.items() if n != "spare"} for u, s in seen.items()}
    assert files[1] and files[4] == files[1] and files[5] == files[2]
    assert seen[3]["spare"] == 1 and seen[1]["spare"] == 0

    monkeypatch.setenv("TORCHRELAY_RECYCLE", "0")
    assert not recycle.enabled()
    plain = _train(example, tmp_path / "deleted")
    assert not any(s["spare"] for s in plain.values())
    for update in (5, 6):  # what retention kept: the same bytes whether written over spares or new
        ours, theirs = (tmp_path / run / checkpoint_name(update) for run in ("recycled", "deleted"))
        validate_complete(ours)
        tensors = [
            {f["path"]: f["sha256"] for f in read_inventory(c)["files"] if f["path"].endswith(".distcp")}
            for c in (ours, theirs)
        ]
        assert tensors[0] and tensors[0] == tensors[1]


def test_a_spare_left_by_a_segment_that_never_closed_is_removed_at_the_next_start(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / SPARE_CHECKPOINT / "model").mkdir(parents=True)
    (run / SPARE_CHECKPOINT / "model" / "__0_0.distcp").write_bytes(b"x" * 100)
    assert SPARE_CHECKPOINT in clean_stale(run)
    assert not (run / SPARE_CHECKPOINT).exists()


def test_a_bad_recycle_setting_never_fails_a_committed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention runs after the rename that made a save complete: a TORCHRELAY_RECYCLE that does not parse is
    refused by the next save that writes tensors, never by this one (a DeepSpeed engine's save writes none)."""
    run = tmp_path / "run"
    run.mkdir()

    def write(tmp: Path, _hook: Any) -> dict[str, tuple[str, int]]:
        (tmp / "model").mkdir()
        data = os.urandom(4096)
        (tmp / "model" / "__0_0.distcp").write_bytes(data)
        return {"model/__0_0.distcp": (hashlib.sha256(data).hexdigest(), len(data))}

    monkeypatch.setenv("TORCHRELAY_RECYCLE", "off")
    for update in (1, 2):
        commit_checkpoint(run, update, write, rank=0, world_size=1, info={}, retention=LatestN(1))
    wait_deletions()
    validate_complete(run / checkpoint_name(2))
    assert sorted(p.name for p in run.iterdir()) == [checkpoint_name(2)]


def test_the_launchers_disk_check_counts_a_spare_the_start_removes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / SPARE_CHECKPOINT / "model").mkdir(parents=True)
    with open(run / SPARE_CHECKPOINT / "model" / "__0_0.distcp", "wb") as f:
        f.write(os.urandom(1 << 20) * 256)  # 256 MiB held
        os.fsync(f.fileno())
    held = stale_bytes(run)
    assert held >= 256 << 20
    free = shutil.disk_usage(run).free
    check_disk(run, free + held // 2, 1, PreflightReport())  # fits only with the spare's room
    with pytest.raises(PreflightFailed, match="disk"):
        check_disk(run, free + held * 4, 1, PreflightReport())


def _born(path: Path) -> float:
    """The file's birth time (statx through coreutils' stat), 0 where the file system keeps none."""
    out = subprocess.run(["stat", "-c", "%.9W", str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip() or 0)


@pytest.mark.launch
def test_two_ranks_killed_inside_a_save_over_spare_files_resume_bit_exact(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """2 ranks under torchrun, each writing through its writer process, a checkpoint every 2 updates, keeping 2:
    from the fourth save on each save writes over the files of the checkpoint retired before it. Rank 1 is
    SIGKILLed inside the save of update 12 (its files written, over spare files); the next launch resumes from
    checkpoint-10, removes what the killed save left and ends bit for bit as the uninterrupted run, its files the
    same bytes."""
    run = tmp_path / "run"
    env = {"TORCHRELAY_PERSIST_WRITER": "process"}
    out = launch(
        example["code"],
        run,
        config=example["config"],
        sets={"save_every": 2},
        env=env,
        args=("--kill-at", "shards:12:1"),
    )
    assert out.returncode != 0 and "SIGKILL" in out.stderr, out.stderr[-2000:]
    (killed,) = [p for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-12-")]
    files = list((killed / "model").glob("*.distcp"))
    assert len(files) == 2  # one per rank
    if _born(killed):  # born before the folder the save made for them: spare files, written over
        assert all(0 < _born(f) < _born(killed) for f in files), [(f.name, _born(f)) for f in files]
    assert (run / "checkpoint-10" / "COMPLETE.json").exists()
    out = launch(example["code"], run, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert segments(run)[-1]["resumed_from"] == 10
    left = [p.name for p in run.iterdir() if p.name.startswith((".tmp-checkpoint-", ".deleting", ".spare"))]
    assert not left, left
    assert_same_final_state(baseline, run, 16)
    assert_same_logs(baseline, run)
    a, b = baseline / checkpoint_name(16), run / checkpoint_name(16)
    theirs = {e["path"]: e["sha256"] for e in read_inventory(a)["files"] if e["path"].endswith(".distcp")}
    assert theirs and theirs == {
        e["path"]: e["sha256"] for e in read_inventory(b)["files"] if e["path"].endswith(".distcp")
    }
