"""The writer process (checkpoint/writer_process.py): an async save's DCP files written by a process of the rank's
own, from host buffers it shares with the training process. The same bytes as the persist thread's; a writer
killed mid-save, or stopped past TORCHRELAY_PERSIST_STALL_S, is one CheckpointError and the last complete
checkpoint stays; a slow writer that progresses is left alone; a parent killed takes its writer with it. The
thread writer's persist thread has the same deadline (Persister.wait). Real processes, real files; under torchrun
(2 ranks, gloo), one rank's writer killed, one rank's writer stopped, one rank's persist thread stuck."""

from __future__ import annotations

import hashlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import assert_same_final_state, assert_same_logs, launch, segments
from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.host_stage import HostStage
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.persist import Persister
from torchrelay.checkpoint.writer_process import WriterProcess
from torchrelay.errors import CheckpointError
from torchrelay.ledger.exposure import prove
from torchrelay.paths.layout import checkpoint_name

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


def _save(
    directory: Path,
    stage: HostStage,
    process: WriterProcess | None,
    make: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]] = _model,
) -> dict[str, tuple[str, int]]:
    """One rank's part of a checkpoint, captured into `stage` and written on a thread, as the Saver does."""
    model, opt = make()
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
        # one rank: the writer wrote `.metadata` too, off the persist thread, and its digest is the file's
        assert writer.finished
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
    for name, digests in (("thread", by_thread), ("process", by_process), ("again", again)):
        data = (tmp_path / name / "model" / ".metadata").read_bytes()
        assert digests.pop("model/.metadata")[:2] == (hashlib.sha256(data).hexdigest(), len(data)), name
    assert any(p.startswith("model/") and p.endswith(".distcp") for p in by_thread)
    assert by_process == by_thread == again  # the same files, the same digests
    for name in ("thread", "process", "again"):
        files = sorted(
            str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_file()
        )
        assert files == sorted([*by_thread, "model/.metadata"])
    for rel, (sha, size, *_states) in by_thread.items():
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


def _train_until_the_writer_fails(
    example: dict[str, Path], run_dir: Path, release: Path, act: Callable[[int], None]
) -> tuple[str, int]:
    """Train 6 updates, saving every 2, with checkpoint-4's writer inside its job (held) when `act(pid)` is done to
    it; the one line the run raises, and the writer's pid."""
    acted: list[int] = []

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
            act(writer.pid)
            acted.append(writer.pid)
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
    assert acted and "\n" not in message, message
    assert not (run_dir / checkpoint_name(4)).exists()
    assert not list(run_dir.glob(".tmp-checkpoint-*"))
    validate_complete(run_dir / checkpoint_name(2))
    return message, acted[0]


def test_a_writer_killed_mid_save_is_one_error_and_the_last_checkpoint_stays(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")  # `auto` keeps the thread on a small host
    message, pid = _train_until_the_writer_fails(
        example, tmp_path / "run", tmp_path / "release", lambda pid: os.kill(pid, signal.SIGKILL)
    )
    assert f"writer process (pid {pid}) died (signal SIGKILL)" in message, message


def test_a_writer_stopped_mid_save_is_killed_at_the_deadline_and_the_last_checkpoint_stays(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that hangs without dying (SIGSTOP: as a write stuck on a dead file system) made the persist wait
    forever. Past TORCHRELAY_PERSIST_STALL_S without progress the writer is killed and the save fails."""
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")
    monkeypatch.setenv("TORCHRELAY_PERSIST_STALL_S", "2")
    stopped: list[int] = []

    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    # Without a deadline the run would wait for ever: the stopped writer is let go after 60 s, so that the old
    # code fails this test (checkpoint-4 committed, nothing raised) instead of hanging the suite.
    watchdog = threading.Timer(60, lambda: [os.kill(pid, signal.SIGCONT) for pid in stopped])
    watchdog.start()
    started = time.monotonic()
    try:
        message, pid = _train_until_the_writer_fails(example, tmp_path / "run", tmp_path / "release", stop)
    finally:
        watchdog.cancel()
    assert f"writer process (pid {pid}) made no progress for 2 s while writing " in message, message
    assert "TORCHRELAY_PERSIST_STALL_S" in message, message
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
        os.kill(pid, 0)
    assert time.monotonic() - started < 50


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


@pytest.mark.full  # a parent process and its writer process killed mid-save: 9 s
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


def test_a_writer_no_save_used_ends_quietly_with_its_parent(capfd: pytest.CaptureFixture[str]) -> None:
    """A run that ends before any save used its writer leaves the writer's `ready` unread: the kernel resets the
    socket, and the writer printed a traceback at every such end (found under torchrun: a rank whose saves all
    went to the thread while its writer started). It ends quietly, with status 0."""
    stage = HostStage(shared=True)
    writer = WriterProcess(stage)
    try:
        select.select([writer._sock], [], [], 60)  # its `ready` has arrived; nobody reads it
        writer._sock.close()  # as the parent's end closes it, with no WriterProcess.close
        assert writer._proc.wait(timeout=60) == 0
    finally:
        writer.close()
        stage.release()
    assert "Traceback" not in capfd.readouterr().err


def test_a_writer_closed_while_it_starts_ends_at_once(capfd: pytest.CaptureFixture[str]) -> None:
    """A run that ends while its writer still imports torch (a signal stop soon after the first update) waited
    for the imports in WriterProcess.close: 10 s of a 2-rank stop on the loaded 2-core VM. The writer holds
    nothing yet: the close ends it at once, in a fraction of the time a writer takes to start."""
    stage = HostStage(shared=True)
    try:
        closed = WriterProcess(stage)
        started = time.monotonic()
        closed.close()
        closing = time.monotonic() - started
        assert not closed.alive
        other = WriterProcess(stage)
        started = time.monotonic()
        while not other.ready():
            time.sleep(0.01)
        starting = time.monotonic() - started
        other.close()
    finally:
        stage.release()
    assert closing < starting / 2, (closing, starting)
    assert "Traceback" not in capfd.readouterr().err


def _large() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """About 200 MB of model and optimizer state: a write of seconds on the 2-core VM."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 2048)).square().mean().backward()
    opt.step()
    return model, opt


@pytest.mark.full  # a writer process slowed past its deadline on purpose: 8.5 s
def test_a_writer_slowed_but_progressing_is_never_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline runs from the writer's last progress, never from the job's start: a writer stopped for 1 s of
    every 1.3 s (a disk that gives it a slice at a time) writes for longer than the deadline in all, progresses
    in every slice, and is left to finish. A deadline on the whole job (or without the writer's heartbeat)
    killed it."""
    stall = 2.0
    monkeypatch.setenv("TORCHRELAY_PERSIST_STALL_S", str(stall))
    monkeypatch.setenv("TORCHRELAY_PERSIST_STREAMS", "1")  # one file at a time: the longest write
    stage = HostStage(shared=True)
    writer = WriterProcess(stage)
    done = threading.Event()

    def slow_disk() -> None:
        while not done.wait(0.3):
            os.kill(writer.pid, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(writer.pid, signal.SIGCONT)

    try:
        while not writer.ready():
            time.sleep(0.01)
        cycle = threading.Thread(target=slow_disk)
        cycle.start()
        started = time.monotonic()
        try:
            digests = _save(tmp_path / "slow", stage, writer, _large)
        finally:
            done.set()
            cycle.join()
        took = time.monotonic() - started
        assert writer.alive
    finally:
        writer.close()
        stage.release()
    assert took > stall, f"the write took {took:.1f} s: shorter than the deadline, it proves nothing"
    assert sum(size for path, (_, size, *_states) in digests.items() if path.endswith(".distcp")) > 150 << 20


def test_a_bad_stall_deadline_is_refused_at_the_open(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCHRELAY_PERSIST_STALL_S is read only once a write stops progressing (the writer process's at each job,
    the thread's never before it had a deadline): a bad value is refused when the run opens, before anything is
    touched, not hours later in the middle of a save."""
    from torchrelay.errors import ConfigError

    monkeypatch.setenv("TORCHRELAY_PERSIST_STALL_S", "0")
    with pytest.raises(
        ConfigError, match=r"^TORCHRELAY_PERSIST_STALL_S=0 is not a positive number of seconds"
    ):
        Run.open(tmp_path / "run", _config(example), code_dir=example["code"])
    assert not (tmp_path / "run").exists()


def _submit(
    persister: Persister,
    directory: Path,
    stage: HostStage,
    make: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
) -> None:
    """One rank's part of a checkpoint captured into `stage`, its write handed to `persister`'s thread (no writer
    process: the thread writer), as the Saver does."""
    model, opt = make()
    snap = ckpt_state.capture_state(
        rank=0, model=model, optimizer=opt, statefuls={}, loop={"update": 1}, stage=stage
    )
    snap.plan()
    stage.synchronize()
    directory.mkdir()
    persister.submit(1, lambda: ckpt_state.write_snapshot(snap, directory, background=True))


def test_a_persist_thread_stuck_in_a_write_fails_at_the_deadline_and_is_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread writer: a persist thread that stops inside a write (its first piece landed, then nothing, as a
    write to a dead network file system) made the training thread's wait join it for ever. Past
    TORCHRELAY_PERSIST_STALL_S without progress the wait raises the one line saying a thread cannot be killed,
    once; the thread is left behind (`stuck`), later waits return at once. The stuck write is let go after 60 s,
    so that the old code fails this test (the wait returns, nothing raised) instead of hanging the suite."""
    stall = 1.5
    monkeypatch.setenv("TORCHRELAY_PERSIST_STALL_S", str(stall))
    stage, persister, release = HostStage(), Persister(), threading.Event()
    persister.on_piece = release.wait  # every piece's writer waits: the first one stops the write
    watchdog = threading.Timer(60, release.set)
    watchdog.start()
    try:
        _submit(persister, tmp_path / "ckpt", stage, _model)
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            persister.wait()
        took = time.monotonic() - started
        message = str(err.value)
        assert message == (
            f"the checkpoint persist thread made no progress for {stall:g} s while writing {tmp_path / 'ckpt/model'} "
            "(TORCHRELAY_PERSIST_STALL_S sets the wait); a thread cannot be killed, so this process ends; the last "
            "complete checkpoint stays"
        ), message
        assert persister.stuck and persister.in_flight
        # the stall counts from the last progress (the first piece), which may land before `started`
        assert stall - 0.5 <= took < stall + 10, took
        started = time.monotonic()
        persister.wait()  # said once: the process is ending, nothing waits for the thread any more
        assert time.monotonic() - started < 0.5
    finally:
        watchdog.cancel()
        release.set()
        if persister._thread is not None:
            persister._thread.join(60)
        stage.release()


@pytest.mark.full  # a write slowed past its deadline on purpose: 24 s
def test_a_persist_thread_slowed_but_progressing_is_never_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread writer's deadline runs from the write's last progress, never from the job's start nor from the
    wait's: a write whose every 16 MiB piece takes 0.4 s more (a slow disk) writes for longer than the deadline in
    all, progresses every piece, and is waited for to the end. A deadline counted from the wait's start gave up
    on it (checked by making it so)."""
    stall = 1.5
    monkeypatch.setenv("TORCHRELAY_PERSIST_STALL_S", str(stall))
    monkeypatch.setenv("TORCHRELAY_PERSIST_STREAMS", "1")  # one file at a time: the longest write
    stage, persister = HostStage(), Persister()
    persister.on_piece = lambda: time.sleep(0.4)
    try:
        started = time.monotonic()
        _submit(persister, tmp_path / "slow", stage, _large)
        persister.wait()
        took = time.monotonic() - started
    finally:
        stage.release()
    assert not persister.stuck
    assert took > 2 * stall, (
        f"the write took {took:.1f} s: not much longer than the deadline, it proves nothing"
    )
    validate = [p for p in (tmp_path / "slow" / "model").iterdir() if p.suffix == ".distcp"]
    assert sum(p.stat().st_size for p in validate) > 150 << 20


def _one_ranks_write_fails_under_torchrun(
    example: dict[str, Path],
    baseline: Path,
    run: Path,
    env: dict[str, str],
    kill_at: str,
    line: str,
    writer: str = "process",
) -> float:
    """Two ranks, the `writer` forced (TORCHRELAY_PERSIST_WRITER), rank 1's write of checkpoint-8 made to fail
    (`kill_at`). Every rank
    ends, long before the collective timeout, with the one line (said once, matching `line`) and exit 1; no rank's
    traceback; checkpoint-8 never committed; checkpoint-4 complete; the resume from it ends bit for bit as the
    uninterrupted baseline. Returns how long the failed launch took."""
    started = time.monotonic()
    out = launch(
        example["code"],
        run,
        config=example["config"],
        sets={"save_every": 4},
        env={"TORCHRELAY_PERSIST_WRITER": writer, **env},
        args=("--kill-at", kill_at),
        timeout=200,  # under the collective timeout (300 s): a rank waiting for a dead peer would run past it
    )
    took = time.monotonic() - started
    output = out.stdout + out.stderr
    said = [line for line in output.splitlines() if line.startswith("torchrelay: ")]
    assert len(said) == 1, output[-3000:]
    assert re.fullmatch(line, said[0]), said
    assert out.returncode == 1 and output.count("exitcode  : 1") == 2, output[-3000:]
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert all("site-packages" in f or "bin/torchrun" in f for f in frames), frames  # torchrun's own only
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-")]
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-4"]
    validate_complete(run / checkpoint_name(4))
    assert (segments(run)[-1]["ended"], segments(run)[-1]["exit_code"]) == ("error", 1)

    out = launch(example["code"], run, env={"TORCHRELAY_PERSIST_WRITER": writer})
    assert out.returncode == 0, out.stdout + out.stderr
    assert segments(run)[-1]["resumed_from"] == 4
    assert assert_same_final_state(baseline, run, 16) > 10
    assert_same_logs(baseline, run)
    assert prove(run).ok
    return took


@pytest.mark.launch
def test_one_ranks_writer_killed_under_torchrun_ends_every_rank_and_the_run_resumes_exactly(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """Rank 1's writer SIGKILLed inside checkpoint-8's write (kill point writer:8:1: its files written, before it
    answers): every rank ends with the one line naming it, and the run resumes exactly."""
    _one_ranks_write_fails_under_torchrun(
        example,
        baseline,
        tmp_path / "run",
        {},
        "writer:8:1",
        r"torchrelay: saving checkpoint-8 failed on rank 1: the checkpoint writer process \(pid \d+\) died "
        r"\(signal SIGKILL\) while writing \S+/\.tmp-checkpoint-8-\S+/model; the last complete checkpoint stays",
    )


@pytest.mark.launch
def test_one_ranks_writer_stopped_under_torchrun_ends_every_rank_at_the_deadline_and_the_run_resumes_exactly(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """Rank 1's writer stopped without dying inside checkpoint-8's write (kill point stall:8:1: it SIGSTOPs itself
    once its first piece has reached the kernel, as a write stuck on a dead file system), with a deadline of 3 s.
    Rank 1 kills it once it made no progress for 3 s, and every rank ends with the one line naming the writer and
    the variable that sets the wait, exit 1, well before the collective timeout; the run resumes exactly. Without
    the deadline rank 1 waited for its writer for ever, and rank 0 for rank 1: the launch ran into its 200 s."""
    stall = 3
    took = _one_ranks_write_fails_under_torchrun(
        example,
        baseline,
        tmp_path / "run",
        {"TORCHRELAY_PERSIST_STALL_S": str(stall)},
        "stall:8:1",
        rf"torchrelay: saving checkpoint-8 failed on rank 1: the checkpoint writer process \(pid \d+\) made no "
        rf"progress for {stall} s while writing \S+/\.tmp-checkpoint-8-\S+/model and was killed "
        r"\(TORCHRELAY_PERSIST_STALL_S sets the wait\); the last complete checkpoint stays",
    )
    print(f"STALLED_LAUNCH_S {took:.1f}")


@pytest.mark.launch
def test_one_ranks_persist_thread_stuck_under_torchrun_ends_every_rank_at_the_deadline_and_resumes_exactly(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """The thread writer (TORCHRELAY_PERSIST_WRITER=thread): rank 1's persist thread blocked for good inside
    checkpoint-8's write (kill point stall:8:1, once its first piece has reached the kernel), a deadline of 3 s.
    A thread cannot be killed: rank 1's training thread, waiting for it at the next save, gives up 3 s after its
    last progress and joins the save's exchange its peer's persist thread waits in, with the one line saying so;
    every rank ends, exit 1, and the run resumes exactly. Before, rank 1 waited for the thread for ever (join
    without a deadline), and rank 0's persist thread for rank 1 (its group keeps torch's 30 min timeout): the
    launch ran into its 200 s."""
    stall = 3
    took = _one_ranks_write_fails_under_torchrun(
        example,
        baseline,
        tmp_path / "run",
        {"TORCHRELAY_PERSIST_STALL_S": str(stall)},
        "stall:8:1",
        rf"torchrelay: saving checkpoint-8 failed on rank 1: the checkpoint persist thread made no progress for "
        rf"{stall} s while writing \S+/\.tmp-checkpoint-8-\S+/model \(TORCHRELAY_PERSIST_STALL_S sets the wait\); "
        r"a thread cannot be killed, so this process ends; the last complete checkpoint stays",
        writer="thread",
    )
    print(f"STUCK_THREAD_LAUNCH_S {took:.1f}")


def _ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` ignores `sig` now (Linux: its SigIgn mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_stop_signal_during_the_writers_start_up_leaves_it_to_start(tmp_path: Path) -> None:
    """torchrun's SIGTERM reaches the rank's whole group, a writer still importing torch included: it died, and
    the stop's save started another and waited for its start-up (20-24 s of a 2-rank signal stop). It ignores the
    stop signals from before its imports, starts, and writes."""
    stage = HostStage(shared=True)
    writer = WriterProcess(stage)
    try:
        give_up = time.monotonic() + 60
        while not _ignores(writer.pid, signal.SIGTERM):
            assert writer.alive and time.monotonic() < give_up, "the writer never ignored SIGTERM"
            time.sleep(0.001)
        assert not writer.ready(), "the writer had started before the signals: this proves nothing"
        os.kill(writer.pid, signal.SIGTERM)
        os.kill(writer.pid, signal.SIGINT)
        while not writer.ready():
            assert writer.alive, "a stop signal during its start-up killed the writer"
            time.sleep(0.01)
        _save(tmp_path / "after-signals", stage, writer)
    finally:
        writer.close()
        stage.release()


def test_a_save_before_the_writer_has_started_does_not_wait_for_it(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer starts at the third update's `due()` and imports torch (seconds); a save due before it has
    started writes its files from the persist thread, the same bytes, and the loop does not wait for the writer
    (on an H100 the wait blocked a save at update 40 for 4.6 s, 35x the device->host copy)."""
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")
    cfg = RelayConfig(
        seed=3, micro_batch=2, total_updates=6, manifest=str(example["manifest"]),
        data_root=str(example["root"]), save_every=3,
    )  # fmt: skip
    run = Run.open(tmp_path / "run", cfg, code_dir=example["code"])
    model, opt = _model()
    run.track(model=model, optimizer=opt)
    saver = run._saver
    try:
        for done in range(1, 7):
            model[1](model[0](torch.randn(4, 256))).square().mean().backward()
            opt.step()
            if not saver.due(done):
                continue
            writer = saver._writer
            assert writer is not None and writer.alive, "no writer process was started by the third due()"
            if done == 6:  # this one goes to the writer, once it has started
                while not writer.ready():
                    time.sleep(0.01)
            saver.save(done)
            if done == 3:
                assert not writer._ready, "the save waited for the writer's start"
            saver.wait()
            assert bool(writer._mapped) == (done == 6), (
                "checkpoint-3 is the thread's, checkpoint-6 the writer's"
            )
            validate_complete(tmp_path / "run" / checkpoint_name(done))
    finally:
        run._end_segment(6)
        saver.close()
