"""Stops and process lifecycles: any request file, chained signal handlers, loader workers that outlive the stop
signals but not their rank, deadlines fixed once per job, finished runs left alone, timeouts that end everything."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from helpers import PYTHON, clean_env, segments, torchrun_cmd
from torchrelay import RelayConfig, Run
from torchrelay.audit.runner import AuditError, subprocess_launcher
from torchrelay.controller.plan import CheckSpec
from torchrelay.controller.preflight import PreflightFailed, PreflightReport, run_user_check
from torchrelay.controller.supervisor import Supervisor
from torchrelay.data.loader import RelayLoader, main_unguarded, start_forkserver
from torchrelay.errors import EXIT_ERROR, EXIT_REQUEST, EXIT_SIGNAL, ConfigError, RelayError
from torchrelay.paths.lock import RunLock
from torchrelay.policy.stop import (
    REQUEST_MAX_BYTES,
    SignalFlag,
    StopContext,
    StopRequest,
    deadline_from_env,
    decide,
)
from torchrelay.util.proctree import Tree, survivors

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ------------------------------------------------------------------------------------------- request files
@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00garbage\x80\x81",  # not UTF-8
        b"\x00" * 100,  # binary zeros
        b"[1, 2, 3]",  # JSON, not an object
        b'{"job": {"nested": 1}, "at_update": "soon", "time": "x", "reason": 7}',  # wrong types
        b'{"at_update": 1e400}',  # a float, infinite
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser
        b"please stop this run",  # text that is no job id
    ],
)
def test_any_request_file_is_a_request_to_stop_never_a_crash(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "REQUEST_STOP"
    path.write_bytes(content)
    req = StopRequest.read(path)
    assert req is not None and req.job is None and req.at_update is None
    assert req.note and str(path) in req.note
    ctx = StopContext(updates_done=3, now=time.time(), job="77", request=req)
    verdict = decide(ctx)
    assert verdict is not None and verdict.code == EXIT_REQUEST


def test_huge_or_unreadable_request_files_are_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "REQUEST_STOP"
    with open(path, "wb") as f:
        f.truncate(8 * 2**30)  # 8 GiB, sparse: reading it whole would take the memory of the machine
    t0 = time.perf_counter()
    req = StopRequest.read(path)
    assert time.perf_counter() - t0 < 1.0
    assert req is not None and req.job is None and f"larger than {REQUEST_MAX_BYTES} bytes" in str(req.note)
    path.unlink()
    path.mkdir()  # a directory where the file should be
    req = StopRequest.read(path)
    assert req is not None and "cannot be read" in str(req.note)
    # Well-formed requests keep their meaning.
    path.rmdir()
    path.write_text(" 4242_7\n")
    assert StopRequest.read(path) == StopRequest("4242_7", None, "user", 0.0, "")
    path.write_text(json.dumps({"job": 12, "at_update": 5, "reason": "audit", "by": "me\x1b[31m"}))
    req = StopRequest.read(path)
    assert req is not None and (req.job, req.at_update, req.reason, req.by, req.note) == (
        "12",
        5,
        "audit",
        "me?[31m",
        None,
    )


# ------------------------------------------------------------------------------------------- signal handlers
def test_signal_handlers_are_chained_and_put_back() -> None:
    calls: list[int] = []

    def users(signum: int, frame: Any) -> None:
        calls.append(signum)

    before_usr1 = signal.signal(signal.SIGUSR1, users)
    before_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        flag = SignalFlag()
        flag.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == "SIGUSR1" and calls == [signal.SIGUSR1]  # the user's handler still runs
        os.kill(os.getpid(), signal.SIGTERM)  # its default action (death) is what a clean stop replaces
        assert flag.received == "SIGUSR1" and calls == [signal.SIGUSR1]
        flag.restore()
        assert (
            signal.getsignal(signal.SIGUSR1) is users and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        )
        # A handler installed over ours after install stays where it is.
        flag = SignalFlag()
        flag.install((signal.SIGUSR1,))
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)
        signal.signal(signal.SIGTERM, before_term)


# ------------------------------------------------------------------------------------------- in-process runs
def _train(
    run_dir: Path,
    example: dict[str, Path],
    total: int,
    hook: Any = None,
    save_every: int = 100,
    leave_at: int | None = None,
) -> tuple[Run, list[int]]:
    """A world-size-1 run in this process (the library's own code path; torchrun adds nothing here).
    `leave_at`: the script breaks out of the loop in that update, after its optimizer step."""
    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=total,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=save_every,
    )
    done: list[int] = []
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, _batch in step.micro_batches():
                model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step.update == leave_at:
                break
            done.append(step.update)
            if hook:
                hook(step.update)
    return run, done


def test_in_process_stops_garbage_request_chained_signal_and_a_finished_run(
    example: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    calls: list[int] = []

    def users(signum: int, frame: Any) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGUSR1, users)
    try:
        # A signal in update 2: the user's handler runs too, the run stops cleanly, the handler is back after.
        run, done = _train(run_dir, example, 4, lambda u: u == 2 and os.kill(os.getpid(), signal.SIGUSR1))
        assert (run.exit_code, run.ended, done, calls) == (EXIT_SIGNAL, "signal", [1, 2], [signal.SIGUSR1])
        assert signal.getsignal(signal.SIGUSR1) is users
    finally:
        signal.signal(signal.SIGUSR1, before)
    # Binary garbage in REQUEST_STOP: a stop at the first boundary, with a note, not a UnicodeDecodeError.
    (run_dir / "REQUEST_STOP").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + os.urandom(64))
    run, done = _train(run_dir, example, 4)
    assert (run.exit_code, done) == (EXIT_REQUEST, [])
    seg = segments(run_dir)[-1]
    assert seg["ended"] == "request" and any("is not UTF-8 text" in n for n in seg["notes"])
    assert not (run_dir / "REQUEST_STOP").exists()  # consumed, kept under train/stop-requests
    run, done = _train(run_dir, example, 4)
    assert (run.exit_code, done, len(segments(run_dir))) == (0, [3, 4], 3)
    # The finished run, launched again: says so, records nothing, exits 0.
    caplog.set_level(logging.INFO, logger="torchrelay")  # pytest's own handlers stand on the root logger here
    run, done = _train(run_dir, example, 4)
    assert (run.exit_code, done, len(segments(run_dir))) == (0, [], 3)
    assert "is finished (update 4 of 4): nothing to train, nothing recorded" in caplog.text
    held = RunLock(run_dir, "train").acquire(wait_s=0)
    assert held is not None  # and it let go of the run
    held.release()
    # A launch refused while opening, with no process group (one rank alone): recorded as a segment of its own,
    # as with many ranks, so `status --last-exit` reports the refusal and not the finish before it.
    with pytest.raises(RelayError, match="total_updates"):
        _train(run_dir, example, 5)
    assert len(segments(run_dir)) == 4 and segments(run_dir)[-1]["ended"] == "refused"


def test_a_script_that_leaves_the_loop_early_is_told_so_and_resumes_from_its_last_checkpoint(
    example: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `break` out of run.steps (no stop agreed, the schedule not ended) ends the run `error`, exit 1, with a
    warning that says so and what to do instead, recorded in the segment's notes; the next launch goes on from
    the newest complete checkpoint."""
    run_dir = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="torchrelay")
    run, done = _train(run_dir, example, 4, save_every=2, leave_at=3)
    assert done == [1, 2]
    assert (run.exit_code, run.ended) == (EXIT_ERROR, "error")
    assert (
        "left run.steps before the schedule's end or an agreed stop (after update 2)" in caplog.text
    )  # 3 never ended
    assert "request a stop" in caplog.text
    seg = segments(run_dir)[-1]
    assert seg["ended"] == "error" and any("left run.steps" in n for n in seg["notes"])
    run, done = _train(run_dir, example, 4)
    assert (run.exit_code, done) == (0, [3, 4])  # from checkpoint-2: update 3 again, then 4


def test_budget_counts_from_the_job_start_and_refuses_nonsense() -> None:
    start = 1_000.0
    d = deadline_from_env({"TORCHRELAY_BUDGET_S": "6"}, start)
    assert d is not None and d.at == 1_006.0 and "TORCHRELAY_BUDGET_S=6" in d.source
    d = deadline_from_env(
        {"TORCHRELAY_BUDGET_S": "60", "TORCHRELAY_DEADLINE": "1030", "SLURM_JOB_END_TIME": "1020"}, start
    )
    assert d is not None and d.at == 1_020.0 and d.source == "SLURM_JOB_END_TIME=1020"
    assert deadline_from_env({}, start) is None
    for bad in (
        {"TORCHRELAY_BUDGET_S": "soon"},
        {"TORCHRELAY_DEADLINE": "nan"},
        {"TORCHRELAY_BUDGET_S": "-1"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            deadline_from_env(bad, start)


# ------------------------------------------------------------------------------------------- loader workers
WORKERS_CHILD = """
import json, sys, time
import psutil, torch
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder
from torchrelay.policy.stop import SignalFlag


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i * i])


def batches():
    return RankBatches(GlobalOrder(num_samples=64, seed=5, global_batch=4), 0, 12, 0, 1, 4, 1)


if __name__ == "__main__":
    flag = SignalFlag()
    flag.install()
    expected = [(ids, [i * i for i in ids]) for ids in batches()]
    for nw, persistent, asked in json.loads(sys.argv[1]):
        flag.received = None
        loader = RelayLoader(Squares(), None, nw, persistent_workers=persistent, multiprocessing_context=asked)
        context, note = loader.context()
        it = loader.start(batches(), seed=1, context=context)
        got = [next(it)]
        kids = [p.pid for p in psutil.Process().children(recursive=True)]
        print("READY", nw, persistent, context, json.dumps(kids), flush=True)
        if sys.stdin.readline().strip() == "crash":
            raise RuntimeError("a crash with the loader's workers alive")
        got += list(it)  # meanwhile the test signalled this whole process group, as torchrun does
        same = [(ids, b.flatten().tolist()) for ids, b in got] == expected
        print("DONE", nw, persistent, flag.received, same, flush=True)
        del it
"""


def _child(script: Path, rounds: list[tuple[int, bool, str | None]]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, str(script), json.dumps(rounds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(PYTHONPATH=SRC),
        start_new_session=True,
    )


def _expect(child: subprocess.Popen[str], word: str) -> str:
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        if line.startswith(word):
            return line
        lines.append(line)
    raise AssertionError(f"no {word} from the child (exit {child.wait()}):\n" + "".join(lines))


@pytest.mark.full  # 5 rounds of real loader workers under signals: 35 s on a busy machine
def test_loader_workers_survive_stop_signals_and_end_with_their_rank(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(WORKERS_CHILD)
    # A rank that takes the stop signals and then crashes, and one that is killed outright. Forked workers (asked
    # for, or the default of this single-threaded process) are as safe from the signals as a forkserver's.
    rounds = [(0, False, None), (2, True, "forkserver"), (8, False, None), (2, False, "fork")]
    rounds.append((2, False, "forkserver"))
    signalled = _child(script, rounds)
    killed = _child(script, [(2, False, "forkserver")])
    trees = []
    try:
        for i, (nw_, _, asked) in enumerate(rounds):
            _, nw, _, context, kids = _expect(signalled, "READY").split(" ", 4)
            assert len(json.loads(kids)) >= int(nw)  # the workers (and a forkserver) are up
            assert int(nw) == nw_ and context == ("None" if nw_ == 0 else asked or "fork")
            assert signalled.stdin is not None
            if i == len(rounds) - 1:
                trees.append(Tree(signalled.pid))
                signalled.stdin.write("crash\n")  # its workers must not keep the rank from exiting
                signalled.stdin.flush()
                break
            os.killpg(signalled.pid, signal.SIGTERM)
            os.killpg(signalled.pid, signal.SIGUSR1)
            time.sleep(0.3)  # let the signals land in every process before the loader is asked for more
            signalled.stdin.write("\n")
            signalled.stdin.flush()
            done = _expect(signalled, "DONE").split()
            assert done[3] in ("SIGTERM", "SIGUSR1") and done[4] == "True", done
        assert signalled.wait(timeout=60) == 1
        _expect(killed, "READY")
        trees.append(Tree(killed.pid))
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        for tree in trees:
            assert len(tree.seen) >= 3 and survivors(tree, wait_s=10) == []
    finally:
        for child in (signalled, killed):
            if child.poll() is None:
                child.kill()
                child.wait()
        for tree in trees:
            tree.end()


ENDED_WORKER_CHILD = """
import os, signal, sys, time
import psutil, torch
from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i * i])


if __name__ == "__main__":
    loader = RelayLoader(Squares(), None, 2, multiprocessing_context=sys.argv[1])
    it = loader.start(RankBatches(GlobalOrder(num_samples=64, seed=5, global_batch=4), 0, 12, 0, 1, 4, 1), seed=1)
    next(it)
    worker = next(p for p in psutil.Process().children() if p.cmdline() == psutil.Process().cmdline())
    os.kill(worker.pid, signal.SIGTERM)  # the rank's own SIGTERM, as multiprocessing's exit handler sends it
    while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    _error_if_any_worker_fails()  # what torch's SIGCHLD handler runs in the rank (raises for a failed worker)
    print("QUIET", flush=True)
    os._exit(0)
"""


@pytest.mark.full  # a rank's real loader workers
@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_worker_its_rank_ends_exits_as_torch_workers_do_and_torch_reports_no_failure(
    tmp_path: Path, context: str
) -> None:
    """A worker ended by its rank's SIGTERM exits 0, as a plain torch worker does (torch reports one killed by the
    signal as failed too). Before the fix it exited with code 143, which torch's SIGCHLD check in the rank reports
    as 'DataLoader worker (pid N) exited unexpectedly with exit code 143': a second traceback at the exit of a rank
    whose collate or dataset raised in a worker (multiprocessing's exit handler terminates the workers still
    alive, then joins them), in about half of the probes' launches."""
    script = tmp_path / "child.py"
    script.write_text(ENDED_WORKER_CHILD)
    done = subprocess.run(
        [PYTHON, str(script), context],
        capture_output=True,
        text=True,
        env=clean_env(PYTHONPATH=SRC),
        timeout=120,
    )
    assert "exited unexpectedly" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "QUIET" and done.returncode == 0, done.stderr[-2000:]


def test_workers_start_from_a_forkserver_only_when_they_can(tmp_path: Path) -> None:
    guarded = tmp_path / "guarded.py"
    guarded.write_text("import os\n\ndef main():\n    pass\n\nif '__main__' == __name__:\n    main()\n")
    loose = tmp_path / "loose.py"
    loose.write_text("import os\nprint('training at import time')\n")
    main = sys.modules["__main__"]
    saved = getattr(main, "__file__", None)
    try:
        main.__file__ = str(guarded)
        assert main_unguarded() is None
        # Another thread running Python (a reporter's writer, a persist): a forkserver; none: a fork, as DataLoader's.
        assert RelayLoader(list(range(8)), None, 2).context(others=["writer"]) == ("forkserver", None)
        assert RelayLoader(list(range(8)), None, 2).context(others=[]) == ("fork", None)
        assert not start_forkserver(2, others=[])  # nor is a server started early for it
        # A dataset that cannot be pickled into a worker: fork, and a note saying why; asked for: refused.
        loader = RelayLoader([lambda: 1], None, 2)
        context, note = loader.context(others=["writer"])
        assert context == "fork" and note is not None and "cannot be pickled" in note
        assert loader.context(others=[]) == ("fork", None)
        loader.multiprocessing_context = "forkserver"
        with pytest.raises(ConfigError, match="cannot be pickled"):
            loader.context(others=[])
        main.__file__ = str(loose)
        assert "has no `if __name__" in str(main_unguarded())
        assert RelayLoader(list(range(8)), None, 2).context(others=["writer"])[0] == "fork"
        assert not start_forkserver(2, others=["writer"])  # the workers will be forked: no server
        assert RelayLoader(list(range(8)), None, 0).context() == (None, None)
    finally:
        main.__file__ = saved  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------- timeouts
TREE_CHILD = """
import os, signal, subprocess, sys, time
# Like torchrun's ranks: a session of their own, and a SIGTERM that does not end them.
grandchild = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"]
child = subprocess.Popen(
    [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({grandchild!r}); time.sleep(120)"],
    start_new_session=True,
)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


@pytest.mark.launch
def test_timeouts_end_every_process_they_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    started = time.time()

    def tree_is_up(seconds: float) -> bool:
        if not pidfile.exists() or not pidfile.read_text():
            return seconds > 60
        return len(psutil.Process(int(pidfile.read_text())).children()) == 1

    with pytest.raises(AuditError, match="ran past"):
        subprocess_launcher(
            [PYTHON, "-c", TREE_CHILD, str(pidfile)],
            clean_env(),
            tmp_path / "log",
            60,
            grace_s=0.5,
            timed_out=tree_is_up,
        )
    child = psutil.Process(int(pidfile.read_text()))  # (NoSuchProcess here would mean it is gone already)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    orphans = [
        p
        for p in psutil.process_iter(["cmdline", "create_time"])
        if "time.sleep(120)" in " ".join(p.info["cmdline"] or []) and p.info["create_time"] >= started - 1
    ]
    assert [p for p in orphans if p.status() != psutil.STATUS_ZOMBIE] == []
    # A preflight check whose shell started a child: the timeout ends both, and does not wait for the child.
    t0 = time.time()
    check = CheckSpec(name="slow", run=f"sleep 30 & echo $! > {tmp_path / 'bg'}; sleep 30", timeout_s=1)
    with pytest.raises(PreflightFailed, match="timed out after 1s"):
        run_user_check(check, tmp_path, clean_env(), PreflightReport())
    assert time.time() - t0 < 10
    assert (
        not psutil.pid_exists(int((tmp_path / "bg").read_text()))
        or psutil.Process(int((tmp_path / "bg").read_text())).status() == psutil.STATUS_ZOMBIE
    )


LEAVER = """
import subprocess, sys, time
# Like a rank whose torchrun died: a session of its own, alive after the command it belongs to has ended.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(1.0)
"""


@pytest.mark.launch
def test_the_supervisor_ends_what_outlives_its_command(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    sup = Supervisor(argv=[PYTHON, "-c", LEAVER, str(pidfile)], cwd=tmp_path, env=clean_env(), poll_s=0.05)
    assert sup.run().returncode == 0
    left = psutil.Process(int(pidfile.read_text()))  # NoSuchProcess would do too: it is gone
    assert not left.is_running() or left.status() == psutil.STATUS_ZOMBIE


# ------------------------------------------------------------------------------------------- real torchrun
def _sleeping(pid: int) -> bool:
    """The process sleeps in nanosleep (Python's time.sleep), as the kernel says (wchan, else the syscall number)."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        if wchan not in ("", "0"):
            return "nanosleep" in wchan
        number = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return False
    return number in ("35", "230", "101", "115")  # nanosleep, clock_nanosleep: x86-64, then aarch64


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.launch
def test_a_restart_keeps_the_deadline_and_a_timeout_ends_every_process(
    example: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # torchrun restarts the rank once: its first attempt crashes at update 1, the second hangs (a 1000 s update)
    # with two loader workers until the launch's timeout ends everything. One rank: with two, torch 2.13's
    # restarted ranks sometimes read the dead attempt's gloo address from the agent's store (its race, not ours).
    sets = {"params.crash_at_update": 1, "params.min_update_s": 1000, "num_workers": 2}
    cmd = torchrun_cmd(example["code"], run, nproc=1, config=example["config"], sets=sets)
    cmd.insert(1, "--max-restarts=1")
    seen: dict[str, Tree] = {}

    def second_attempt_hangs(seconds: float) -> bool:
        """True once the restarted rank sleeps in its first update, its workers up (or after 5 minutes)."""
        # the launch is this process's torchrun child (not, e.g., a resource tracker an earlier test left)
        launches = [p for p in psutil.Process().children() if "torchrun" in _cmdline(p)]
        if not launches or seconds > 300:
            return seconds > 300
        tree = seen.setdefault("tree", Tree(launches[0].pid))
        tree.collect()
        if not (run / "history.jsonl").exists() or len(segments(run)) < 2:
            return False
        procs = [(p, " ".join(p.cmdline())) for p in tree.alive()]
        ranks = [p for p, cmd in procs if "train_lm.py" in cmd and p.ppid() == launches[0].pid]
        # forked from the rank (it runs no other Python thread), or from a forkserver
        workers = [p for p, cmd in procs if p.ppid() in {r.pid for r in ranks} or "forkserver" in cmd]
        return len(workers) >= 2 and any(_sleeping(r.pid) for r in ranks)

    env = clean_env(TORCHRELAY_BUDGET_S="600")
    with pytest.raises(AuditError, match="ran past"):
        subprocess_launcher(cmd, env, tmp_path / "log", 600, grace_s=2.0, timed_out=second_attempt_hangs)
    log = (tmp_path / "log").read_text()
    tree = seen["tree"]
    assert tree.root is not None and len(tree.seen) >= 5, log  # torchrun, 2 ranks, their workers
    # Nothing the launch started is left, and nothing holds the run.
    assert survivors(tree) == []
    RunLock(run, "train").acquire(wait_s=0).release()  # RunBusy if a rank were still alive
    # One deadline for the job, counted from torchrun's start: not from the rank's start, and not again for
    # the restarted rank (which would have had 600 s of its own).
    first, second = segments(run)
    assert (first["ended"], second["ended"]) == ("error", "running"), log
    agent_start = tree.root.create_time()
    assert first["deadline"] == second["deadline"] == pytest.approx(agent_start + 600, abs=0.05)
    assert first["deadline"] < first["started"] + 600
    assert "TORCHRELAY_BUDGET_S=600 from the job's start" in log
