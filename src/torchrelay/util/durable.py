"""Durable file writes: a temporary name, fsync, rename, fsync the folder (bounded reads of untrusted files: records.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from torchrelay.errors import DiskFull


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


def remove_temps(paths: list[Path]) -> list[Path]:
    """Unlink the atomic-write temporaries among `paths` that a killed writer left (a file, or a link in its place);
    a directory of that name is no writer's and stays. Returns what was removed."""
    gone = []
    for p in paths:
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def remove_entry(path: Path) -> None:
    """Remove what is at `path`: a folder with its contents, or a file or a link itself, never what a link points
    to; best effort (what cannot be removed stays)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def open_temp(path: str | os.PathLike[str]) -> int:
    """A descriptor of the temporary `path` of an atomic write, emptied for writing; never through a link planted
    at its name (O_NOFOLLOW: it would write wherever the link points)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a part."""
    path = Path(path)
    tmp = path.with_name(f"{temp_prefix(path.name)}{os.getpid()}")
    try:
        with os.fdopen(open_temp(tmp), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if not tmp.is_symlink():  # a planted link is not this writer's to remove
            tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFull(
                f"no space left to write {path}", hint="free disk space; nothing was replaced"
            ) from exc
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode())
