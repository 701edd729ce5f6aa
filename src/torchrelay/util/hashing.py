"""The one SHA-256 of files: big reused buffers, no copies, threads (hashlib drops the GIL).

Used by the checkpoint inventory (write and check), the manifest, the contract, pack, verify and resume."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchrelay.errors import IntegrityError

# 1 MiB: large enough that Python overhead vanishes, small enough that each block is still in L2 when hashed.
BLOCK = 1 << 20

ByteCallback = Callable[[int], None]

_local = threading.local()


def canonical_json(obj: Any) -> str:
    """The one serialization that is hashed: sorted keys, no spaces, UTF-8 (contract, manifest, code keys)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_json(obj: Any) -> str:
    """Hex SHA-256 of `canonical_json(obj)`."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def thread_buffer(size: int = BLOCK) -> bytearray:
    """One reusable buffer per thread, so hashing a thousand files allocates nothing."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) != size:
        buf = bytearray(size)
        _local.buf = buf
    return buf


def sha256_file(path: Path, on_bytes: ByteCallback | None = None) -> tuple[str, int]:
    """Return (hex SHA-256, size in bytes) of the file, reading each byte once; a pipe or a device (a file of a
    bundle may be one) raises OSError at once instead of blocking the open or reading forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # no effect on a regular file's reads
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):  # what open() says of a folder
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise OSError(errno.EINVAL, "not a regular file (a pipe or a device)", str(path))
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size >= MAP_MIN:
            try:
                return _sha256_mapped(f.fileno(), size, on_bytes), size
            except (OSError, ValueError):
                f.seek(0)  # a filesystem that cannot map: read it instead
        return _sha256_read(f, on_bytes)


# Files from this size on are hashed through a read-only mapping: the page cache is hashed in place,
# which saves the copy into a buffer (about a tenth of the time per byte next to SHA-256 itself).
MAP_MIN = 1 << 20
_MAP_CHUNK = 16 << 20  # progress granularity; large enough that the GIL round trips do not show
MAP_FLAGS = mmap.MAP_SHARED


def _sha256_mapped(fd: int, size: int, on_bytes: ByteCallback | None) -> str:
    digest = hashlib.sha256()
    with mmap.mmap(fd, size, flags=MAP_FLAGS, prot=mmap.PROT_READ) as mapped:
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        drop = hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED")
        view = memoryview(mapped)
        try:
            for offset in range(0, size, _MAP_CHUNK):
                chunk = view[offset : offset + _MAP_CHUNK]
                digest.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
                if drop:
                    # Hashed pages leave this process's RSS (they stay in the page cache): hashing a 70 GB checkpoint
                    # must not look like 70 GB of memory to a memory guard (psutil RSS) or to ru_maxrss.
                    mapped.madvise(mmap.MADV_DONTNEED, offset, len(chunk))
                chunk.release()
        finally:
            view.release()
    return digest.hexdigest()


def _sha256_read(f: Any, on_bytes: ByteCallback | None) -> tuple[str, int]:
    buf = thread_buffer()
    view = memoryview(buf)
    digest = hashlib.sha256()
    size = 0
    _advise_sequential(f.fileno())
    while True:
        n = f.readinto(buf)
        if not n:
            break
        digest.update(view[:n])
        size += n
        if on_bytes is not None:
            on_bytes(n)
    return digest.hexdigest(), size


def sha256_hex(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of one file; an unreadable file is an IntegrityError naming it."""
    try:
        return sha256_file(Path(path))[0]
    except OSError as exc:
        raise IntegrityError(f"cannot read {path}: {exc.strerror or exc}") from exc


def sha256_or_none(path: str | os.PathLike[str]) -> str | None:
    """Hex SHA-256 of a regular file; None for one gone, unreadable, not regular, or reached through '..'.

    The paths may come from a recorded contract (from a bundle): a device or a pipe must never be read (forever),
    and a path climbing out with '..' never read at all; either differs from any recorded content.
    """
    if ".." in Path(path).parts:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe must not block the open
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", buffering=0, closefd=False) as f:
            return _sha256_read(f, None)[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def sha256_many(
    paths: Iterable[Path], *, jobs: int | None = None, on_bytes: ByteCallback | None = None
) -> dict[Path, tuple[str, int]]:
    """{path: (hex SHA-256, size)} of many files, hashed on `jobs` threads (one per core by default).

    Largest first, so one big file does not start last and leave the other threads idle."""
    todo = list(paths)
    workers = max(1, jobs or default_jobs())
    if workers == 1 or len(todo) <= 1:
        return {p: sha256_file(p, on_bytes) for p in todo}
    todo.sort(key=_size_or_zero, reverse=True)
    with ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="sha256") as pool:
        return dict(zip(todo, pool.map(lambda p: sha256_file(p, on_bytes), todo), strict=True))


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of an in-memory payload."""
    return hashlib.sha256(data).hexdigest()


def default_jobs() -> int:
    """One hashing thread per usable core: SHA-256 is CPU bound once the page cache is warm."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _advise_sequential(fd: int) -> None:
    # readahead helps a cold cache; harmless when warm. Not every platform has it.
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
