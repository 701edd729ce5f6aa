"""Run one training command and watch it: memory guard, forwarded stop signals, a last-resort deadline.

torchrun turns SIGUSR1 into its own death and does not pass it on, so a stop signal meant for the ranks is sent to
torchrun's children (the rank processes) — only once they are ready (their handlers are installed when the run
has opened), because a rank still importing torch would die of it. On several nodes the command is `srun`, which
forwards the signal to one copy of this module per node (`python -m torchrelay.controller.supervisor`), and each
of those forwards it to its own torchrun's ranks and guards its node's memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from torchrelay.controller.memguard import GIB, HARD, SOFT, MemoryGuard, MemoryLimits, tree_rss
from torchrelay.controller.torchrun import TorchrunOutput
from torchrelay.errors import RelayError
from torchrelay.log import logger
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import write_request
from torchrelay.records.history import read_history
from torchrelay.records.train import metrics_path
from torchrelay.util.proctree import Tree, survivors
from torchrelay.util.safepath import open_regular

# How long after a forwarded clean-stop signal, or after the hard deadline, before the tree is killed.
KILL_GRACE_S = 60.0


@dataclass(slots=True)
class Supervised:
    """What happened while a command ran."""

    returncode: int
    wall_s: float
    peak_rss: int = 0
    memory: str = ""  # "" | "soft" (stop requested) | "hard" (tree killed)
    signals: list[str] = field(default_factory=list)  # signals forwarded to the ranks
    killed: str = ""  # why the tree was killed, if it was
    tail: list[str] = field(default_factory=list)  # the last lines of output


@dataclass(kw_only=True, slots=True)
class Supervisor:
    """Runs `argv` in its own session; `stop(sig)` may be called from a signal handler."""

    argv: Sequence[str]
    cwd: str | os.PathLike[str]
    env: dict[str, str]
    run_directory: RunDir | None = None  # where a memory stop request is written
    limits: MemoryLimits | None = None
    poll_s: float = 0.5
    ranks_ready: Callable[[], bool] = lambda: True
    on_poll: Callable[[], None] = lambda: None  # called every poll while the command runs
    segment_ended: Callable[[], bool] = lambda: (
        False
    )  # the run has recorded its end: the ranks should exit now
    exit_grace_s: float = 20.0
    forward_to: str = "children"  # "children": the ranks under torchrun; "self": srun forwards it on
    kill_at: float | None = None  # unix time after which a still-running tree is stopped, then killed
    kill_grace_s: float = KILL_GRACE_S  # from a forwarded stop signal to the kill
    job: str | None = None
    output: IO[str] | None = None  # where the command's output is echoed (default: stdout)
    log: Callable[[str], None] = logger.warning
    _proc: subprocess.Popen[str] | None = None
    _pending: list[int] = field(default_factory=list)
    _sent: list[str] = field(default_factory=list)
    _term_sent_at: float | None = None

    def stop(self, signum: int) -> None:
        """Ask the ranks to stop cleanly with `signum` (delivered as soon as they can take it)."""
        self._pending.append(signum)

    def run(self) -> Supervised:
        start = time.time()
        guard = MemoryGuard(self.limits) if self.limits else None
        tail: collections.deque[str] = collections.deque(maxlen=200)
        argv = list(self.argv)
        if self.forward_to == "children":
            # torchrun dies of SIGUSR1 (the default action), and Slurm signals every process of a job step
            # (srun's forwarding, `scancel --signal`): torchrun would be gone while its ranks save, and they would
            # be ended as its survivors. Ignored, it waits for them; an ignored signal stays ignored across exec,
            # and the ranks install their own handler when the run opens.
            argv = ["/bin/sh", "-c", 'trap "" USR1; exec "$@"', "torchrelay-ignore-usr1", *argv]
        proc = subprocess.Popen(
            argv,
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches us, and we decide what the ranks get
        )
        self._proc = proc
        # Every process the command starts, collected while it runs: one that outlives it (a rank whose torchrun
        # died) is still found and ended below.
        tree = Tree(proc.pid)
        reader = threading.Thread(
            target=_pump, args=(proc.stdout, self.output or sys.stdout, tail), daemon=True
        )
        reader.start()
        memory, killed = "", ""
        request_written = False
        ended_at: float | None = None
        while proc.poll() is None:
            tree.collect()
            self.on_poll()
            if self._pending and self._deliver():
                self._term_sent_at = self._term_sent_at or time.time()
            if guard is not None:
                rss = tree_rss(proc.pid)
                verdict = guard.observe(rss)
                if verdict == SOFT:
                    memory = SOFT
                    self.log(
                        f"torchrelay: memory guard: training tree uses {rss / GIB:.2f} GiB >= soft limit "
                        f"{guard.limits.soft_bytes / GIB:.2f} GiB: asking for a clean stop"
                    )
                elif verdict == HARD:
                    memory = HARD
                    killed = f"training tree uses {rss / GIB:.2f} GiB >= hard limit {guard.limits.hard_bytes / GIB:.2f} GiB"
                    self.log(f"torchrelay: memory guard: {killed}: killing the training process tree")
                    tree.end()
                    break
            # Before the run exists a request would make its directory non-empty: wait for it.
            if memory == SOFT and not request_written and self.run_directory and self.run_directory.exists():
                write_request(self.run_directory.path, job=self.job, reason="memory")
                request_written = True
            now = time.time()
            if ended_at is None and self.segment_ended():
                ended_at = now
            if ended_at is not None and now - ended_at > self.exit_grace_s:
                # The history is final and every checkpoint committed; a rank stuck in teardown only burns time.
                killed = f"a rank was still alive {self.exit_grace_s:g}s after the run recorded its end"
                self.log(f"torchrelay: {killed}: killing the training process tree")
                tree.end()
                break
            if self.kill_at is not None and now > self.kill_at and self._term_sent_at is None:
                self.log("torchrelay: past the deadline and still running: sending SIGTERM to the ranks")
                self.stop(signal.SIGTERM)
                self._term_sent_at = now
            if self._term_sent_at is not None and now - self._term_sent_at > self.kill_grace_s:
                killed = f"still running {self.kill_grace_s:g}s after a stop signal"
                self.log(f"torchrelay: {killed}: killing the training process tree")
                tree.end()
                break
            time.sleep(self.poll_s)
        returncode = proc.wait()
        # Loader workers and forkservers exit right after their rank; anything still there after that is stray.
        left = survivors(tree, wait_s=3.0)
        if left:
            self.log(f"torchrelay: {len(left)} process(es) of the command outlived it: killing them")
            tree.end()
        reader.join(timeout=5)
        self._proc = None
        return Supervised(
            returncode=returncode,
            wall_s=time.time() - start,
            peak_rss=guard.peak if guard else 0,
            memory=memory,
            signals=list(self._sent),
            killed=killed,
            tail=list(tail),
        )

    def _deliver(self) -> bool:
        """Send pending signals when the ranks can take them; True when sent."""
        proc = self._proc
        if proc is None or not self.ranks_ready():
            return False
        targets: list[Any]
        try:
            root = psutil.Process(proc.pid)
            targets = [root] if self.forward_to == "self" else root.children(recursive=False)
        except psutil.NoSuchProcess:
            return False
        if not targets:
            return False
        while self._pending:
            signum = self._pending.pop(0)
            name = signal.Signals(signum).name
            for target in targets:
                try:
                    target.send_signal(signum)
                except psutil.NoSuchProcess:
                    continue
            self._sent.append(name)
            self.log(f"torchrelay: forwarded {name} to {len(targets)} process(es)")
        return True


def _pump(stream: IO[str] | None, out: IO[str], tail: collections.deque[str]) -> None:
    if stream is None:
        return
    # The tail keeps every line (the outcome reads torchrun's exit codes in it); what is shown leaves out torchrun's
    # failure report of a planned stop (controller/torchrun.py). TorchrunOutput survives a closed output: the child
    # is drained to its end and never blocks.
    shown = TorchrunOutput(out)
    for line in stream:
        tail.append(line.rstrip("\n"))
        shown.write(line)
    shown.close()


class SignalRelay:
    """Installs handlers that hand SIGUSR1/SIGTERM (and Ctrl-C as SIGTERM) to whatever runs now."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[str] = []
        self.current: Supervisor | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalRelay:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.current is not None:
            self.current.stop(signal.SIGTERM if signum == signal.SIGINT else signum)

    @property
    def stopped(self) -> bool:
        return bool(self.received)


def first_update_done(run: RunDir, since: float) -> Callable[[], bool]:
    """True once a segment started after `since` is running and rank 0 has logged its first update.

    Then the ranks' signal handlers are in place, and a stop makes progress: every job of a requeued chain moves
    the run forward by at least one update (no endless requeues that only restart), and no checkpoint is written
    at the update the segment resumed from.
    """
    run_dir = run.path
    ready = False

    def check() -> bool:
        nonlocal ready
        if ready:
            return True
        mine = [
            s
            for s in read_history(run_dir)
            if float(s.get("started") or 0) >= since - 1 and s.get("ended") == "running"
        ]
        if mine:
            last = last_logged_update(metrics_path(run.train_dir, 0))
            ready = last is not None and last >= int(mine[-1].get("first_update") or 1)
        return ready

    return check


def last_logged_update(path: Path) -> int | None:
    """The update of the last complete line of a metrics log (reads only its tail)."""
    try:
        fd, _ = open_regular(path, what=path.name)  # no link, no pipe: the controller must not block on one
    except (OSError, RelayError):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["update"])
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a torn last line, or the tail's cut first line
    return None


def segment_ended(run: RunDir, since: float) -> Callable[[], bool]:
    """True once a history segment started after `since` has recorded how it ended."""
    run_dir = run.path

    def ended() -> bool:
        return any(
            float(s.get("started") or 0) >= since - 1 and s.get("ended") not in (None, "running")
            for s in read_history(run_dir)
        )

    return ended


def node_main(argv: Sequence[str] | None = None) -> int:
    """`python -m torchrelay.controller.supervisor [--run-dir D] -- CMD...`: the per-node agent under srun."""
    parser = argparse.ArgumentParser(prog="python -m torchrelay.controller.supervisor")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--soft-gib", type=float, default=0.0)
    parser.add_argument("--hard-gib", type=float, default=0.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    node_rank = os.environ.get("SLURM_NODEID", "0")
    command = [a.replace("{SLURM_NODEID}", node_rank) for a in command]
    limits = None
    if args.soft_gib > 0:
        limits = MemoryLimits(
            soft_bytes=int(args.soft_gib * GIB), hard_bytes=int(max(args.hard_gib, args.soft_gib) * GIB)
        )
    run = RunDir(args.run_dir) if args.run_dir else None
    started = time.time()
    sup = Supervisor(
        argv=command,
        cwd=os.getcwd(),
        env=dict(os.environ),
        run_directory=run,
        limits=limits,
        job=os.environ.get("SLURM_JOB_ID"),
        ranks_ready=first_update_done(run, started) if run else (lambda: True),
        segment_ended=segment_ended(run, started) if run else (lambda: False),
    )
    with SignalRelay() as relay:
        relay.current = sup
        return sup.run().returncode


if __name__ == "__main__":
    sys.exit(node_main())
