"""Durable file writes (temporary name, fsync, rename, fsync the folder) and bounded reads of files from elsewhere."""

from __future__ import annotations

import errno
import os
import signal
import stat
from pathlib import Path

from torchrelay.errors import DiskFull, IntegrityError, UnsafeInput

# Crash tests name a moment to be SIGKILLed at: "<phase>:<update>:<rank>" inside a save (checkpoint/commit.py),
# or a step of pack or prepare ("pack:marked").
KILL_ENV = "TORCHRELAY_TEST_KILL"


def kill_point(step: str) -> None:
    """A crash-test hook between two steps of pack or prepare: SIGKILL this process if KILL_ENV names `step`."""
    if os.environ.get(KILL_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_prefix(name: str) -> str:
    """How the temporary of an atomic write of `name` starts (the writer's pid follows)."""
    return f".{name}.tmp-"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a part."""
    path = Path(path)
    tmp = path.with_name(f"{temp_prefix(path.name)}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFull(
                f"no space left to write {path}", hint="free disk space; nothing was replaced"
            ) from exc
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode())


def read_bounded(path: str | os.PathLike[str], limit: int, *, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, refused naming `path` otherwise.

    For files that may come from elsewhere (a bundle, a hand edit): a symbolic link as the last part, a device
    (an endless /dev/zero), a pipe (a read that never returns) or a folder is refused before a byte is read.
    A missing file raises FileNotFoundError for the caller to word.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeInput(f"{path} ({what}) is a symbolic link; refusing to follow it") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafeInput(f"{path} ({what}) is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInput(f"{path} ({what}) is not a regular file; refusing to read it")
        if st.st_size > limit:
            raise IntegrityError(
                f"{path} ({what}) has {st.st_size:,} bytes, more than such a file can have ({limit:,})",
                hint="the file is damaged or not what it should be",
            )
        chunks = []
        left = limit + 1  # a file that grows while read is cut off at the limit, not followed forever
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise IntegrityError(f"{path} ({what}) grew past {limit:,} bytes while it was read")
    return data
