"""The verified reader of a DCP checkpoint: every file hashed as its bytes arrive and parsed only once it matched.

Each file is read whole, front to back by a thread of its own (as many files at once as the threads and a share
of the node's available memory allow), into host memory allocated once per load and reused, hashed in order from
that memory, checked against its inventory entry, and only then are its items parsed from that same memory and
copied into their targets, on threads of their own while the next files are read. No byte is read twice.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from torchrelay.checkpoint.inventory import INVENTORY, safe_relpath
from torchrelay.checkpoint.items import _narrow, _parse_item, _refuse_transforms
from torchrelay.checkpoint.torch_compat import StorageInfo
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import CheckpointError, ConfigError, IntegrityError, UnsafeInput
from torchrelay.util import sha256_parts
from torchrelay.util.hashing import default_jobs
from torchrelay.util.meminfo import meminfo_kib
from torchrelay.util.safepath import open_regular


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata comes from the allow-listed unpickler and whose tensors are read by
    `_Load`: each file read whole by many threads at once (a few files at a time) into host memory allocated once
    per load and reused, hashed in order as its bytes arrive and checked against `expected` ({file name in the DCP
    directory: (SHA-256, size)}) before a byte of it is parsed, then its items parsed and copied into their
    targets on threads of their own while the next files are read. A file whose entry carries its SHA-256 states
    ((SHA-256, size, (part size, states))) is verified in parts, each on any hash thread, and each item is parsed
    and copied as soon as every part holding its bytes matched (`LoadTuning.use_parts`)."""

    def __init__(
        self,
        path: str,
        expected: dict[str, tuple[Any, ...]] | None = None,
        metadata: Metadata | None = None,
        tuning: LoadTuning | None = None,
    ) -> None:
        super().__init__(path)
        self.tuning = tuning or LoadTuning()
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
        load = _Load(Path(self.path), per_file, self.storage_data, planner, self.expected, self.tuning)
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


_DAMAGED = "the file is damaged; restore it, or remove the checkpoint to resume from an older one"
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
        chunk: int = 16 << 20,
    ) -> None:
        self.rel, self.path, self.size, self.digest, self.items = rel, path, size, digest, items
        self.chunk = chunk  # bytes a read asks for (a part's, where the file is read in part)
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
        ] = []  # read in part (`partial_reads`): the parts holding its items, the only ones read
        self.pending: list[
            ReadItem
        ] = []  # items waiting for their parts, by where their bytes end (_Load sorts)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Load:
    """Reads, verifies, parses and copies the files of one rank's load, holding at most load_budget() of them.

    Files are taken in the plan's order as room in the slabs allows; `read_streams` threads read them in chunks,
    each thread a whole file front to back (`per_file_reader`), or spread over the first few files not yet fully
    asked for (`files_at_once`); each file is hashed in order from memory by a hash thread (`hash_threads`) as
    the chunks extending its hashed prefix arrive, so that no byte is read twice.
    Only once its size and SHA-256 match is a file's items parsed (`torch.load(weights_only=True)` onto meta), on
    `parse_threads` threads, and copied into the targets; its room in the slab is reused once they are all in."""

    def __init__(
        self,
        root: Path,
        per_file: dict[str, list[ReadItem]],
        storage: dict[MetadataIndex, StorageInfo],
        planner: Any,
        expected: dict[str, tuple[str, int]] | None,
        tuning: LoadTuning,
    ) -> None:
        self.root, self.storage, self.planner, self.expected = root, storage, planner, expected
        self.tuning = tuning
        self.per_file = per_file
        self.verified: set[str] = set()
        self.timings = dict.fromkeys(("read", "hash", "parse", "copy", "alloc", "read_idle"), 0.0)
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
        self._at_once = tuning.files_at_once  # files read at the same time (run() lowers it to the room)
        self._per_file = bool(tuning.per_file_reader)  # a thread per file (run() decides where it is None)
        self._slab_size = 0
        self._budget = _FALLBACK_BUFFER  # run() sets it
        self._finished = 0
        self._error: BaseException | None = None
        self._plan = threading.Lock()  # the planner is not known to be thread-safe
        self._hasher: ThreadPoolExecutor | None = None
        self._opened: list[_File] = []

    def run(self) -> None:
        tuning = self.tuning
        self._began = time.perf_counter()
        self._parse = ThreadPoolExecutor(
            max(1, min(tuning.parse_threads, default_jobs())), thread_name_prefix="torchrelay-parse"
        )
        self._hasher = (
            ThreadPoolExecutor(tuning.hash_threads, thread_name_prefix="torchrelay-hash")
            if tuning.hash_threads > 0
            else None
        )
        readers = [  # they wait for the first file admitted, after the reads' pattern is chosen
            threading.Thread(target=self._reader, name=f"torchrelay-read-{i}", daemon=True)
            for i in range(tuning.read_streams)
        ]
        for thread in readers:
            thread.start()
        try:
            files = [self._describe(rel, items) for rel, items in self.per_file.items()]
            largest = max((f.size for f in files), default=0)
            total = sum(f.size for f in files)
            self._budget = load_budget(tuning)
            self._slab_size = _aligned(max(largest, min(total, self._budget, _SLAB)))
            self._at_once = files_at_once(tuning, largest, self._budget)
            self._per_file = reads_per_file(tuning, len(files), largest, self._budget)
            ahead = tuning.rooms_ahead
            if tuning.reuse_slabs and ahead >= 0 and self._slab_size:  # no more new memory than the reads use
                reading = min(tuning.read_streams, len(files)) if self._per_file else self._at_once
                # in whole slabs, two at least: a slab of small files is reused only once all of them are done
                wanted = max(2 * self._slab_size, (reading + ahead) * _aligned(largest))
                self._budget = min(self._budget, -(-wanted // self._slab_size) * self._slab_size)
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
            if self._hasher is not None:
                self._hasher.shutdown(wait=True, cancel_futures=True)
            self._parse.shutdown(wait=True, cancel_futures=True)
            for f in self._opened:
                f.close()
                f.slab, f.view = None, memoryview(b"")
            slabs, self._slabs = self._slabs, []
            self.timeline["joined"] = time.perf_counter() - self._began
            if tuning.free_later and slabs:  # the memory given back on a thread: the unmapping off the load
                # not a daemon: the interpreter waits for it at exit. A daemon thread still freeing a slab's
                # tensor when a short script ended (a load, then exit) aborted the process ("terminate called
                # without an active exception", exit 134) in 1 to 4 runs of 10.
                threading.Thread(target=_free, args=(slabs,), name="torchrelay-free-slabs").start()
            else:
                _free(slabs)
            self.timeline["freed"] = time.perf_counter() - self._began
        if self._error is not None:
            raise self._error

    def _describe(self, rel: str, items: list[ReadItem]) -> _File:
        path = safe_relpath(self.root, rel, self.root / ".metadata")
        parts: tuple[int, list[str]] | None = None
        more: list[Any] = []
        if self.expected is None:
            digest, size = None, os.stat(path).st_size
        elif rel in self.expected:
            digest, size, *more = self.expected[rel]
            if more and self.tuning.use_parts and sha256_parts.available():
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
        f = _File(rel, path, size, digest, items, parts, self.tuning.chunk_bytes)
        if f.nparts:  # each item waits for the parts that hold its bytes, the earliest to end first
            f.pending = sorted(items, key=self._end)
            if self.tuning.partial_reads:
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
        if (
            f.part <= self.tuning.chunk_bytes and f.part % _ALIGN == 0
        ):  # parts smaller than a read: a read a part, no more
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
            size = self._slab_size if self.tuning.reuse_slabs else _aligned(f.size)
            with self._cond:
                while True:
                    if self._error is not None:
                        return False
                    for slab in self._slabs:
                        view = slab.place(f.size)
                        if view is not None:
                            f.slab, f.view = slab, view[: f.size]
                            break
                    if f.slab is not None or not self._allocated or self._allocated + size <= self._budget:
                        break
                    self._cond.wait()
                if f.slab is None:
                    self._allocated += size
            if f.slab is None:  # allocated outside the lock: the reads of the files admitted go on meanwhile
                t0 = time.perf_counter()
                try:
                    slab = _Slab(size)
                except BaseException:
                    with self._cond:
                        self._allocated -= size
                    raise
                self._count("alloc", time.perf_counter() - t0)
                with self._cond:
                    self._slabs.append(slab)
                    view = slab.place(f.size)
                    assert view is not None  # a new slab holds any file whole
                    f.slab, f.view = slab, view[: f.size]
        self._opened.append(f)
        f.fd, _ = open_regular(
            f.path, what="checkpoint tensor file", root=self.root
        )  # a pipe: refused, not read
        return True

    def _release(self, f: _File) -> None:
        """The file is done: its room in the slab goes back (the slab itself, without reuse). Under _cond."""
        slab, f.slab, f.view = f.slab, None, memoryview(b"")
        if slab is not None:
            slab.files -= 1
            if not slab.files and not self.tuning.reuse_slabs:
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
                        f = min(self._reading[: self._at_once], key=lambda g: g.served)
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
        got = 0
        while got < want:
            n = os.preadv(f.fd, [f.view[start + got : start + want]], start + got)
            if not n:
                raise self._short(f, start + got)
            got += n
        t1 = time.perf_counter()
        with self._cond:
            self.timings["read"] += t1 - t0
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
        hasher = None if self.tuning.readers_hash_last and self._no_read_left(f, k) else self._hasher
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
        target.copy_(tensor)  # releases the GIL; to a GPU a pageable copy, finished when it returns
        t2 = time.perf_counter()
        with self._plan:
            self.planner.commit_tensor(req, target)
        with self._cond:
            self.timings["parse"] += t1 - t0
            self.timings["copy"] += t2 - t1
            self.timeline["copies_done"] = max(self.timeline["copies_done"], t2 - self._began)
        self._done_with(f)
