"""One writer per run: an exclusive lock on the run directory for as long as a process trains or launches it.

Two trainings writing one run directory would interleave checkpoints, logs and history: a fork without a trace.
Rank 0 of a training holds `.torchrelay-train.lock` in the run directory and a controller (`torchrelay launch`)
holds `.<run>.launch.lock` beside it, each through `flock(2)`: the kernel drops the lock when its holder dies, so a
killed run never leaves a stale lock behind. The file also says who holds it, for the error and for `status`.
On a filesystem without `flock` the lock is skipped with a warning; nothing else depends on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError, RunBusy
from torchrelay.log import logger
from torchrelay.paths.layout import TRAIN_LOCK
from torchrelay.util.safepath import open_writable


def lock_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Training locks inside the run; a controller beside it, next to its staged attempts (the run may not exist)."""
    run_dir = Path(run_dir)
    if role == "train":
        return run_dir / TRAIN_LOCK
    if role == "launch":
        return run_dir.parent / f".{run_dir.name}.launch.lock"
    raise ValueError(f"unknown lock role {role!r}")


_HELD: set[int] = (
    set()
)  # descriptors this process locked; a forked child (a DataLoader worker) lets go of them


def _drop_inherited() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)  # closes the child's copy only: the parent's lock stays
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited)


class RunLock:
    """`with RunLock(run_dir, "train"):` holds the run for this process, or raises RunBusy naming the holder."""

    def __init__(self, run_dir: str | os.PathLike[str], role: str) -> None:
        self.run_dir = Path(run_dir)
        self.role = role
        self.path = lock_path(self.run_dir, role)
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0, create_dir: bool = False) -> RunLock:
        if self._fd is not None:  # held already (a second flock on a new descriptor would fight our own)
            return self
        if create_dir:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.parent.is_dir():
            raise ConfigError(f"{self.path.parent} does not exist", hint="check the run directory's path")
        # a link planted at the lock's name is refused, never followed: the record below truncates what it opens
        fd = open_writable(self.path, what=f"the run's {self.role} lock")
        give_up = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < give_up:
                    time.sleep(0.1)
                    continue
                holder = _read(fd)
                os.close(fd)
                raise RunBusy(self.run_dir, self.role, holder, describe(holder)) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                os.close(fd)
                logger.warning(f"[torchrelay] {self.path}: no flock here ({exc}); running unlocked")
                return self
        record = {
            "role": self.role,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        _HELD.add(fd)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # the record of a holder that has gone
        os.close(fd)  # closing the last descriptor releases the lock

    def __enter__(self) -> RunLock:
        return self.acquire(create_dir=True)

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder(run_dir: str | os.PathLike[str], role: str) -> dict[str, Any] | None:
    """Who holds the run for `role` now (pid, host, job, since, command), or None when nobody does."""
    path = lock_path(run_dir, role)
    try:  # a lock file is ours: a link or a pipe in its place is nobody's lock (and must not block `status`)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {"role": role}
    except OSError:
        return None
    else:
        return None
    finally:
        os.close(fd)


def describe(holder: dict[str, Any], command: bool = True) -> str:
    """One line about a holder: pid, host, Slurm job, since when and (optionally) what it runs."""
    if not holder.get("pid"):
        return "another process (it has not said who yet)"
    text = f"pid {holder['pid']} on {holder.get('host', '?')}"
    if holder.get("job"):
        text += f" (Slurm job {holder['job']})"
    if holder.get("since"):
        text += f" since {holder['since']}"
    if command and holder.get("command"):
        text += f", running `{holder['command']}`"
    return text


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, nested past the parser
        return {}
    return data if isinstance(data, dict) else {}
