"""The writer process (checkpoint/writer_process.py): an async save's DCP files written by a process of the rank's
own, from host buffers it shares with the training process. The same bytes as the persist thread's; a writer
killed mid-save is one CheckpointError and the last complete checkpoint stays; a parent killed takes its writer
with it. Real processes, real files."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.host_stage import HostStage
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.writer_process import WriterProcess
from torchrelay.errors import CheckpointError
from torchrelay.layout import checkpoint_name

SRC = Path(__file__).resolve().parents[1] / "src"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Tensors over and under the 1 MiB a shared buffer of its own takes, of several dtypes, with one step done."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1536), torch.nn.Linear(1536, 3), torch.nn.LayerNorm(3))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(4, 256))).square().mean().backward()
    opt.step()
    return model, opt


def _save(directory: Path, stage: HostStage, process: WriterProcess | None) -> dict[str, tuple[str, int]]:
    """One rank's part of a checkpoint, captured into `stage` and written on a thread, as the Saver does."""
    model, opt = _model()
    snap = ckpt_state.capture_state(
        rank=0, model=model, optimizer=opt, statefuls={}, loop={"update": 1}, stage=stage
    )
    snap.plan()
    stage.synchronize()
    directory.mkdir()
    out: dict[str, Any] = {}

    def persist() -> None:
        out["digests"] = ckpt_state.write_snapshot(snap, directory, background=True, process=process)

    thread = threading.Thread(target=persist)
    thread.start()
    thread.join()
    return dict(out["digests"])


def test_the_writer_process_writes_the_bytes_the_persist_thread_writes(tmp_path: Path) -> None:
    thread_stage, shared_stage = HostStage(), HostStage(shared=True)
    writer = WriterProcess(shared_stage)
    try:
        by_thread = _save(tmp_path / "thread", thread_stage, None)
        by_process = _save(tmp_path / "process", shared_stage, writer)
        again = _save(tmp_path / "again", shared_stage, writer)  # the buffers and the writer reused
    finally:
        writer.close()
        shared_stage.release()
    assert len(shared_stage.shared_maps()) == 0 and not writer.alive
    # .metadata holds the directory's name and a random save id: its contents are compared instead
    meta = {
        n: dcp.FileSystemReader(str(tmp_path / n / "model")).read_metadata()
        for n in ("thread", "process", "again")
    }
    assert all(m.state_dict_metadata == meta["thread"].state_dict_metadata for m in meta.values())
    assert all(m.storage_data == meta["thread"].storage_data for m in meta.values())
    for digests in (by_thread, by_process, again):
        digests.pop("model/.metadata")
    assert any(p.startswith("model/") and p.endswith(".distcp") for p in by_thread)
    assert by_process == by_thread == again  # the same files, the same digests
    for name in ("thread", "process", "again"):
        files = sorted(
            str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_file()
        )
        assert files == sorted([*by_thread, "model/.metadata"])
    for rel, (sha, size) in by_thread.items():
        data = (tmp_path / "process" / rel).read_bytes()
        assert data == (tmp_path / "thread" / rel).read_bytes(), rel
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, size), rel


def _config(example: dict[str, Path]) -> RelayConfig:
    return RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=6,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=2,
    )


def test_a_writer_killed_mid_save_is_one_error_and_the_last_checkpoint_stays(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")  # `auto` keeps the thread on a small host
    run_dir, release = tmp_path / "run", tmp_path / "release"
    killed: list[int] = []

    def hook(run: Run, update: int) -> None:
        writer = run._saver._writer  # started after the first update
        if update == 3:
            assert writer is not None and writer.alive
            run._saver.wait()  # checkpoint-2 committed (by the persist thread if the writer was still starting)
            while not writer.ready():  # checkpoint-4 goes to the writer once it has started
                time.sleep(0.01)
            writer.hold = release  # checkpoint-4's writer waits for this file before it writes a byte
        if update == 5:
            assert writer is not None
            while not list(
                run_dir.glob(".tmp-checkpoint-4-*/model")
            ):  # the writer is inside checkpoint-4's job
                time.sleep(0.01)
            os.kill(writer.pid, signal.SIGKILL)
            killed.append(writer.pid)
            release.touch()

    cfg = _config(example)
    with pytest.raises(CheckpointError) as err, Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, _batch in step.micro_batches():
                model(torch.randn(2, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hook(run, step.update)
    message = str(err.value)
    assert killed and "\n" not in message, message
    assert f"writer process (pid {killed[0]}) died (signal SIGKILL)" in message, message
    assert not (run_dir / checkpoint_name(4)).exists()
    validate_complete(run_dir / checkpoint_name(2))


_PARENT = """
import sys, threading, time
from pathlib import Path
sys.path.insert(0, {src!r})
sys.path.insert(0, {tests!r})
from test_writer_process import _save
from torchrelay.checkpoint.host_stage import HostStage
from torchrelay.checkpoint.writer_process import WriterProcess
stage = HostStage(shared=True)
writer = WriterProcess(stage)
writer.hold = Path({hold!r})  # never made: the writer stays inside the job
threading.Thread(target=_save, args=(Path({out!r}), stage, writer), daemon=True).start()
while not Path({out!r}, "model").is_dir():
    time.sleep(0.01)
print(writer.pid, flush=True)
time.sleep(600)
"""


def test_a_parent_killed_mid_save_takes_its_writer_with_it(tmp_path: Path) -> None:
    script = _PARENT.format(
        src=str(SRC),
        tests=str(Path(__file__).parent),
        hold=str(tmp_path / "never"),
        out=str(tmp_path / "ckpt"),
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)  # the writer runs, inside its job
        parent.kill()
        parent.wait()
    finally:
        parent.kill()
    for _ in range(1000):  # the parent-death signal is asynchronous: wait (at most 10 s) for the writer to go
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the writer process {pid} outlived its parent")


def test_auto_gives_a_writer_process_only_to_ranks_with_cores_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`auto` (the default): a writer process where each local rank has PROCESS_MIN_CORES cores; explicit choices
    hold whatever the host; anything else is refused naming the variable."""
    from torchrelay.checkpoint import writer_process
    from torchrelay.errors import ConfigError

    monkeypatch.delenv("TORCHRELAY_PERSIST_WRITER", raising=False)
    monkeypatch.setattr(writer_process.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert writer_process.writer_mode() == "process"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 cores a rank
    assert writer_process.writer_mode() == "thread"
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")
    assert writer_process.writer_mode() == "process"
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "proces")
    with pytest.raises(ConfigError, match="TORCHRELAY_PERSIST_WRITER='proces'"):
        writer_process.writer_mode()


def test_a_stop_signal_to_the_group_leaves_the_writer_to_write_the_last_save(tmp_path: Path) -> None:
    """SIGTERM and SIGINT reach every process of the group at a signal stop; the writer must outlive them to write
    the stop's checkpoint (it ends with its parent). It failed the suite's signal stop before it ignored them."""
    stage = HostStage(shared=True)
    writer = WriterProcess(stage)
    try:
        deadline = time.monotonic() + 180  # its import of torch: over 10 s on a loaded 2-core VM
        while not writer.ready():
            assert time.monotonic() < deadline, "the writer did not start within 180 s"
            time.sleep(0.01)
        os.kill(writer.pid, signal.SIGTERM)
        os.kill(writer.pid, signal.SIGINT)
        time.sleep(0.3)
        assert writer.alive
        _save(tmp_path / "after-signals", stage, writer)
    finally:
        writer.close()
        stage.release()
