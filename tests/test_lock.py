"""One writer per run: a second training, a pack or a second controller on a run in use is refused, names the
holder and leaves the first untouched; a killed holder leaves no stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import clean_env, launch, launch_bg, segments, wait_for_update, write_config
from test_controller import CLI, launch_cli, write_plan
from torchrelay.cli import main
from torchrelay.controller.attempts import Attempts
from torchrelay.errors import RunBusy, UnsafeInput
from torchrelay.ledger.exposure import prove
from torchrelay.paths.lock import RunLock, holder
from torchrelay.paths.rundir import RunDir

HOLD = textwrap.dedent(
    """
    import sys, time
    from torchrelay.paths.lock import RunLock
    RunLock(sys.argv[1], sys.argv[2]).acquire(create_dir=True)
    print("held", flush=True)
    time.sleep(600)
    """
)


def hold_in_child(run_dir: Path, role: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), role], stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    child = hold_in_child(run, "train")
    try:
        seen = holder(run, "train")
        assert seen is not None and seen["pid"] == child.pid and seen["role"] == "train"
        with pytest.raises(RunBusy, match=rf"in use by a writer: pid {child.pid} on ") as info:
            RunLock(run, "train").acquire(wait_s=0.3)
        assert info.value.exit_code == 2 and "torchrelay stop" in str(info.value)
        assert holder(run, "launch") is None  # the roles are separate locks
        with RunLock(run, "launch"):
            assert holder(run, "launch")["pid"] == os.getpid()  # type: ignore[index]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # The kernel dropped the killed holder's lock: nothing stale to clean up.
    assert holder(run, "train") is None
    lock = RunLock(run, "train").acquire()
    lock.release()
    assert holder(run, "train") is None


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """DataLoader workers are forked from rank 0: they must not hold the run once rank 0 has gone."""
    lock = RunLock(tmp_path, "train").acquire()
    ready, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork hooks have run) outlives the parent's lock below
        os.write(go, b"1")
        time.sleep(3)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        lock.release()
        assert holder(tmp_path, "train") is None
        RunLock(tmp_path, "train").acquire().release()
    finally:
        os.waitpid(pid, 0)
        os.close(ready)
        os.close(go)


@pytest.mark.parametrize("role", ["train", "launch"])
def test_a_link_at_the_lock_is_refused_and_what_it_points_to_untouched(tmp_path: Path, role: str) -> None:
    """The lock's holder record truncates the file it opens: a planted link would empty a file outside the run."""
    run = tmp_path / "run"
    run.mkdir()
    precious = tmp_path / "outside" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("precious user data\n")
    lock = RunLock(run, role)
    lock.path.symlink_to(precious)
    with pytest.raises(UnsafeInput, match=r"lock\) is a symlink: remove it") as info:
        lock.acquire()
    assert str(lock.path) in info.value.message and info.value.exit_code == 2
    assert precious.read_text() == "precious user data\n"
    assert holder(run, role) is None


def test_a_pipe_at_the_lock_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ".torchrelay-train.lock")
    with pytest.raises(UnsafeInput, match="not a regular file"):
        RunLock(tmp_path, "train").acquire()


@pytest.mark.launch
def test_second_writer_is_refused_while_the_run_trains(example: dict[str, Path], tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "lm.yaml",
        example["manifest"],
        example["root"],
        total_updates=200,
        save_every=2,  # a checkpoint to pack early: each paced update before it costs a second
        # >= 190 s of training left after update 3 for the refusals below, even on a loaded 2-core machine (24
        # updates left 15 s, too few at load 20); a stop request ends it as soon as they are checked.
        **{"params.min_update_s": 1.0},
    )
    run = tmp_path / "run"
    first = launch_bg(example["code"], run, config=config)
    try:
        wait_for_update(run, 3, first)  # past checkpoint-2: something to pack
        status = subprocess.run(
            [*CLI, "status", str(run), "--json"], capture_output=True, text=True, env=clean_env()
        )
        state = json.loads(status.stdout)
        assert state["running"] and state["trained_by"]["command"], status.stdout

        pack = subprocess.run(
            [*CLI, "pack", str(run), str(tmp_path / "bundle"), "--code-dir", str(example["code"])],
            capture_output=True,
            text=True,
            env=clean_env(),
        )
        assert pack.returncode == 2 and "is in use by a writer" in pack.stderr, pack.stderr
        assert not (tmp_path / "bundle").exists()

        second = launch(example["code"], run, env={"TORCHRELAY_LOCK_WAIT_S": "0.5"})
        assert second.returncode != 0
        assert "is in use by a writer: pid" in second.stderr and "a second writer would fork" in second.stderr
        assert first.poll() is None, "the first run must still train for the refusals to mean anything"
        stop = subprocess.run([*CLI, "stop", str(run)], capture_output=True, text=True, env=clean_env())
        assert stop.returncode == 0, stop.stderr
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # The refused launch left no trace: one segment (stopped by the request), every sample exactly once.
    assert [s["ended"] for s in segments(run)] == ["request"]
    assert main(["status", str(run), "--last-exit"]) == 4  # what torchrun's folded exit 1 stood for
    assert prove(run).ok
    state = json.loads(
        subprocess.run([*CLI, "status", str(run), "--json"], capture_output=True, text=True).stdout
    )
    assert not state["running"] and state["trained_by"] is None and not state["ended_unrecorded"]


@pytest.mark.launch
def test_second_controller_is_refused_before_it_records_an_attempt(
    example: dict[str, Path], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "lm.yaml", example["manifest"], example["root"])
    run = tmp_path / "runs" / "lm"
    plan = write_plan(tmp_path / "plan.yaml", example["code"], config, run, smoke={"when": "never"})
    child = hold_in_child(run, "launch")  # a controller holding the run (its training not started yet)
    try:
        out = launch_cli(plan)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"in use by a controller: pid {child.pid}" in out.stderr
        assert Attempts(RunDir(run)).all() == [] and not run.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_a_pack_before_the_first_checkpoint_is_refused_as_in_use(
    example: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run training its first save: `pack` said "no complete checkpoint to pack" (exit 1), since it looked
    for a checkpoint before it took the lock (found under the process writer, whose first save committed after
    update 3); it is refused as in use, naming the holder (exit 2)."""
    from torchrelay import RelayConfig, Run

    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=4,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
    )
    run_dir = tmp_path / "run"
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        assert main(["pack", str(run_dir), str(tmp_path / "bundle")]) == 2
        assert f"is in use by a writer: pid {os.getpid()}" in capsys.readouterr().err
        run.exit_code = 0
    assert not (tmp_path / "bundle").exists()
