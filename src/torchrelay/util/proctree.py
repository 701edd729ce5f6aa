"""Ending a process tree that torchrelay started, all of it: torchrun, its ranks and their loader workers.

A process-group kill is not enough: torchrun starts each rank in a session of its own, so `killpg` on torchrun's
group misses the ranks, and once torchrun is dead they are re-parented and no longer look like its descendants.
So the tree is collected before anything dies and re-collected while it lives; what survives the grace is
frozen (SIGSTOP: it can fork no more), collected once more, and killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import psutil


class Tree:
    """Every process seen under a root since it was first looked at (pid reuse is told apart by start time)."""

    def __init__(self, pid: int) -> None:
        self.root: psutil.Process | None = None
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            self.root = psutil.Process(pid)
            self._add(self.root)
        self.collect()

    def _add(self, proc: psutil.Process) -> None:
        with contextlib.suppress(psutil.Error):
            self.seen.setdefault((proc.pid, proc.create_time()), proc)

    def collect(self) -> None:
        """Add the descendants of every member still alive (also of one whose parent has died)."""
        children: dict[int, list[psutil.Process]] = {}
        for proc in psutil.process_iter(["ppid"]):  # one pass over /proc, however large the tree
            children.setdefault(proc.info["ppid"], []).append(proc)
        stack = [p.pid for p in self.alive()]  # alive: a dead member's pid may belong to a stranger now
        while stack:
            for child in children.get(stack.pop(), []):
                with contextlib.suppress(psutil.Error):
                    key = (child.pid, child.create_time())
                    if key not in self.seen:
                        self.seen[key] = child
                        stack.append(child.pid)

    def alive(self) -> list[psutil.Process]:
        """Members still running (a zombie whose threads have all ended only waits for its parent to reap it)."""
        return [p for p in self.seen.values() if _alive(p)]

    def send(self, signum: int) -> None:
        for proc in self.alive():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signum)

    def end(self, grace_s: float = 0.0, first: int = signal.SIGTERM, poll_s: float = 0.1) -> None:
        """End every member. With a grace, `first` goes to the root's process group (the root alone when it leads
        none; torchrun passes SIGTERM on to its ranks) and the tree gets `grace_s` seconds to exit; then every
        survivor is frozen and killed. The caller still reaps the root if it is its child."""
        if grace_s > 0 and self.root is not None and _alive(self.root):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(self.root.pid) == self.root.pid:
                    os.killpg(self.root.pid, first)
                else:
                    self.root.send_signal(first)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and self.alive():
                self.collect()
                time.sleep(poll_s)
        # Frozen processes cannot fork, so after a few rounds the collected tree is the whole tree.
        for _ in range(5):
            before = len(self.seen)
            self.send(signal.SIGSTOP)
            self.collect()
            if len(self.seen) == before:
                break
        self.send(signal.SIGKILL)
        end = time.monotonic() + 10
        while time.monotonic() < end and self.alive():
            time.sleep(0.02)


def _alive(proc: psutil.Process) -> bool:
    try:
        if not proc.is_running():
            return False
        if proc.status() != psutil.STATUS_ZOMBIE:
            return True
        # A zombie main thread whose other threads are still exiting (a rank's gloo threads, slow under load):
        # the process still holds its files, and the run's lock with them.
        return len(os.listdir(f"/proc/{proc.pid}/task")) > 1
    except (psutil.Error, OSError):
        return False


def end_tree(pid: int, grace_s: float = 0.0, first: int = signal.SIGTERM) -> Tree:
    """End `pid` and every process it started, however deep and in whatever session; returns what was seen."""
    tree = Tree(pid)
    tree.end(grace_s, first)
    return tree


def survivors(tree: Tree, wait_s: float = 0.0) -> list[psutil.Process]:
    """Members of `tree` (collected once more) still alive after up to `wait_s` seconds."""
    end = time.monotonic() + wait_s
    tree.collect()
    while tree.alive() and time.monotonic() < end:
        time.sleep(0.05)
    return tree.alive()


def run(
    args: Any, *, timeout: float, on_timeout: Callable[[Tree], None] | None = None, **popen: Any
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` whose timeout ends the command's whole tree before raising TimeoutExpired.

    subprocess.run kills only its child; a grandchild (what a shell started) lives on, holding the output pipe,
    and the call then waits for it past its own timeout. `on_timeout` is given the tree, still running, first
    (a test's look at where it hung).
    """
    with subprocess.Popen(args, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = Tree(proc.pid)
            if on_timeout is not None:
                on_timeout(tree)
            tree.end()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
