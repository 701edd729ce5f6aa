"""Durable file writes (temporary name, fsync, rename, fsync the folder) and bounded reads of files from elsewhere."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

from torchrelay import envvars
from torchrelay.errors import DiskFull, IntegrityError, UnsafeInput

# Crash tests name a moment to be SIGKILLed at: "<phase>:<update>:<rank>" inside a save (checkpoint/commit.py),
# or a step of pack or prepare ("pack:marked").
KILL_ENV = envvars.TEST_KILL.name


def kill_point(step: str) -> None:
    """A crash-test hook between two steps of pack or prepare: SIGKILL this process if KILL_ENV names `step`."""
    if envvars.TEST_KILL.text() == step:
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


def read_bounded(path: str | os.PathLike[str], limit: int, *, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, refused naming `path` otherwise.

    For files that may come from elsewhere (a bundle, a hand edit): a symbolic link as the last part, a device
    (an endless /dev/zero), a pipe (a read that never returns) or a folder is refused before a byte is read.
    A missing file or a folder raises FileNotFoundError or IsADirectoryError, as open() does, for the caller to
    word (`errors.from_exception`: a wrong path, exit 2).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeInput(f"{path} ({what}) is a symbolic link; refusing to follow it") from None
        if exc.errno == errno.ENXIO:
            raise UnsafeInput(f"{path} ({what}) is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # what open() says of a folder; the CLI and Run.open word it (exit 2)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInput(
                f"{path} ({what}) is not a regular file (a pipe or a device); refusing to read it"
            )
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


JSON_LIMIT = 256 << 20  # no JSON file torchrelay writes comes near this


def parse_json(data: bytes | str, *, source: str) -> Any:
    """JSON from bytes or text that may come from elsewhere; anything malformed is one IntegrityError naming
    `source` (bytes that are not UTF-8, bad syntax, numbers too long, nesting too deep for the parser)."""
    hint = "the file is damaged or not what it should be; restore it from a copy"
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise IntegrityError(
            f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})", hint=hint
        ) from None
    except RecursionError:
        raise IntegrityError(f"{source}: JSON nested too deeply to be a torchrelay file", hint=hint) from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more digits than Python converts
        raise IntegrityError(f"{source}: not valid JSON ({str(exc)[:200]})", hint=hint) from None


def read_json(path: str | os.PathLike[str], *, what: str, limit: int = JSON_LIMIT) -> Any:
    """A JSON file read as untrusted input: a regular file of bounded size, parsed by `parse_json`.
    A missing file raises FileNotFoundError for the caller to word."""
    return parse_json(read_bounded(path, limit, what=what), source=f"{path} ({what})")
