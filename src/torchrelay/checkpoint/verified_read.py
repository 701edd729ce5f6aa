"""The verified reader of a DCP checkpoint: every file hashed as its bytes arrive and parsed only once it matched.

Each file is read whole, front to back by a thread of its own (as many files at once as the threads and a share
of the node's available memory allow), into host memory allocated once per load and reused, hashed in order from
that memory, checked against its inventory entry, and only then are its items parsed from that same memory and
copied into their targets, on threads of their own while the next files are read. No byte is read twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from torchrelay.checkpoint.dcp_metadata import read_metadata
from torchrelay.checkpoint.host_stage import _Locked
from torchrelay.checkpoint.inventory import INVENTORY, safe_relpath
from torchrelay.checkpoint.items import _narrow, _parse_item, _refuse_transforms
from torchrelay.checkpoint.torch_compat import StorageInfo
from torchrelay.errors import CheckpointError, ConfigError, IntegrityError, UnsafeInput
from torchrelay.util import sha256_parts
from torchrelay.util.hashing import default_jobs
from torchrelay.util.meminfo import meminfo_kib


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata comes from the allow-listed unpickler and whose tensors are read by
    `_Load`: each file read whole by many threads at once (a few files at a time) into host memory allocated once
    per load and reused, hashed in order as its bytes arrive and checked against `expected` ({file name in the DCP
    directory: (SHA-256, size)}) before a byte of it is parsed, then its items parsed and copied into their
    targets on threads of their own while the next files are read. A file whose entry carries its SHA-256 states
    ((SHA-256, size, (part size, states))) is verified in parts, each on any hash thread, and each item is parsed
    and copied as soon as every part holding its bytes matched (USE_PARTS)."""

    def __init__(
        self, path: str, expected: dict[str, tuple[Any, ...]] | None = None, metadata: Metadata | None = None
    ) -> None:
        super().__init__(path)
        self.expected = expected
        self._metadata = metadata  # already read (and checked) by the caller: not parsed a second time
        self.verified: set[str] = set()  # names of the files read and checked
        # of the last read_data: seconds of each phase, summed over threads
        self.timings: dict[str, float] = {}
        self.read_began = self.read_ended = 0.0  # perf_counter() when the last read_data began and ended

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md, self._metadata = self._metadata or read_metadata(Path(self.path)), None
        md.storage_meta = md.storage_meta or dcp.metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[ReadItem]] = {}  # in the plan's order, as DCP's own reader groups them
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        self.read_began = time.perf_counter()
        load = _Load(Path(self.path), per_file, self.storage_data, planner, self.expected)
        try:
            load.run()
        finally:
            self.verified |= load.verified
            self.timings = dict(load.timings) | {f"at_{k}": v for k, v in load.timeline.items()}
            self.read_ended = time.perf_counter()
            self.timings["at_end"] = self.read_ended - load._began
        done: Future[None] = Future()
        done.set_result(None)
        return done


# Reads in flight per rank: a network or virtio disk reaches its bandwidth only with many requests queued (the
# GPU host's reads 1.42 GB/s on one stream, 1.87 on 16), whatever the number of files held.
READ_STREAMS = 16
_CHUNK = 16 << 20
_DAMAGED = "the file is damaged; restore it, or remove the checkpoint to resume from an older one"
# Per rank, host memory for bytes read but not yet copied into their tensors (a file larger than that is read
# alone). 0: MEMORY_SHARE of the node's MemAvailable at the start of the load, divided by LOCAL_WORLD_SIZE (every
# rank of a node loads at once); a fixed 4 GiB held only 4 of a 14.5 GB state's 16 files on a 128 GiB host.
LOAD_BUFFER = 4 << 30
MEMORY_SHARE = 0.5
_FALLBACK_BUFFER = 4 << 30  # where /proc/meminfo is not there to read
# How the reading threads share the reads. True: each takes a whole file and reads it front to back, one read in
# flight, as the cold-read floor does (bench_save.cold_read): the kernel's readahead of each file sees one
# sequential stream, and as many files are read at once as the threads and the buffer allow (FILES_AT_ONCE is not
# used). False: the threads share the chunks of the first FILES_AT_ONCE files. None (the default): a thread per
# file wherever the buffer holds a file for each reading thread (or every file, when there are fewer), else the
# shared chunks. Measured on the GPU hosts:
# - 14.5 GB in 16 files of 0.9 GB on one rank, 4 GiB of buffer (2026-12-02, H200, bench_load.py): shared chunks
#   0.89 of the cold read, a thread per file 0.86, 0.77 with 8 at once: the buffer holds 4 of the 16 files, so a
#   thread per file reads 4 streams where the floor reads 16.
# - 8 ranks of one host resuming their 1.8 GB shares at once, 16 files of 113 MB each (2026-12-06, H100,
#   bench_load_ranks.py, 3 rounds): shared chunks 0.68-0.69 of the same ranks' cold read, a thread per file
#   0.82-0.89: the buffer holds every file, and 128 sequential streams are what the disk serves best.
PER_FILE_READER: bool | None = None
# True: the largest files are started first (the tail is the last file's read, hash and copy: a short one).
LARGEST_FIRST = False
# True: POSIX_FADV_SEQUENTIAL on each file as it is opened (a larger readahead window on Linux).
FADVISE = False
# Threads that parse verified files and copy their items into the tensors (at most one per core). A file's room in
# the buffer is free for the next file's reads only once all its items are copied, so the copies decide how soon
# reading goes on: on the H200 host (2026-12-02, 14.5 GB, one call, bench_load.py) 16 threads took the verified
# resume from 9.873 s = 0.89 of the cold read (4 threads) to 8.543 s = 1.03 of the cold read measured before it
# (0.94 of the one after), although the copies from pageable memory then cost 26 thread-s instead of 8.
PARSE_THREADS = 16
# Threads that hash the files' chunks in order as they arrive (0: the reading thread that completes a file's next
# chunk hashes it, as before issue 22). A reader that hashes issues no read meanwhile: on the H200 host the 16
# readers spent 11-14 s of their 110-127 s hashing; with hash threads the load took 0.88 of the cold read's speed
# where it took 0.84 (benchmarks/RESULTS.md, issue 22).
HASH_THREADS = 4
# True: once no read is left to hand out, a reading thread hashes the parts its last chunk completed itself,
# instead of queueing them for the HASH_THREADS. The reads of the files read together end together: their last
# chunks, one on each reading thread, arrive within a few milliseconds, and 4 hash threads took them in turns
# (16 parts of 16 MiB: 4 rounds of 12 ms after the last read, issue 22 round 15). The reading threads are idle by
# then, so each hashes its own.
READERS_HASH_LAST = True
# Files whose chunks are read at the same time, the reads spread evenly over them. A file is hashed in order on
# one core (1.1-1.4 GB/s on the GPU host, under its disk's 2.3 GB/s): read at a share of the disk's speed, its
# hash keeps up and the file is verified as its last chunk arrives. At most one file fewer than the buffer holds
# of the largest: files read together end together, and the next one must have its room already, else the disk
# idles while they are parsed and copied. 1 = the earliest file's chunks first.
FILES_AT_ONCE = 4
# True: each chunk handed out is the earliest file's next (files then end one after another, each copied while the
# next is read); False: the files read together share the reads evenly, and end together.
FILL_FIRST = False
# True: a file whose inventory entry lists its SHA-256 state at every part boundary (util/sha256_parts.py, written
# by the persist) is hashed in parts, several at once, each part from the state before it, and each item is parsed
# and copied once the parts holding its bytes matched, while the rest of the file is still read. A file is then
# used as it arrives, not once all of it is hashed: the load's tail is one part's hash and one item's copy, where
# it was the last files' hash and copies (0.3-0.4 s of 7.7 s on the H200 host, RESULTS.md, issue 22 round four).
# The proof is the same: the chain of parts, each checked, ends in the file's SHA-256. False: each file in order.
USE_PARTS = True
# True: of a file verified in parts (USE_PARTS) whose items on this rank lie in at most a third of its bytes, only
# the parts holding them are read and checked (each from the states around it, as above): a rank that takes a few
# small items from another rank's file (the optimizer's `step` of every parameter is one tensor, saved once and
# read by every rank) reads one 16 MiB part, not the 113 MB file. Such a file is not counted as verified by this
# rank: a file no rank read whole is checked after the load all the same (state/load.py, _verify_share), and the
# states the parts were checked against are each proven there, the chain ending in the file's SHA-256. Measured
# on an H100 host (2026-12-06, 8 ranks of FSDP2 resuming 14.5 GB at once, RESULTS.md issue 22 seventeenth round):
# each rank read 7.05-7.93 GB for its own 1.81 GB (other ranks' 113 MB files, whole, for their `step` items):
# 0.72 of the same ranks' cold read; with the parts alone it read 2.22-2.29 GB, 0.91 of it. A third, not a half:
# two ranks that each take half of a file (a resume on twice the ranks) read it whole, as before, and it needs no
# second check after the load.
PARTIAL_READS = True
# Host memory is taken in slabs that stay for the whole load and hold the next files once theirs are done: a
# page is faulted in once, not for every file. False: a buffer of its own for each file. The slabs are pageable
# also for GPU targets: page-locked ones with asynchronous copies were measured on the H200 host (RESULTS.md) and
# were slower (pinning took 2 s and the reads waited on the copies: 10.0 s against 8.7 s from pageable slabs, whose
# copies overlap the reads on the parse threads).
REUSE_SLABS = True
# Memory held at once: room for at most the files read at the same time (FILES_AT_ONCE, or READ_STREAMS with
# a thread per file) plus ROOMS_AHEAD files of the largest size, in whole slabs (two at least), within the budget; a
# negative value: as many slabs as the budget allows, as before.
# Memory touched for the first time is the dear part of a read into it (the kernel zeroes and maps each page: on
# the 2-core VM 27 % of a verified load's CPU time was `clear_page` under the reads' page faults), and a budget
# larger than the load's files had every byte land in new memory: 3.2 GB in 16 files of 0.2 GB took 8.1-11.9 CPU
# s and 4.4-6.3 s where 1-1.5 GiB of slabs, reused, took 5.0-5.6 CPU s and 2.7-3.1 s (RESULTS.md, issue 22
# round eleven). Where the budget holds only a few of the largest files (the H200 host's 0.9 GB files in 4 GiB)
# nothing changes: FILES_AT_ONCE is already lowered to leave one room ahead.
ROOMS_AHEAD = 1
# True: for a load into CUDA tensors the slabs are page-locked by registration (an anonymous mapping each, touched
# and registered: 17-28 GB/s, where cudaHostAlloc took 2 s for 4 GiB) and each item's copy is a DMA on a stream of
# its parse thread, waited for before its room goes back. Measured on the H200 host: the copies' thread time 1.2 s
# against 9 s, the load no shorter (9.7-9.8 s against 9.7-11.4 s): the copies were never its tail. So it is off.
PIN_SLABS = False
# True: each pageable slab (a private anonymous mapping) is advised MADV_HUGEPAGE (Linux, transparent huge pages
# in "madvise" mode): the reads fault in 2 MiB pages, not 4 KiB ones, into memory that is touched for the first
# time (the floor reads into one reused 16 MiB buffer, whose pages stay mapped). Measured on the 2-core VM
# (RESULTS.md, issue 22 goal 4): slower in each of 3 rounds (29-37 s against 24-25 s); on the H200 host
# (2026-12-04, private mappings: the earlier rounds' slabs were shared ones, which that host gives no huge pages)
# 0.98, 0.88, 0.91, 0.94 of the rounds' cold read against 0.99, 0.85, 1.01, 1.00 without. Off.
HUGE_PAGES = False
# True: the slabs are given back (unmapped) on a thread of their own once the load is done, not before it returns:
# on the H200 host the 0.2 s between the last copy and the reader's return (14.5 GB, RESULTS.md issue 22).
FREE_LATER = True
# True: each file's chunks are read with O_DIRECT (Linux) into page-aligned slabs, straight from the disk into the
# load's memory: no page-cache copy on the reading threads and 14.5 GB of a state not left in the page cache. A
# chunk already in the page cache (a save just written, a second resume) is taken from it first (a buffered read
# with RWF_NOWAIT, which never waits on the disk), so a warm load is not sent to the disk. Where O_DIRECT is refused
# (tmpfs, some network filesystems: EINVAL at open or at a read) the file is read as before. The proof is the same:
# every byte hashed from the load's memory. Measured on the H200 host (2026-12-04, 14.5 GB in 16 files,
# RESULTS.md issue 22 eighth round): that disk serves O_DIRECT slower than buffered reads (a thread per file at
# 0.74-0.79 of the buffered cold read with 16 MiB requests, 0.52-0.62 with 4 MiB: bench_read_patterns.py), and the
# load with it 0.81-0.87 of its round's buffered cold read against 0.79-0.92 without: off. A setting for disks
# that prefer it (NVMe, where the page-cache copy is the limit).
DIRECT_IO = False
# True: each new slab's pages are faulted in ahead of the reads by a thread of the load (madvise
# MADV_POPULATE_WRITE, Linux 5.14+: page tables filled, no byte of the memory written), from its end backwards in
# _PREFAULT_STEP pieces while the reads fill it from the front, the slabs taken in turn. A read into a page touched
# for the first time faults it in on the reading thread, between its reads: on the H200 host a thread per file
# into fresh memory read at 0.80-0.95 of the same reads into a reused buffer (bench_read_patterns.py,
# RESULTS.md). Where the kernel refuses it (EINVAL), nothing is prefaulted. Measured on the H200 host (2026-12-04,
# four rounds, each against the mean of the cold reads before and after it): 0.89, 0.97, 0.94, 0.94 of it with,
# 0.83, 1.07, 0.94, 0.95 without (the slabs hold 4 GiB of the 14.5 GB: the rest lands in pages already there). Off.
PREFAULT = False
_PREFAULT_STEP = 64 << 20
_MADV_POPULATE_WRITE = 23
_MADV_DONTNEED = 4
_FREE_STEP = 256 << 20
# The size of a slab holding many small files (a slab is at least the largest file, so holds any file whole).
_SLAB = 256 << 20
_ALIGN = 4096


def load_budget() -> int:
    """The bytes of host memory this rank's load may hold at once: LOAD_BUFFER when set, else MEMORY_SHARE of
    MemAvailable over the node's ranks (LOCAL_WORLD_SIZE, 1 outside torchrun)."""
    if LOAD_BUFFER > 0:
        return LOAD_BUFFER
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={text!r}: not a positive integer; unset it or give the number of ranks on this node"
        )
    available = _mem_available()
    if available is None:
        return _FALLBACK_BUFFER
    return max(1, int(available * MEMORY_SHARE) // int(text))


def files_at_once(largest: int, budget: int) -> int:
    """The files the shared-chunk reads spread over at once: FILES_AT_ONCE, fewer where `budget` holds fewer
    files of the `largest` size (one room kept for the next file)."""
    room = max(1, budget // max(1, largest))
    return max(1, min(FILES_AT_ONCE, room - 1))


def reads_per_file(files: int, largest: int, budget: int) -> bool:
    """Whether each reading thread reads whole files (PER_FILE_READER; where it is None: wherever `budget` holds
    a file of the `largest` size for each reading thread, or each of the `files` where they are fewer)."""
    if PER_FILE_READER is not None:
        return PER_FILE_READER
    return min(max(1, READ_STREAMS), files) * _aligned(largest) <= budget


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none (not Linux)."""
    got = meminfo_kib("MemAvailable")
    return None if got is None else got["MemAvailable"] * 1024


class _Slab:
    """Host memory holding whole files one after another; its room is handed out again once they are all done."""

    def __init__(self, size: int, pinned: bool = False) -> None:
        self.size = size
        self.locked: _Locked | None = None
        self.mapping: mmap.mmap | None = None
        if pinned:
            locked = _Locked(size)
            if locked.register():
                self.locked = locked
            self.data = locked.tensor[:size]
        elif hasattr(mmap, "MAP_PRIVATE"):
            # a private anonymous mapping of its own: page-aligned (as O_DIRECT's reads need), and unmapped by
            # `free` without the interpreter's lock (a torch.empty buffer is freed holding it: the thread returning
            # from the load waited 10-60 ms for the thread freeing the slabs)
            self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            if HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
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
        its unmapping then is quick: an unmapping frees every page holding the lock (30-80 ms a GiB on the CPU
        VM, while the thread returning from the load, or the loop after it, waits). A view still held somewhere
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
        """Room for `size` bytes, rounded up to _ALIGN (an O_DIRECT read of a file's last chunk is whole blocks),
        after those handed out, at an _ALIGN boundary; None where there is none."""
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
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's byte per page: its lowest bit says it is resident


def _libc() -> Any:
    """libc's mmap, munmap, mincore and madvise through ctypes (each call releases the GIL)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        libc.mmap.argtypes += [ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


def _resident(fd: int, size: int) -> bytes | None:
    """Which pages of the open file are in the page cache (mincore over a read-only shared mapping of it: nothing
    is read, no readahead is started), a byte per page whose lowest bit says it; None where it cannot be asked.
    (A buffered read with RWF_NOWAIT would say it too, but starts the readahead of what is not there.)"""
    try:
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    except (AttributeError, OSError):  # no libc by that name, no mincore (not Linux)
        return None
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        if libc.mincore(addr, size, vec) != 0:
            return None
        return vec.raw
    finally:
        libc.munmap(addr, size)


class _File:
    """One file of the load: its bytes in memory, how much of them has arrived and been hashed."""

    def __init__(
        self,
        rel: str,
        path: Path,
        size: int,
        digest: str | None,
        items: list[ReadItem],
        parts: tuple[int, list[str]] | None = None,
    ) -> None:
        self.rel, self.path, self.size, self.digest, self.items = rel, path, size, digest, items
        self.chunk = _CHUNK  # bytes a read asks for (a part's, where the file is read in part)
        self.chunks = -(-size // self.chunk)
        self.todo = list(
            range(self.chunks)
        )  # the chunks to read, in order (fewer where the file is read in part)
        self.issued = 0  # chunks of todo handed to a reading thread
        self.served = -1  # when a chunk of it was last handed out (see _Load._next)
        self.arrived = [False] * self.chunks
        self.hashed = 0  # chunks hashed, in order
        self.hashing = False  # a thread is hashing the arrived chunks: the others leave it to it
        self.sha = hashlib.sha256()
        self.lock = threading.Lock()
        self.fd = -1
        self.slab: _Slab | None = None
        self.view = memoryview(b"")  # the file's bytes in its slab
        self.room = memoryview(b"")  # the same, to the next _ALIGN boundary (O_DIRECT reads whole blocks)
        self.direct = -1  # an O_DIRECT descriptor of it (DIRECT_IO), or -1
        self.use_direct = False  # chunks are read by it (False once a read of it was refused: the page cache)
        self.resident: bytes | None = (
            None  # of each page, in the page cache when the file was opened (_resident)
        )
        # items not yet in their targets, and one more for the file's verification: its room goes back at 0
        self.left = len(items) + 1
        # verified in parts (util/sha256_parts.py): the part size and states, which parts are hashed and matched
        self.part, self.states = parts if parts is not None else (0, [])
        self.nparts = sha256_parts.part_count(size, self.part) if self.part else 0
        self.part_started = [False] * self.nparts
        self.part_ok = [False] * self.nparts
        self.prefix = 0  # parts matched from the start: the items within them can be used
        self.needed: list[
            int
        ] = []  # read in part (PARTIAL_READS): the parts holding its items, the only ones read
        self.pending: list[
            ReadItem
        ] = []  # items waiting for their parts, by where their bytes end (_Load sorts)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.direct >= 0:
            os.close(self.direct)
            self.direct = -1


class _Load:
    """Reads, verifies, parses and copies the files of one rank's load, holding at most load_budget() of them.

    Files are taken largest first (LARGEST_FIRST) as room in the slabs allows; READ_STREAMS threads read them in
    chunks, each thread a whole file front to back (PER_FILE_READER), or spread over the first few files not yet
    fully asked for (FILES_AT_ONCE); each file is hashed in order from memory by a hash thread (HASH_THREADS) as
    the chunks extending its hashed prefix arrive, so that no byte is read twice.
    Only once its size and SHA-256 match is a file's items parsed (`torch.load(weights_only=True)` onto meta), on
    PARSE_THREADS threads, and copied into the targets; its room in the slab is reused once they are all in."""

    def __init__(
        self,
        root: Path,
        per_file: dict[str, list[ReadItem]],
        storage: dict[MetadataIndex, StorageInfo],
        planner: Any,
        expected: dict[str, tuple[str, int]] | None,
    ) -> None:
        self.root, self.storage, self.planner, self.expected = root, storage, planner, expected
        self.per_file = per_file
        self.verified: set[str] = set()
        self.timings = dict.fromkeys(("read", "hash", "parse", "copy", "alloc", "read_idle", "prefault"), 0.0)
        self.timings["bytes_direct"] = 0  # read by O_DIRECT (DIRECT_IO), not from the page cache
        self.timings["bytes_read"] = 0
        # when (seconds after run() began) the first read began, the last read ended, the last item was copied
        self.timeline = {"first_read": float("inf"), "reads_done": 0.0, "copies_done": 0.0}
        self._began = time.perf_counter()
        self._cond = threading.Condition()
        self._slabs: list[_Slab] = []
        self._allocated = 0  # bytes of the slabs, those being allocated included
        self._reading: list[_File] = []  # admitted files with chunks not yet handed to a reading thread
        self._admitted_all = False
        self._turn = 0  # chunks handed out
        self._at_once = max(1, FILES_AT_ONCE)  # files read at the same time (run() lowers it to the room)
        self._per_file = bool(
            PER_FILE_READER
        )  # a thread per file (run() decides where PER_FILE_READER is None)
        self._slab_size = 0
        self._budget = _FALLBACK_BUFFER  # run() sets it
        self._finished = 0
        self._error: BaseException | None = None
        self._plan = threading.Lock()  # the planner is not known to be thread-safe
        self._hasher: ThreadPoolExecutor | None = None
        self._pinned = PIN_SLABS and torch.cuda.is_available() and torch.cuda.is_initialized()
        self._streams = threading.local()  # each parse thread's CUDA stream for copies from page-locked slabs
        self._opened: list[_File] = []
        self._prefault: list[list[int]] = []  # [address, bytes not yet prefaulted] of each slab, in turn
        self._loaded = False  # run() is ending: the prefaulting thread stops

    def run(self) -> None:
        self._began = time.perf_counter()
        self._parse = ThreadPoolExecutor(
            max(1, min(PARSE_THREADS, default_jobs())), thread_name_prefix="torchrelay-parse"
        )
        self._hasher = (
            ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="torchrelay-hash")
            if HASH_THREADS > 0
            else None
        )
        readers = [  # they wait for the first file admitted, after the reads' pattern is chosen
            threading.Thread(target=self._reader, name=f"torchrelay-read-{i}", daemon=True)
            for i in range(max(1, READ_STREAMS))
        ]
        for thread in readers:
            thread.start()
        prefault = None
        if PREFAULT and not self._pinned:
            prefault = threading.Thread(target=self._prefaulter, name="torchrelay-prefault", daemon=True)
            prefault.start()
        try:
            files = [self._describe(rel, items) for rel, items in self.per_file.items()]
            largest = max((f.size for f in files), default=0)
            total = sum(f.size for f in files)
            self._budget = load_budget()
            self._slab_size = _aligned(max(largest, min(total, self._budget, _SLAB)))
            self._at_once = files_at_once(largest, self._budget)
            self._per_file = reads_per_file(len(files), largest, self._budget)
            if REUSE_SLABS and ROOMS_AHEAD >= 0 and self._slab_size:  # no more new memory than the reads use
                reading = min(max(1, READ_STREAMS), len(files)) if self._per_file else self._at_once
                # in whole slabs, two at least: a slab of small files is reused only once all of them are done
                wanted = max(2 * self._slab_size, (reading + ROOMS_AHEAD) * _aligned(largest))
                self._budget = min(self._budget, -(-wanted // self._slab_size) * self._slab_size)
            if LARGEST_FIRST:
                files.sort(key=lambda g: -g.size)  # stable: the plan's order among equal sizes
            for f in files:
                if not self._admit(f):
                    break
                if not f.todo:
                    self._guard(self._verified, f)
                else:
                    with self._cond:
                        self._reading.append(f)
                        self._cond.notify_all()
            with self._cond:
                self._admitted_all = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._error is not None or self._finished == len(self.per_file))
            self.timeline["finished"] = time.perf_counter() - self._began
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._cond:
                self._admitted_all = True
                self._cond.notify_all()
            for thread in readers:
                thread.join()
            if prefault is not None:  # before a slab is freed: it advises their memory
                with self._cond:
                    self._loaded = True
                    self._cond.notify_all()
                prefault.join()
            if self._hasher is not None:
                self._hasher.shutdown(wait=True, cancel_futures=True)
            self._parse.shutdown(wait=True, cancel_futures=True)
            for f in self._opened:
                f.close()
                f.slab, f.view, f.room = None, memoryview(b""), memoryview(b"")
            slabs, self._slabs = self._slabs, []
            for slab in slabs:
                if slab.locked is not None:  # every copy from it was waited for
                    slab.locked.release()
            self.timeline["joined"] = time.perf_counter() - self._began
            if FREE_LATER and slabs:  # the memory given back on a thread: the unmapping off the load
                # not a daemon: the interpreter waits for it at exit. A daemon thread still freeing a slab's
                # tensor when a short script ended (a load, then exit) aborted the process ("terminate called
                # without an active exception", exit 134) in 1 to 4 runs of 10.
                threading.Thread(target=_free, args=(slabs,), name="torchrelay-free-slabs").start()
            else:
                _free(slabs)
            self.timeline["freed"] = time.perf_counter() - self._began
        if self._error is not None:
            raise self._error

    def _prefaulter(self) -> None:
        """PREFAULT: fault in the slabs' pages, each from its end backwards, a step of each in turn, until every
        slab is done and no more are coming, or the load ends (its reads fill the slabs from the front)."""
        try:
            libc = _libc()
        except (AttributeError, OSError):
            return
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loaded or self._error is not None or bool(self._prefault))
                if self._loaded or self._error is not None:
                    return
                jobs = list(self._prefault)
            for job in jobs:
                addr, left = job
                step = min(left, _PREFAULT_STEP)
                t0 = time.perf_counter()
                ok = libc.madvise(addr + left - step, step, _MADV_POPULATE_WRITE) == 0
                self._count("prefault", time.perf_counter() - t0)
                if not ok:  # not this kernel's (EINVAL before Linux 5.14): the reads fault the pages in
                    return
                job[1] -= step
                if self._loaded:
                    return
            with self._cond:
                self._prefault = [job for job in self._prefault if job[1] > 0]

    def _describe(self, rel: str, items: list[ReadItem]) -> _File:
        path = safe_relpath(self.root, rel, self.root / ".metadata")
        parts: tuple[int, list[str]] | None = None
        more: list[Any] = []
        if self.expected is None:
            digest, size = None, os.stat(path).st_size
        elif rel in self.expected:
            digest, size, *more = self.expected[rel]
            if more and USE_PARTS and sha256_parts.available():
                parts = more[0]
            # before any memory is sized by it: a size larger than the file's (a damaged or forged inventory)
            # would have the slabs sized for it (a terabyte claimed: ENOMEM in a traceback). The reads check the
            # size again, both ways, as they arrive.
            try:
                found = os.stat(path).st_size
            except OSError:
                found = size  # a file that is not there: its open says so, as before
            if found < size:
                raise IntegrityError(f"{path} has {found} bytes, the inventory says {size}", hint=_DAMAGED)
        else:
            raise UnsafeInput(f"{path}: not listed in the checkpoint's inventory; refusing to read it")
        f = _File(rel, path, size, digest, items, parts)
        if f.nparts:  # each item waits for the parts that hold its bytes, the earliest to end first
            f.pending = sorted(items, key=self._end)
            if PARTIAL_READS:
                self._read_in_part(f)
        return f

    def _read_in_part(self, f: _File) -> None:
        """Where the file's items lie in at most a third of its parts' bytes: read only those parts (f.needed,
        and the chunks that hold them in f.todo)."""
        needed: set[int] = set()
        for req in f.items:
            info = self.storage[req.storage_index]
            start, length = int(info.offset), int(info.length)
            if length > 0:
                needed.update(range(start // f.part, (start + length - 1) // f.part + 1))
        needed = {p for p in needed if p < f.nparts}  # an item past the end: its parse refuses it, as before
        held = sum(min((p + 1) * f.part, f.size) - p * f.part for p in needed)
        if not needed or 3 * held > f.size:
            return
        if f.part <= _CHUNK and f.part % _ALIGN == 0:  # parts smaller than a read: a read a part, no more
            f.chunk, f.chunks = f.part, f.nparts
            f.arrived = [False] * f.chunks
        chunks: set[int] = set()
        for p in needed:
            lo, hi = p * f.part, min((p + 1) * f.part, f.size)
            chunks.update(range(lo // f.chunk, (hi - 1) // f.chunk + 1))
        f.needed, f.todo = sorted(needed), sorted(chunks)

    def _end(self, req: ReadItem) -> int:
        info = self.storage[req.storage_index]
        return int(info.offset) + int(info.length)

    def _admit(self, f: _File) -> bool:
        """Room for the file's bytes in a slab (a new one while the budget allows, or once enough of the files
        held are done), and the file opened; False after a failure."""
        if f.size:
            size = self._slab_size if REUSE_SLABS else _aligned(f.size)
            with self._cond:
                while True:
                    if self._error is not None:
                        return False
                    for slab in self._slabs:
                        view = slab.place(f.size)
                        if view is not None:
                            f.slab, f.room, f.view = slab, view, view[: f.size]
                            break
                    if f.slab is not None or not self._allocated or self._allocated + size <= self._budget:
                        break
                    self._cond.wait()
                if f.slab is None:
                    self._allocated += size
            if f.slab is None:  # allocated outside the lock: the reads of the files admitted go on meanwhile
                t0 = time.perf_counter()
                try:
                    slab = _Slab(size, self._pinned)
                except BaseException:
                    with self._cond:
                        self._allocated -= size
                    raise
                self._count("alloc", time.perf_counter() - t0)
                with self._cond:
                    self._slabs.append(slab)
                    if PREFAULT and slab.locked is None:
                        addr = slab.data.data_ptr()
                        start = -(-addr // mmap.PAGESIZE) * mmap.PAGESIZE  # torch.empty's: 64-byte aligned
                        length = (addr + slab.size - start) // mmap.PAGESIZE * mmap.PAGESIZE
                        if length > 0:
                            self._prefault.append([start, length])
                            self._cond.notify_all()
                    view = slab.place(f.size)
                    assert view is not None  # a new slab holds any file whole
                    f.slab, f.room, f.view = slab, view, view[: f.size]
        self._opened.append(f)
        f.fd = os.open(f.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        if DIRECT_IO and f.size and hasattr(os, "O_DIRECT") and hasattr(os, "RWF_NOWAIT"):
            try:  # the same file: opened by path again, then checked to be the one already open
                f.direct = os.open(f.path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # O_DIRECT refused here (EINVAL): through the page cache
                f.direct = -1
            else:
                a, b = os.fstat(f.fd), os.fstat(f.direct)
                if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                    f.close()
                    raise UnsafeInput(f"{f.path} was replaced while it was opened; refusing to read it")
                f.use_direct = True
                f.resident = _resident(f.fd, f.size)
        if FADVISE and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return True

    def _release(self, f: _File) -> None:
        """The file is done: its room in the slab goes back (the slab itself, without reuse). Under _cond."""
        slab, f.slab, f.view, f.room = f.slab, None, memoryview(b""), memoryview(b"")
        if slab is not None:
            slab.files -= 1
            if not slab.files and not REUSE_SLABS:
                self._slabs.remove(slab)
                self._allocated -= slab.size
        self._finished += 1
        self._cond.notify_all()

    def _reader(self) -> None:
        while (job := self._next()) is not None:
            f, k = job
            if k >= 0:
                self._guard(self._read, f, k)
                continue
            for k in f.todo:  # a whole file (or the parts of it this rank needs), front to back
                if self._error is not None:
                    return
                self._guard(self._read, f, k)

    def _next(self) -> tuple[_File, int] | None:
        """The next read for this thread, once a file is admitted: a whole file (chunk -1), the first admitted
        that no thread has taken, where each thread reads whole files; else the next chunk of the first files not
        fully asked for (`_at_once`), of the one served longest ago (round robin, each an equal share). None once
        every file is read, or after a failure."""
        with self._cond:
            t0 = time.perf_counter()
            while True:
                if self._error is not None:
                    return None
                if self._reading:
                    if self._per_file:
                        f = self._reading.pop(0)
                        f.issued, k = len(f.todo), -1
                    else:
                        f = (
                            self._reading[0]
                            if FILL_FIRST
                            else min(self._reading[: self._at_once], key=lambda g: g.served)
                        )
                        k = f.todo[f.issued]
                        f.issued += 1
                        f.served = self._turn
                        self._turn += 1
                        if f.issued == len(f.todo):
                            self._reading.remove(f)
                    self.timings["read_idle"] += time.perf_counter() - t0
                    return f, k
                if self._admitted_all:
                    return None
                self._cond.wait()

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            if self._error is None:
                fn(*args)
        except BaseException as exc:  # noqa: BLE001 - carried to the thread that waits in run()
            self._fail(exc)

    def _count(self, phase: str, seconds: float) -> None:
        with self._cond:
            self.timings[phase] += seconds

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _read(self, f: _File, k: int) -> None:
        t0 = time.perf_counter()
        start = k * f.chunk
        want = min(f.chunk, f.size - start)
        got = direct = self._read_direct(f, start, want) if f.use_direct else 0
        while got < want:
            n = os.preadv(f.fd, [f.view[start + got : start + want]], start + got)
            if not n:
                raise self._short(f, start + got)
            got += n
        t1 = time.perf_counter()
        with self._cond:
            self.timings["read"] += t1 - t0
            self.timings["bytes_direct"] += direct
            self.timings["bytes_read"] += want
            line = self.timeline
            line["first_read"] = min(line["first_read"], t0 - self._began)
            line["reads_done"] = max(line["reads_done"], t1 - self._began)
        if f.nparts:
            self._arrived_in_parts(f, k)
            return
        with f.lock:
            f.arrived[k] = True
            if f.hashing:
                return
            f.hashing = True
        if self._hasher is not None:  # the reading thread goes back to reading at once
            self._hasher.submit(self._guard, self._hash, f)
        else:
            self._hash(f)

    def _short(self, f: _File, at: int) -> IntegrityError:
        return IntegrityError(f"{f.path} has {at} bytes, the inventory says {f.size}", hint=_DAMAGED)

    def _read_direct(self, f: _File, start: int, want: int) -> int:
        """Bytes [start, start + want) of the file into its room by O_DIRECT, in whole blocks (the last block of
        the file whole, into the room after it); how many arrived. 0 for a chunk whose pages were all in the page
        cache when the file was opened, or one not in whole blocks: the caller reads the rest through the page
        cache (after EINVAL, every chunk of the file from then on)."""
        if start % _ALIGN or (want % _ALIGN and start + want != f.size):
            return 0  # a chunk not in whole blocks (a small _CHUNK): its last block is another chunk's
        if f.resident is not None:
            pages = f.resident[start // mmap.PAGESIZE : -(-(start + want) // mmap.PAGESIZE)]
            if not pages.translate(_LOW_BIT).count(0):
                return 0  # every page of it in the page cache: read from there
        got = 0
        end = start + _aligned(want)  # within the room: a file's last block is read whole
        while got < want:
            try:
                n = os.preadv(f.direct, [f.room[start + got : end]], start + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                f.use_direct = False  # this filesystem's blocks are larger, or it refuses: the page cache
                return got
            if not n:
                raise self._short(f, start + got)
            got += n
            if n % _ALIGN and got < want:  # a read that ends within a block ended at the end of the file
                raise self._short(f, start + got)
        return min(got, want)

    def _arrived_in_parts(self, f: _File, k: int) -> None:
        """Chunk k is in: hash each part it completes (on a hash thread, or this one without them)."""
        first = k * f.chunk // f.part
        last = (min((k + 1) * f.chunk, f.size) - 1) // f.part
        ready = []
        with f.lock:
            f.arrived[k] = True
            for p in range(first, last + 1):
                lo = p * f.part // f.chunk
                hi = -(-min((p + 1) * f.part, f.size) // f.chunk)
                if f.needed and p not in f.needed:
                    continue  # read in part: a part the chunk holds beside the needed ones is not checked
                if not f.part_started[p] and all(f.arrived[lo:hi]):
                    f.part_started[p] = True
                    ready.append(p)
        if not ready:
            return
        hasher = None if READERS_HASH_LAST and self._no_read_left(f, k) else self._hasher
        for p in ready:
            if hasher is not None:
                hasher.submit(self._guard, self._hash_part, f, p)
            else:
                self._hash_part(f, p)

    def _no_read_left(self, f: _File, k: int) -> bool:
        """This thread, having read chunk k of f, has no read left to issue: every chunk of every file has been
        handed out (and, reading whole files, k is its file's last)."""
        if self._per_file and k != f.todo[-1]:
            return False
        with self._cond:
            return self._admitted_all and not self._reading

    def _hash_part(self, f: _File, p: int) -> None:
        """Check part p against the states around it (the last one: the file's SHA-256), then hand the items
        that now lie in matched parts to the parse threads; verify the file once every part matched."""
        t0 = time.perf_counter()
        lo, hi = p * f.part, min((p + 1) * f.part, f.size)
        assert f.digest is not None  # parts come from an inventory entry, with its SHA-256
        ok = sha256_parts.check_part(f.view[lo:hi], p, f.part, f.states, f.digest)
        self._count("hash", time.perf_counter() - t0)
        if not ok:
            raise IntegrityError(
                f"{f.path} does not match its SHA-256 in {INVENTORY} (part {p}: bytes {lo}-{hi})",
                hint=_DAMAGED,
            )
        with f.lock:
            f.part_ok[p] = True
            if f.needed:  # read in part: an item is ready once every part holding its bytes matched
                if not f.pending:
                    return  # every item was handed out: the file is done
                ready = [req for req in f.pending if self._parts_ok(f, req)]
                f.pending = [req for req in f.pending if req not in ready]
                complete = not f.pending and all(f.part_ok[q] for q in f.needed)
            else:
                before = f.prefix
                while f.prefix < f.nparts and f.part_ok[f.prefix]:
                    f.prefix += 1
                complete = before < f.nparts == f.prefix
                upto = f.size if complete else f.prefix * f.part
                n = 0
                while n < len(f.pending) and self._end(f.pending[n]) <= upto:
                    n += 1
                ready, f.pending = f.pending[:n], f.pending[n:]
        for req in ready:
            self._parse.submit(self._guard, self._item, f, req)
        if complete:
            self._verified(f, by_parts=True)

    def _parts_ok(self, f: _File, req: ReadItem) -> bool:
        """Every part holding the item's bytes matched (under f.lock)."""
        info = self.storage[req.storage_index]
        start, length = int(info.offset), int(info.length)
        if length <= 0:
            return True  # no byte of the file: nothing to wait for
        return all(f.part_ok[start // f.part : (start + length - 1) // f.part + 1])

    def _hash(self, f: _File) -> None:
        """Hash the file's arrived prefix (the caller set f.hashing); verify it once all of it is hashed."""
        t1 = time.perf_counter()
        while True:  # a chunk that arrives meanwhile is left to this thread
            with f.lock:
                n = f.hashed
                if n == f.chunks or not f.arrived[n]:
                    f.hashing = False
                    break
            f.sha.update(f.view[n * f.chunk : min((n + 1) * f.chunk, f.size)])  # releases the GIL
            with f.lock:
                f.hashed = n + 1
        self._count("hash", time.perf_counter() - t1)
        with f.lock:
            complete = f.hashed == f.chunks and not f.hashing
            if complete:
                f.hashing = True  # once: no other thread verifies it again
        if complete:
            self._verified(f)

    def _verified(self, f: _File, by_parts: bool = False) -> None:
        """All bytes in: check the size and digest (`by_parts`: every part matched already), then hand the items
        to the parse threads (those not handed out part by part)."""
        if os.pread(f.fd, 1, f.size):
            raise IntegrityError(
                f"{f.path} has more than {f.size} bytes, the inventory says {f.size}",
                hint=_DAMAGED,
            )
        f.close()
        if f.digest is not None:
            if not by_parts and f.sha.hexdigest() != f.digest:
                raise IntegrityError(
                    f"{f.path} does not match its SHA-256 in {INVENTORY}",
                    hint=_DAMAGED,
                )
            if not f.needed:  # read whole: the file's SHA-256 matched (in part: only the parts it needs)
                with self._cond:
                    self.verified.add(f.rel)
        with f.lock:
            items, f.pending = (f.pending if by_parts else f.items), []
        for req in items:
            self._parse.submit(self._guard, self._item, f, req)
        self._done_with(f)

    def _done_with(self, f: _File) -> None:
        """One of the file's items is in its target, or the file is verified: at the last, its room goes back."""
        with self._cond:
            f.left -= 1
            if not f.left:
                self._release(f)

    def _item(self, f: _File, req: ReadItem) -> None:
        t0 = time.perf_counter()
        info = self.storage[req.storage_index]
        _refuse_transforms(info, f.path, req.storage_index.fqn)
        tensor = _parse_item(f.view, info.offset, info.length, f.path, req.storage_index.fqn)
        tensor = _narrow(tensor, req.storage_offsets, req.lengths)
        with self._plan:
            target = self.planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{f.path}: {req.storage_index.fqn!r} holds {list(tensor.size())} where the load plan expects "
                f"{list(target.size())}",
                hint="the checkpoint is damaged or was not written by torchrelay",
            )
        t1 = time.perf_counter()
        slab = f.slab
        if slab is not None and slab.locked is not None and target.is_cuda:
            stream = getattr(self._streams, "stream", None)
            if stream is None:
                stream = self._streams.stream = torch.cuda.Stream(target.device)
            stream.wait_stream(torch.cuda.default_stream(target.device))  # work queued on the target first
            with torch.cuda.stream(stream):
                target.copy_(tensor, non_blocking=True)
            stream.synchronize()  # the slab's room is reused once every item is in; releases the GIL
        else:
            target.copy_(tensor)  # releases the GIL; to a GPU a pageable copy, finished when it returns
        t2 = time.perf_counter()
        with self._plan:
            self.planner.commit_tensor(req, target)
        with self._cond:
            self.timings["parse"] += t1 - t0
            self.timings["copy"] += t2 - t1
            self.timeline["copies_done"] = max(self.timeline["copies_done"], t2 - self._began)
        self._done_with(f)
