"""The host memory of a verified load: the bytes a rank may hold, how the reads spread within them, and the slabs
that hold the files' bytes."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
from typing import Any

import torch

from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import ConfigError
from torchrelay.util.meminfo import meminfo_kib

_FALLBACK_BUFFER = 4 << 30  # where /proc/meminfo is not there to read
# Tried and removed (each lost to the default on the GPU hosts): O_DIRECT reads, prefaulting
# slabs ahead of the reads, huge pages, page-locked slabs, fadvise, largest-first and fill-first orders.
_MADV_DONTNEED = 4
_FREE_STEP = 256 << 20
# The size of a slab holding many small files (a slab is at least the largest file, so holds any file whole).
_SLAB = 256 << 20
_ALIGN = 4096


def load_budget(tuning: LoadTuning) -> int:
    """The bytes of host memory this rank's load may hold at once: `load_buffer` when set, else `memory_share` of
    MemAvailable over the node's ranks (LOCAL_WORLD_SIZE, 1 outside torchrun)."""
    if tuning.load_buffer > 0:
        return tuning.load_buffer
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={text!r}: not a positive integer; unset it or give the number of ranks on this node"
        )
    available = _mem_available()
    if available is None:
        return _FALLBACK_BUFFER
    return max(1, int(available * tuning.memory_share) // int(text))


def files_at_once(tuning: LoadTuning, largest: int, budget: int) -> int:
    """The files the shared-chunk reads spread over at once: `files_at_once`, fewer where `budget` holds fewer
    files of the `largest` size (one room kept for the next file)."""
    room = max(1, budget // max(1, largest))
    return max(1, min(tuning.files_at_once, room - 1))


def reads_per_file(tuning: LoadTuning, files: int, largest: int, budget: int) -> bool:
    """Whether each reading thread reads whole files (`per_file_reader`; where it is None: wherever `budget` holds
    a file of the `largest` size for each reading thread, or each of the `files` where they are fewer)."""
    if tuning.per_file_reader is not None:
        return tuning.per_file_reader
    return min(tuning.read_streams, files) * _aligned(largest) <= budget


def slab_size(largest: int, total: int, budget: int) -> int:
    """The size of each slab: the `largest` file at least, else the least of the files' `total`, the `budget`
    and _SLAB, aligned."""
    return _aligned(max(largest, min(total, budget, _SLAB)))


def slabs_budget(tuning: LoadTuning, budget: int, slab: int, reading: int, largest: int) -> int:
    """The bytes of slabs the load may take: `budget`, less where `reuse_slabs` and `rooms_ahead` >= 0 (no more
    new memory than the `reading` files of the `largest` size and the rooms ahead use)."""
    ahead = tuning.rooms_ahead
    if not (tuning.reuse_slabs and ahead >= 0 and slab):
        return budget
    # in whole slabs, two at least: a slab of small files is reused only once all of them are done
    wanted = max(2 * slab, (reading + ahead) * _aligned(largest))
    return min(budget, -(-wanted // slab) * slab)


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none (not Linux)."""
    got = meminfo_kib("MemAvailable")
    return None if got is None else got["MemAvailable"] * 1024


class _Slab:
    """Host memory holding whole files one after another; its room is handed out again once they are all done."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mapping: mmap.mmap | None = None
        if hasattr(mmap, "MAP_PRIVATE"):
            # a private anonymous mapping of its own, unmapped by `free` without the interpreter's lock (a
            # torch.empty buffer is freed holding it, and the thread returning from the load waited for it)
            self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            self.data = torch.frombuffer(
                self.mapping, dtype=torch.uint8
            )  # not zero-filled: read over before use
            self.base = self.data.data_ptr()
        else:
            self.data = torch.empty(size, dtype=torch.uint8)
        self.view = self.data.numpy().data.cast("B")
        self.top = 0  # bytes handed out
        self.files = 0  # files holding bytes of it

    def free(self) -> None:
        """Give the memory back (the load is done with it). A mapping nothing else views any more has its pages
        dropped by madvise(MADV_DONTNEED) in _FREE_STEP pieces, each call without the interpreter's lock, so that
        its unmapping then is quick: an unmapping frees every page holding the lock, while the thread returning
        from the load (or the loop after it) waits. A view still held somewhere
        (a traceback's frame) keeps the mapping whole until its last reference goes."""
        with contextlib.suppress(BufferError):
            self.view.release()
        del self.data  # the tensor's storage held the mapping: now only this slab does, unless a view is out
        mapping, self.mapping = self.mapping, None
        if mapping is None or sys.getrefcount(mapping) > 2:  # this name and getrefcount's argument
            return
        with contextlib.suppress(AttributeError, OSError):
            libc = _libc()
            for off in range(0, self.size, _FREE_STEP):
                libc.madvise(self.base + off, min(_FREE_STEP, self.size - off), _MADV_DONTNEED)

    def place(self, size: int) -> memoryview | None:
        """Room for `size` bytes, rounded up to _ALIGN, after those handed out, at an _ALIGN boundary; None where
        there is none."""
        if not self.files:
            self.top = 0
        start = -(-self.top // _ALIGN) * _ALIGN
        room = _aligned(size)
        if start + room > self.size:
            return None
        self.top = start + room
        self.files += 1
        return self.view[start : start + room]


def _free(slabs: list[_Slab]) -> None:
    for slab in slabs:
        slab.free()
    slabs.clear()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


_LIBC: Any = None


def _libc() -> Any:
    """libc's madvise through ctypes (each call releases the GIL)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC
