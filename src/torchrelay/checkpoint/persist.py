"""Saving without stalling the loop: the state is copied into host buffers kept from save to save, then written,
hashed, fsynced and committed on a thread of its own while training goes on.

- `HostStage`: one host buffer per tensor, allocated once (page-locked for CUDA tensors, so the copy is a DMA at
  bus speed) and reused by every save; `reserve` allocates them on a background thread ahead of the first save,
  paced so that the loop's CUDA calls never wait for it (PIN_PACE).
- `HashingWriter`: DCP's FileSystemWriter whose files are hashed from the very bytes written to them (no read
  back), and spread over several files per rank, so that writing and SHA-256 run on as many cores as files
  (one SHA-256 stream runs at about disk speed, 1.4 GB/s: one file per rank would halve the rate).
- `Persister`: one background job at a time. A save asked for while one persists waits for it (the buffers are
  reused, so two saves never overlap); its error reaches the training thread at the next save, stop or close.

The loop shares the interpreter with the persist: every Python-level step of the writer (torch.save's pickling,
its ~40 small writes per tensor) holds the GIL the training thread needs to launch its next kernel. So DCP's plan
is made during the stall (dcp_save.py), the background threads run at a lower CPU priority, write small pieces in
batches, and at most `PERSIST_STREAMS` of them write at once (the file count stays a function of the tensors
alone; only the concurrency varies). A file's fsync needs no slot, and its writeback starts as it is written
(KICK_BYTES): the disk works while the writers fill the page cache. The process's GIL switch interval is left as
it is: with the plan off the persist thread, a shorter one measured no better on the H200 host (benchmarks/
RESULTS.md, issue 22).

The bytes written are the same whether the job runs on the background thread or inline (`async_save: false`):
both go through the same staging and the same writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from torchrelay import envvars
from torchrelay.checkpoint.torch_compat import dtensor_like, dtensor_local

# Per-rank DCP files: about one per 256 MiB of tensors, at most 16 (a core each), at most one per tensor.
FILE_BYTES = 256 << 20
MAX_FILES = 16
# Files a rank writes at once in the background; the others wait their turn. Eight streams of SHA-256 (1.3 GB/s
# each on the H200 host) outrun its disk (1.8 GB/s) while leaving the GIL to the loop more often than sixteen.
STREAMS_ENV = envvars.PERSIST_STREAMS.name
PERSIST_STREAMS = 8
# Every this many bytes a file's writeback is started (0: left to the kernel until the fsync). On the H200 host,
# 3 saves each: committed after 7.0-9.0 s with it, 7.8-9.4 s without (benchmarks/RESULTS.md).
KICK_BYTES = 64 << 20
# Nice value of the background writer threads (Linux: per thread). The loop keeps its core when cores are short.
BACKGROUND_NICE = 10
# Writes smaller than this are gathered (torch.save's zip headers, pickles, padding) and hashed and written together.
_SMALL = 256 << 10
_BATCH = 1 << 20

Digests = dict[str, tuple[str, int]]  # absolute path -> (hex SHA-256, size)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# --- hashing while writing ---------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write-only file that feeds every byte to SHA-256 on its way to disk; files are written front to back.
    Small writes are gathered and passed on together: fewer trips through the GIL per tensor.
    `on_written`: called once every byte is written, when the writer asks for the descriptor to fsync it."""

    def __init__(
        self, f: Any, on_close: Callable[[str, int], None], on_written: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self._f, self._h, self._n, self._on_close = f, hashlib.sha256(), 0, on_close
        self._on_written = on_written
        self._pending = bytearray()
        self._kicked = 0  # bytes handed to the kernel's writeback so far (KICK_BYTES)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n < _SMALL:
            self._pending += view
            if len(self._pending) >= _BATCH:
                self._drain()
        else:
            self._drain()
            self._pass_on(view)
        self._n += n
        return n

    def _pass_on(self, view: memoryview | bytearray) -> None:
        self._h.update(view)  # releases the GIL for large buffers, as the write below does
        self._f.write(view)
        if KICK_BYTES and self._n + len(view) - self._kicked >= KICK_BYTES:
            self._kick(self._n + len(view))

    def _kick(self, upto: int) -> None:
        """Start writing back what this file holds so far (Linux: DONTNEED begins the writeback of dirty pages
        and drops them once clean), so that the disk works while the writers fill the page cache and the final
        fsync has little left; best effort."""
        self._f.flush()
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(self._f.fileno(), self._kicked, upto - self._kicked, os.POSIX_FADV_DONTNEED)
        self._kicked = upto

    def _drain(self) -> None:
        if self._pending:
            self._pass_on(self._pending)
            self._pending = bytearray()

    def tell(self) -> int:
        return self._n

    def fileno(self) -> int:
        self.flush()  # a caller that fsyncs the descriptor means every byte written so far
        if self._on_written is not None:
            self._on_written()
        return int(self._f.fileno())

    def flush(self) -> None:
        self._drain()
        self._f.flush()

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self._on_close(self._h.hexdigest(), self._n)
        super().close()


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux keeps a nice value per thread); best effort."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: it runs as it is
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))


def persist_streams() -> int:
    """How many files a rank writes at once in the background (TORCHRELAY_PERSIST_STREAMS, else PERSIST_STREAMS)."""
    streams = envvars.PERSIST_STREAMS.get()
    return PERSIST_STREAMS if streams is None else max(1, streams)


class _HashingFileSystem(FileSystem):
    def __init__(self, sink: Digests, background: bool) -> None:
        super().__init__()
        self.sink = sink
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(persist_streams()) if background else None  # None: inline

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        key = str(path)

        def done(digest: str, size: int) -> None:
            with self._lock:
                self.sink[key] = (digest, size)

        slot = self._slots
        if slot is not None:
            _lower_priority()  # a writer thread of this persist (DCP's or the persist's own): it ends with the save
            slot.acquire()

        def free() -> None:
            # Once the file's bytes are all written its fsync needs no slot (it holds no GIL), and the next file
            # fills the page cache while the disk flushes this one. Frees the slot once.
            nonlocal slot
            held, slot = slot, None
            if held is not None:
                held.release()

        try:
            with open(path, "wb") as f:
                stream = _HashingStream(f, done, free)
                try:
                    yield stream
                finally:
                    stream.close()
        finally:
            free()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if str(path) in self.sink:
                self.sink[str(new_path)] = self.sink.pop(str(path))


class HashingWriter(dcp.FileSystemWriter):
    """FileSystemWriter (fsynced files) that records each file's SHA-256 and size in `digests` as it writes it,
    and splits a rank's tensors over several files (a function of the tensors alone, never of the machine).
    `background`: it runs beside the training loop (lower priority, at most `persist_streams()` files at once);
    never set it for a write on the training thread, whose priority it would lower for good."""

    def __init__(self, path: Path, digests: Digests, *, background: bool = False) -> None:
        super().__init__(str(path), sync_files=True)
        self.fs = _HashingFileSystem(digests, background)

    def write_data(self, plan: Any, planner: Any) -> Any:
        # the final plan: what this rank writes once DCP has given each replicated tensor to one rank
        sizes = [_item_bytes(item) for item in plan.items if item.tensor_data is not None]
        self.thread_count = min(MAX_FILES, max(1, math.ceil(sum(sizes) / FILE_BYTES)), max(1, len(sizes)))
        return super().write_data(plan, planner)


def _item_bytes(item: Any) -> int:
    size = item.tensor_data.properties.dtype.itemsize
    for n in item.tensor_data.size:
        size *= n
    return int(size)


def canonical_safetensors(data: bytes) -> bytes:
    """safetensors bytes with their JSON header's keys sorted: the library writes its metadata in hash order, so
    the same tensors gave different bytes from save to save. Offsets count from the end of the header, so the
    tensor bytes stay as they are; any safetensors reader reads the result."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the header is padded with spaces to keep the tensors 8-byte aligned
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def write_bytes(path: Path, data: bytes | memoryview, digests: Digests) -> None:
    """Write a small file whole, fsync it, and record the SHA-256 of the bytes written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    digests[str(path)] = (hashlib.sha256(data).hexdigest(), len(data))


# --- host buffers --------------------------------------------------------------------------------------

# How the buffers become page-locked (issue 22; benchmarks/bench_pin.py, RESULTS.md). cudaHostAlloc on a thread
# blocks every CUDA call of the training thread for the whole allocation: 14.5 GB took 6-8 s on the H200 host, and
# the update after the first one waited for all of it (77-102x its time). A registration (cudaHostRegister) of
# memory already touched blocks the other threads' launches too, but only for its own length (17-28 GB/s: a few ms
# per 64 MiB buffer; a thread waiting for the GPU is not held up). So each buffer is an anonymous mapping of its
# own, advised to use huge pages, touched and then registered by one background thread at nice 10, one buffer a
# call, each call followed by PIN_PACE - 1 times its length asleep: no update over 1.05x, 0.02-0.04 s lost in all,
# ready after 6-10 s for 14.5 GB. A save asked for before that finishes the rest without pauses.
PIN_PACE = 10
# Smaller buffers come from torch's pinned allocator (cudaHostAlloc of a few KiB holds the other threads' CUDA
# calls for microseconds), not a mapping each. Left pageable, their synchronous copies (144 biases of 16 KiB) made
# the stall 0.30-0.32 s where all-pinned buffers gave 0.27 s.
PIN_MIN_BYTES = 1 << 20
# False: torch's pinned allocator (cudaHostAlloc), as before issue 22 (the benchmarks compare the two).
PIN_BY_REGISTER = True
_PAGE = mmap.PAGESIZE


def _touch(view: memoryview) -> None:
    """Fault in every page of `view` (one byte written per page): the registration then only pins them."""
    view[::_PAGE] = bytes(len(range(0, len(view), _PAGE)))


class _Locked:
    """One buffer's own anonymous mapping, page-locked by registration with CUDA until `release`."""

    def __init__(self, nbytes: int) -> None:
        # exactly the tensor's bytes: a larger storage would make DCP's writer clone the buffer before writing it
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.size = -(-nbytes // _PAGE) * _PAGE  # what is page-locked: the mapping's last page in full
        with contextlib.suppress(AttributeError, OSError):  # huge pages: fewer faults, a faster registration
            self.map.madvise(mmap.MADV_HUGEPAGE)
        with memoryview(self.map) as view:
            _touch(view)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False

    def register(self) -> bool:
        """Page-lock the mapping (cudaHostRegister); False if CUDA refused (the buffer stays pageable)."""
        try:  # torch raises some of cudaHostRegister's errors and returns the others
            self.registered = (
                int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)) == 0
            )
        except Exception:  # noqa: BLE001 - any refusal leaves the buffer pageable: slower copies, the same bytes
            self.registered = False
        return self.registered

    def release(self) -> None:
        if self.registered:
            self.registered = False
            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


class HostStage:
    """Host copies of a state's tensors in buffers allocated once and reused by every save."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._locked: dict[str, _Locked] = {}
        self._lock = threading.Lock()
        self._reserving: threading.Thread | None = None
        self._hurry = threading.Event()  # a save is waiting: no more pauses between registrations
        self.allocated_bytes = 0
        self.unlocked = 0  # buffers of CUDA tensors CUDA would not page-lock (their copies are synchronous)

    @staticmethod
    def _pinned(t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and torch.cuda.is_available()

    def _new(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, pace: bool) -> None:
        """Allocate, touch and (for a CUDA tensor) page-lock key's buffer, then publish it."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        locked: _Locked | None = None
        if pinned and (not PIN_BY_REGISTER or nbytes < PIN_MIN_BYTES):
            t0 = time.perf_counter()
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
            if pace and not self._hurry.is_set():
                self._hurry.wait((PIN_PACE - 1) * (time.perf_counter() - t0))
        elif pinned:
            locked = _Locked(nbytes)
            t0 = time.perf_counter()
            if not locked.register():
                self.unlocked += 1
            if pace and not self._hurry.is_set():
                self._hurry.wait((PIN_PACE - 1) * (time.perf_counter() - t0))
            buf = locked.tensor[:nbytes].view(dtype).view(shape)
        else:
            buf = torch.empty(shape, dtype=dtype)
            # the first touch of each page (a fault per page) happens here, not in the copy
            buf.view(-1).view(torch.uint8)[::_PAGE].fill_(0)
        with self._lock:
            old = self._locked.pop(key, None)
            if old is not None:
                old.release()
            if locked is not None:
                self._locked[key] = locked
            self._bufs[key] = buf
            self.allocated_bytes += nbytes

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            self._new(key, tuple(t.shape), t.dtype, self._pinned(t), pace=False)
            buf = self._bufs[key]
        return buf

    def reserve(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype, bool]]) -> None:
        """Allocate the buffers of `shapes` ({key: (shape, dtype, pinned)}) on a background thread, paced so
        that no update of the loop waits for it; `copy` waits for what is left."""

        def allocate() -> None:
            _lower_priority()
            for key, (shape, dtype, pinned) in shapes.items():
                buf = self._bufs.get(key)
                if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
                    self._new(key, tuple(shape), dtype, pinned, pace=True)

        self._reserving = threading.Thread(target=allocate, name="torchrelay-reserve", daemon=True)
        self._reserving.start()

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with `t`'s values, in this key's buffer (call `synchronize` before reading it)."""
        if self._reserving is not None:
            self._hurry.set()
            self._reserving.join()
            self._reserving = None
        if _is_dtensor(t):
            return dtensor_like(self.copy(key, dtensor_local(t)), t)
        src = t.detach()
        buf = self._buffer(key, src)
        locked = self._locked.get(key)
        buf.copy_(
            src,
            non_blocking=self._pinned(src) and (locked.registered if locked else buf.is_pinned()),
        )
        return buf

    def copy_tree(self, prefix: str, obj: Any) -> Any:
        """`obj` (nested dicts of tensors) with every tensor replaced by its host copy."""
        if isinstance(obj, torch.Tensor):
            return self.copy(prefix, obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(f"{prefix}/{k}", v) for k, v in obj.items()}
        return obj

    @staticmethod
    def synchronize() -> None:
        """Wait for the copies from the GPU (non-blocking, on the current stream) to land."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def release(self) -> None:
        """Unlock and drop every buffer (once nothing reads them: after the last persist); a later copy
        allocates again."""
        if self._reserving is not None:
            self._hurry.set()
            self._reserving.join()
            self._reserving = None
        with self._lock:
            for locked in self._locked.values():
                locked.release()
            self._locked.clear()
            self._bufs.clear()
            self.allocated_bytes = 0


def shapes_of(prefix: str, obj: Any, out: dict[str, tuple[tuple[int, ...], torch.dtype, bool]]) -> None:
    """{key: (shape, dtype, pinned)} of the tensors `HostStage.copy_tree(prefix, obj)` would copy."""
    if isinstance(obj, torch.Tensor):
        local = dtensor_local(obj) if _is_dtensor(obj) else obj
        out[prefix] = (
            tuple(local.shape),
            local.dtype,
            local.device.type == "cuda" and torch.cuda.is_available(),
        )
    elif isinstance(obj, dict):
        for k, v in obj.items():
            shapes_of(f"{prefix}/{k}", v, out)


# --- the background job ----------------------------------------------------------------------------------


class Persister:
    """Runs one persist job at a time on a thread of its own (or inline when `background` is false)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.update: int | None = None
        self.persisting = threading.Event()  # set while a job runs (tests observe it)
        # Tests only: a background job waits until this file exists before it writes anything, so that a test can
        # observe the loop going on, or a stop arriving, while a checkpoint is in flight (without timing).
        self.hold: Path | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, update: int, job: Callable[[], None]) -> None:
        """Run `job` (write and commit checkpoint-<update>); the previous job must have been waited for."""
        assert not self.in_flight, "wait() before the next submit()"
        self.update, self.started_at = update, time.perf_counter()
        if not self.background:
            try:
                job()
            finally:
                self.update = self.started_at = None
            return

        hold = self.hold

        def run() -> None:
            _lower_priority()
            self.persisting.set()
            try:
                while hold and not os.path.exists(hold):
                    time.sleep(0.01)
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = exc
            finally:
                self.persisting.clear()

        self._thread = threading.Thread(target=run, name=f"torchrelay-persist-{update}", daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        """Seconds the job in flight has run (0 when none)."""
        return time.perf_counter() - self.started_at if self.in_flight and self.started_at else 0.0

    def wait(self) -> None:
        """Block until the job in flight has committed; raise what it raised (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.update = self.started_at = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


__all__ = ["HashingWriter", "canonical_safetensors", "HostStage", "Persister", "shapes_of", "write_bytes"]
