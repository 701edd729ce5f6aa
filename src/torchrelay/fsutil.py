"""Durable file writes (temporary name, fsync, rename, fsync the folder) (bounded reads of files from elsewhere: util/records.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from torchrelay.errors import DiskFull

# The crash tests' moments between two steps of pack or prepare (armed explicitly: kill_points.py); the name stays
# here for the callers that import it with the file operations it sits between.
from torchrelay.kill_points import kill_point  # noqa: F401


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


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
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


# The bounded readers of untrusted files live in util/records.py (one owner); these names stay for their callers.
from torchrelay.util.records import JSON_LIMIT, parse_json, read_bounded, read_json  # noqa: E402,F401
