"""Host buffers a save copies the state into: one per tensor, allocated once (page-locked for CUDA tensors, so the
copy is a DMA at bus speed) and reused by every save. `HostStage.reserve` obtains them on a background thread ahead
of the first save, paced so that the loop's CUDA calls never wait for it (PIN_PACE), and without the GIL: a
touch of a buffer's pages runs in torch (which releases it), never in Python.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
from typing import Any

import torch

from torchrelay.checkpoint.torch_compat import dtensor_like, dtensor_local

# Nice value of the background threads (Linux: per thread). The loop keeps its core when cores are short.
BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux keeps a nice value per thread); best effort."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: it runs as it is
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# How the buffers become page-locked (issue 22; benchmarks/bench_pin.py, RESULTS.md). cudaHostAlloc on a thread
# blocks every CUDA call of the training thread for the whole allocation: 14.5 GB took 6-8 s on the H200 host, and
# the update after the first one waited for all of it (77-102x its time). A registration (cudaHostRegister) of
# memory already touched blocks the other threads' launches too, but only for its own length (17-28 GB/s: a few ms
# per 64 MiB buffer; a thread waiting for the GPU is not held up). So each buffer is an anonymous mapping of its
# own, advised to use huge pages, touched and then registered by one background thread at nice 10, one piece a
# call (PIN_PIECE_BYTES), each call followed by PIN_PACE - 1 times its length asleep: in the real loop (DDP, NCCL,
# 2026-12-04) no update over 1.1x, ready after 14-15 s for 14.5 GB (23-30 s on a fresh VM, whose never-touched
# memory registers slower). A save asked for before that leaves the rest to the persist (below).
PIN_PACE = 10
# A save asked for before the reservation is done: the tensors whose buffers are not obtained yet are copied on the
# device into spare device memory (a clone: device-to-device, a few ms for gigabytes), and the persist thread faults
# their buffers in and copies the clones into them (pageable), off the loop, before it writes; a thread then
# page-locks them, paced as the reservation is, before the next save's copies (`finish_deferred`). Without it, the
# save's stall obtained the rest itself: on a fresh H200 host the first save at update 200 (16.5 s in) stalled
# 1.95x the copy (RESULTS.md, issue 22 round five). Only when the
# device has the room, past SPILL_HEADROOM of its memory left free (the loop's own peak is already held by torch's
# allocator, so the clones take memory the loop does not use); else, and off CUDA, the stall obtains them as before.
SPILL_TO_DEVICE = True
SPILL_HEADROOM = 0.05
# Threads that fault in the deferred buffers and copy the clones into them (`finish_deferred`), each its own
# buffers. On fresh H200 hosts one thread (its shared buffers faulted in by TOUCH_THREADS) filled 3.5-6.7 GB at
# 2.6-2.9 GB/s, with no update over 1.08x meanwhile; four filled 3.5 GB at 4.8 GB/s (that first save's persist 0.97
# of the write floor instead of 0.72) but two updates during it took 1.12x and 1.18x (RESULTS.md tenth round): one.
DEFER_THREADS = 1
# Smaller buffers come from torch's pinned allocator (cudaHostAlloc of a few KiB holds the other threads' CUDA
# calls for microseconds), not a mapping each. Left pageable, their synchronous copies (144 biases of 16 KiB) made
# the stall 0.30-0.32 s where all-pinned buffers gave 0.27 s.
PIN_MIN_BYTES = 1 << 20
# False: torch's pinned allocator (cudaHostAlloc), as before issue 22 (the benchmarks compare the two). Measured and
# left (benchmarks/bench_touch_lock.py, RESULTS.md seventh round): a memfd's pages allocated by fallocate instead of
# touched make the registration map them under the mmap lock (the training thread's own mmap calls held 28-40 ms a
# buffer, against 3 ms touched). A buffer registered in pieces takes a copy per piece (PIN_PIECE_BYTES below): one
# copy spanning two registrations failed (the seventh round's).
PIN_BY_REGISTER = True
_PAGE = mmap.PAGESIZE
# A buffer is page-locked in pieces of this many bytes (cut at multiples of it in the address space), one
# registration each, the pause after each: a registration holds the training thread's launches for its own length,
# and on a fresh machine's first launch a 64 MiB buffer's took 12-22 ms, long enough to make 2 updates 1.24-1.51x
# (RESULTS.md, ninth round). A copy into such a buffer is one cudaMemcpyAsync per piece (a copy may not span two
# registrations: `copy_in_pieces`). 0: each buffer whole, as before.
PIN_PIECE_BYTES = 4 << 20


def pieces(base: int, size: int, piece: int) -> list[tuple[int, int]]:
    """[base, base + size) cut at the multiples of `piece` of the address (0: whole), as (offset from base,
    length). A mapping's base is page-aligned, so every cut is a multiple of any element's size."""
    if piece <= 0 or size <= 0:
        return [(0, size)]
    out, at = [], base
    while at < base + size:
        end = min(base + size, (at // piece + 1) * piece)
        out.append((at - base, end - at))
        at = end
    return out


def copy_in_pieces(
    dst: torch.Tensor, src: torch.Tensor, cuts: list[tuple[int, int]], non_blocking: bool
) -> None:
    """`dst.copy_(src)` (dst a contiguous buffer over a mapping cut in `cuts`, by byte offsets), one copy per cut
    that holds dst's bytes: an asynchronous copy into page-locked memory must lie within one registration."""
    if len(cuts) <= 1:
        dst.copy_(src, non_blocking=non_blocking)
        return
    # on the device: the flat byte view below needs one contiguous tensor, its conjugate or negation applied
    src = src.resolve_conj().resolve_neg().contiguous()
    nbytes = dst.numel() * dst.element_size()
    into = dst.reshape(-1).view(torch.uint8)
    come = src.reshape(-1).view(torch.uint8)
    for off, n in cuts:
        if off >= nbytes:
            break
        into[off : off + n].copy_(come[off : off + n], non_blocking=non_blocking)


# True: a buffer's pages are faulted in by a torch fill, which releases the GIL. False: by a memoryview
# assignment, which held it for the whole touch, and the loop's next launch waited: 11 of the 111 updates before
# the buffers were ready took 1.10-1.18x with it, none with the fill (benchmarks/RESULTS.md, issue 22).
TOUCH_WITHOUT_GIL = True


def touch(tensor: torch.Tensor) -> None:
    """Fault in every page of a flat uint8 host tensor (one byte written per page): a registration then only
    pins them, and a read into it faults nothing."""
    if TOUCH_WITHOUT_GIL:
        tensor[::_PAGE].fill_(0)
    else:
        view = tensor.numpy().data.cast("B")
        view[::_PAGE] = bytes(len(range(0, len(view), _PAGE)))


# Threads that fault in a shared buffer's pages together (each a contiguous share of it). A memfd's pages are small
# (shmem has no huge pages unless the administrator allows them), and on the H200 host one thread faulted them in at
# 1.6 GB/s against 4.9 GB/s for the huge-paged private mappings: 14.5 GB of shared buffers were then not ready before
# a first save 16.6 s into the launch (it finished them in its stall: 2.79 s, 10.6x the copy). The faults release
# the GIL (a torch fill), and the threads run at the background's priority.
TOUCH_THREADS = 4
_touch_pool: Any = None
_touch_pool_lock = threading.Lock()


def touch_shared(tensor: torch.Tensor) -> None:
    """`touch`, by TOUCH_THREADS threads at once, each a page-aligned share of the buffer."""
    global _touch_pool
    threads = max(1, TOUCH_THREADS)
    pages = -(-tensor.numel() // _PAGE)
    if threads == 1 or pages < 2 * threads:
        touch(tensor)
        return
    with _touch_pool_lock:
        if _touch_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _touch_pool = ThreadPoolExecutor(threads, "torchrelay-touch", initializer=lower_priority)
        pool = _touch_pool
    share = -(-pages // threads) * _PAGE
    parts = [tensor[i : i + share] for i in range(0, tensor.numel(), share)]
    for done in [pool.submit(touch, part) for part in parts]:
        done.result()


class _Locked:
    """One buffer's own mapping, page-locked by registration with CUDA until `release`. `shared`: a memfd's
    (MAP_SHARED), which the writer process maps too (writer_process.py); else anonymous and private."""

    def __init__(self, nbytes: int, *, shared: bool = False) -> None:
        self.size = -(-nbytes // _PAGE) * _PAGE  # what is page-locked: the mapping's last page in full
        self.fd: int | None = None
        if shared:
            self.fd = os.memfd_create("torchrelay-host", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            # exactly the tensor's bytes, as below; shmem rarely has huge pages (THP off for it by default)
            self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        else:
            # exactly the tensor's bytes: a larger storage would make DCP's writer clone the buffer first
            self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(
                AttributeError, OSError
            ):  # huge pages: fewer faults, a faster registration
                self.map.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False
        self.cuts = [(0, self.size)]  # the registrations' (offset, length): `lock`'s pieces once registered
        self._held: list[int] = []  # offsets registered

    def register_range(self, offset: int, length: int) -> bool:
        """cudaHostRegister of [offset, offset + length) of the mapping; False if CUDA refused."""
        try:  # torch raises some of cudaHostRegister's errors and returns the others
            ok = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr() + offset, length, 0)) == 0
        except Exception:  # noqa: BLE001 - any refusal leaves the buffer pageable: slower copies, the same bytes
            ok = False
        if ok:
            self._held.append(offset)
        return ok

    def lock(self, piece: int = 0, pause: Any = None) -> bool:
        """Page-lock the mapping in pieces of `piece` bytes (`pieces`; 0: whole), calling `pause(seconds)` after
        each registration; False if CUDA refused (the buffer stays pageable). A piece refused: the pieces taken are
        given back and the mapping is registered whole instead."""
        cuts = pieces(self.tensor.data_ptr(), self.size, piece)
        for off, n in cuts:
            t0 = time.perf_counter()
            if not self.register_range(off, n):
                self._unregister()
                if len(cuts) == 1:
                    return False
                cuts = [(0, self.size)]
                if not self.register_range(0, self.size):
                    return False
                break
            if pause is not None:
                pause(time.perf_counter() - t0)
        self.cuts, self.registered = cuts, True
        return True

    def register(self) -> bool:
        """Page-lock the whole mapping in one registration; False if CUDA refused."""
        return self.lock(0)

    def _unregister(self) -> None:
        base = self.tensor.data_ptr()
        for off in self._held:
            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(base + off)
        self._held.clear()
        self.cuts = [(0, self.size)]

    def copy_from(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst` (a view of this mapping from its start) := `src`: asynchronous, a copy per registration, if page-locked."""
        copy_in_pieces(dst, src, self.cuts, non_blocking=self.registered)

    def release(self) -> None:
        if self.registered or self._held:
            self.registered = False
            self._unregister()
        if self.fd is not None:  # the mapping itself lives on while a tensor over it does
            os.close(self.fd)
            self.fd = None


# Buffers under PIN_MIN_BYTES of a shared stage are cut from slabs of this size (one memfd each, one registration),
# not a memfd each: a state has hundreds of small tensors (biases, norms), and each mapping costs the writer a
# descriptor. Each buffer keeps a storage of exactly its own bytes (DCP's writer would clone a larger one).
SLAB_BYTES = 16 << 20
_ALIGN = 64


class _Slabs:
    """Small buffers cut from shared slabs, each slab page-locked (when a CUDA tensor's buffer is in it)."""

    def __init__(self) -> None:
        self.slabs: list[_Locked] = []
        self._used = SLAB_BYTES  # no slab yet

    def take(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        """A flat uint8 tensor of `nbytes` in a slab, and whether it is page-locked."""
        if self._used + nbytes > SLAB_BYTES:
            slab = _Locked(SLAB_BYTES, shared=True)
            touch(slab.tensor)
            self.slabs.append(slab)
            self._used = 0
        slab = self.slabs[-1]
        if pinned and not slab.registered:
            slab.register()
        buf = torch.frombuffer(slab.map, dtype=torch.uint8, count=nbytes, offset=self._used)
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return buf, slab.registered

    def release(self) -> None:
        for slab in self.slabs:
            slab.release()
        self.slabs.clear()
        self._used = SLAB_BYTES


class SharedMap:
    """One shared mapping a stage's buffers live in, as the writer process maps it: `fd` (a memfd) of `size`
    bytes, at address `base` in this process."""

    def __init__(self, key: int, fd: int, size: int, base: int) -> None:
        self.key, self.fd, self.size, self.base = key, fd, size, base


Spec = tuple[tuple[int, ...], torch.dtype, bool]  # a buffer's kind: shape, dtype, page-locked


class _Entry:
    """One obtained buffer: the tensor, its own mapping (if any), whether a slab's is page-locked (if cut from one)."""

    def __init__(self, buf: torch.Tensor, locked: _Locked | None, small: bool | None, nbytes: int) -> None:
        self.buf, self.locked, self.small, self.nbytes = buf, locked, small, nbytes


class HostStage:
    """Host copies of a state's tensors in buffers allocated once and reused by every save. `shared`: every
    buffer lives in a memfd mapping (`shared_maps`) that a writer process can map too."""

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self._slabs = _Slabs()
        self._bufs: dict[str, torch.Tensor] = {}
        self._locked: dict[str, _Locked] = {}
        self._small: dict[str, bool] = {}  # shared buffers cut from a slab: whether page-locked
        self._lock = threading.Lock()
        # the background threads obtaining or page-locking buffers (`reserve`, `_lock_later`): a first save before
        # `reserve` has its persist start one while the loop starts the other
        self._threads: list[threading.Thread] = []
        self._hurry = threading.Event()  # a save is waiting: no more pauses between registrations
        self._stop = threading.Event()  # a save is waiting: the reservation ends after its current buffer
        self._quit = threading.Event()  # the stage is released: every background thread ends after its buffer
        # Buffers the reservation obtained, by (shape, dtype, pinned), not yet given to a key: a copy takes one of
        # its tensor's kind. Kinds, not names: the names a save copies under (DCP's, a rank's own tensors under
        # per_rank) are known only at the save, and asking DCP for them cost the loop 6-11 ms (RESULTS.md).
        self._pool: dict[Spec, list[_Entry]] = {}
        self._could_spill = (
            False  # the reservation holds CUDA tensors: a save may cut it short (SPILL_TO_DEVICE)
        )
        self._room: int | None = None  # device bytes the clones of this save may still take (SPILL_TO_DEVICE)
        # key: its tensor's clone on the device, until `finish_deferred` copies it into key's buffer
        self._deferred: dict[str, torch.Tensor] = {}
        self.allocated_bytes = 0
        self.unlocked = 0  # buffers of CUDA tensors CUDA would not page-lock (their copies are synchronous)

    @staticmethod
    def _pinned(t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and torch.cuda.is_available()

    def _pause(self, seconds: float) -> None:
        """PIN_PACE's pause after a registration of `seconds`, cut short when a save waits."""
        if not self._hurry.is_set():
            self._hurry.wait((PIN_PACE - 1) * seconds)

    def _lock_pages(self, locked: _Locked, pace: bool) -> None:
        """Fault in a buffer's own mapping, then page-lock it in PIN_PIECE_BYTES pieces (PIN_PACE's pause after
        each, when `pace`)."""
        (touch_shared if locked.fd is not None else touch)(locked.tensor)
        if not locked.lock(PIN_PIECE_BYTES, self._pause if pace else None):
            self.unlocked += 1

    def _make(self, spec: Spec, pace: bool, defer: bool = False) -> _Entry:
        """Allocate, touch and (for a CUDA tensor) page-lock one buffer of `spec`. `defer`: a large buffer's
        mapping only, untouched and pageable (`finish_deferred` touches and registers it)."""
        shape, dtype, pinned = spec
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        locked: _Locked | None = None
        small: bool | None = None
        if self.shared and nbytes == 0:  # no bytes to share (the writer is sent the empty tensor itself)
            buf = torch.empty(shape, dtype=dtype)
        elif self.shared and nbytes < PIN_MIN_BYTES:
            with self._lock:
                flat, small = self._slabs.take(nbytes, pinned)
            buf = flat.view(dtype).view(shape)
        elif self.shared or (pinned and PIN_BY_REGISTER and nbytes >= PIN_MIN_BYTES):
            locked = _Locked(nbytes, shared=self.shared)
            if pinned and not defer:
                self._lock_pages(locked, pace)
            elif not defer:  # a shared buffer of a CPU tensor: faulted in, never page-locked
                touch_shared(locked.tensor)
            buf = locked.tensor[:nbytes].view(dtype).view(shape)
        elif pinned:
            t0 = time.perf_counter()
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
            if pace:
                self._pause(time.perf_counter() - t0)
        else:
            buf = torch.empty(shape, dtype=dtype)
            # the first touch of each page (a fault per page) happens here, not in the copy
            buf.view(-1).view(torch.uint8)[::_PAGE].fill_(0)
        return _Entry(buf, locked, small, nbytes)

    def _publish(self, key: str, entry: _Entry, *, counted: bool = False) -> torch.Tensor:
        """Make `entry` key's buffer (the one it had is given back); its bytes are counted unless `counted`."""
        with self._lock:
            old = self._locked.pop(key, None)
            if old is not None:
                old.release()
            self._small.pop(key, None)
            if entry.locked is not None:
                self._locked[key] = entry.locked
            if entry.small is not None:
                self._small[key] = entry.small
            self._bufs[key] = entry.buf
            if not counted:
                self.allocated_bytes += entry.nbytes
        return entry.buf

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor | None:
        """key's buffer for `t`: its own, else one of the pool's of t's kind, else None."""
        buf = self._bufs.get(key)
        if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
            return buf
        spec = (tuple(t.shape), t.dtype, self._pinned(t))
        with self._lock:
            free = self._pool.get(spec)
            entry = free.pop() if free else None
        return None if entry is None else self._publish(key, entry, counted=True)

    def reserve(self, specs: list[Spec]) -> None:
        """Allocate buffers for tensors of `specs` (`specs_of`) on a background thread, paced so that no update of
        the loop waits for it; a copy takes one of its tensor's kind."""
        self._could_spill = any(pinned for _, _, pinned in specs)
        self._stop.clear()
        self._hurry.clear()

        def allocate() -> None:
            lower_priority()
            for spec in specs:
                if self._stop.is_set() or self._quit.is_set():
                    return
                entry = self._make(spec, pace=True)
                with self._lock:
                    self._pool.setdefault(spec, []).append(entry)
                    self.allocated_bytes += entry.nbytes

        self._start(allocate)

    def _start(self, work: Any) -> None:
        """Run `work` on a background thread of this stage's (`_end_reservation` joins it)."""
        thread = threading.Thread(target=work, name="torchrelay-reserve", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def join(self) -> None:
        """Wait for every background thread to end on its own, paced as it is (tests and benchmarks)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    @property
    def ready(self) -> bool:
        """Whether no buffer is being obtained: every background thread ended (or none began), nothing deferred."""
        with self._lock:
            threads = list(self._threads)
        return not any(t.is_alive() for t in threads) and not self._deferred

    def _end_reservation(self) -> None:
        """A save is here: the reservation thread ends after the buffer it is on where its copies could be left
        to the persist (SPILL_TO_DEVICE: CUDA tensors), else it obtains the rest without pauses; `_lock_later`'s
        thread registers the rest without pauses (a copy into its buffers needs them)."""
        with self._lock:
            threads = list(self._threads)
        if not threads:
            return
        if SPILL_TO_DEVICE and self._could_spill and torch.cuda.is_available():
            self._stop.set()
        self._hurry.set()
        for thread in threads:
            thread.join()
        with self._lock:
            self._threads = [t for t in self._threads if t not in threads]
        self._hurry.clear()  # `finish_deferred`'s registrations pause as the reservation did
        self._room = None  # asked again at this save's first clone

    def _spill(self, key: str, src: torch.Tensor) -> torch.Tensor | None:
        """key's copy left to the persist (see SPILL_TO_DEVICE): its buffer's mapping and a clone of `src` on
        the device; None where that cannot be had (the copy then obtains its buffer now)."""
        nbytes = src.numel() * src.element_size()
        if (
            not (SPILL_TO_DEVICE and self._pinned(src) and (self.shared or PIN_BY_REGISTER))
            or nbytes < PIN_MIN_BYTES
        ):
            return None
        if self._room is None:
            try:
                free, total = torch.cuda.mem_get_info(src.device)
            except RuntimeError:
                free, total = 0, 1
            self._room = int(free - SPILL_HEADROOM * total)
        if nbytes > self._room:
            return None
        try:
            clone = src.clone()
        except torch.cuda.OutOfMemoryError:
            self._room = 0
            return None
        self._room -= nbytes
        buf = self._publish(key, self._make((tuple(src.shape), src.dtype, True), pace=False, defer=True))
        self._deferred[key] = clone
        return buf

    @property
    def deferred(self) -> int:
        """How many copies wait for `finish_deferred`."""
        return len(self._deferred)

    def finish_deferred(self) -> None:
        """Fault in the buffers a save left to the persist and copy each tensor's clone into its own, pageable and
        synchronous, a piece (PIN_PIECE_BYTES) a copy, on a stream of its own (DEFER_THREADS: by several threads
        at once, each its own buffers); drop the clones; then page-lock those buffers on a thread of their own, paced as the reservation
        is (the next save's copies wait for it, without its pauses). On the persist thread, before a byte is
        written. Registering them here first, paced, took 12.8 s on a fresh H200 host: its persist 30.6 s, and the
        next save's stall waited for it (4.9 s, RESULTS.md tenth round)."""
        deferred = dict(self._deferred)  # `deferred` stays counted until every copy landed
        if not deferred:
            return
        device = next(iter(deferred.values())).device
        keys = list(deferred)
        threads = max(1, min(DEFER_THREADS, len(keys)))

        def fill(share: list[str]) -> None:
            stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(stream):
                for key in share:
                    locked = self._locked[key]
                    # one thread: its shared buffers faulted in by TOUCH_THREADS; more: each its own buffers
                    (touch_shared if locked.fd is not None and threads == 1 else touch)(locked.tensor)
                    cuts = pieces(locked.tensor.data_ptr(), locked.size, PIN_PIECE_BYTES)
                    copy_in_pieces(self._bufs[key], deferred[key], cuts, non_blocking=False)
                stream.synchronize()

        if threads == 1:
            fill(keys)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads, "torchrelay-defer", initializer=lower_priority) as pool:
                for done in [pool.submit(fill, keys[i::threads]) for i in range(threads)]:
                    done.result()
        self._lock_later([self._locked[key] for key in keys])  # before `ready` can see nothing deferred
        self._deferred.clear()  # the clones' memory goes back to torch's allocator once every copy from it is done
        deferred.clear()

    def _lock_later(self, todo: list[_Locked]) -> None:
        """Page-lock `todo` (buffers already faulted in and filled) on a background thread with PIN_PACE's pauses;
        the next save's `_end_reservation` lets it finish without them (it never stops short: a buffer a copy
        will use is locked before the copy)."""

        def register() -> None:
            lower_priority()
            for locked in todo:
                if self._quit.is_set():  # released: nothing will copy into them
                    return
                if not locked.lock(PIN_PIECE_BYTES, self._pause):
                    self.unlocked += 1

        self._start(register)

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with `t`'s values, in this key's buffer (call `synchronize` before reading it). A tensor
        with no buffer yet may be left to the persist (SPILL_TO_DEVICE): the buffer returned then holds its values
        only after `finish_deferred`."""
        self._end_reservation()
        if _is_dtensor(t):
            return dtensor_like(self.copy(key, dtensor_local(t)), t)
        src = t.detach()
        self._deferred.pop(key, None)  # a clone a failed persist left is not this save's
        buf = self._buffer(key, src)
        if buf is None:
            spare = self._spill(key, src)
            if spare is not None:
                return spare
            pinned = self._pinned(src)
            buf = self._publish(key, self._make((tuple(src.shape), src.dtype, pinned), pace=False))
        locked = self._locked.get(key)
        if locked is not None:
            if self._pinned(src):
                locked.copy_from(buf, src)
            else:
                buf.copy_(src)
            return buf
        page_locked = self._small[key] if key in self._small else buf.is_pinned()
        buf.copy_(src, non_blocking=self._pinned(src) and page_locked)
        return buf

    def shared_maps(self) -> list[SharedMap]:
        """Every mapping this (shared) stage's buffers live in."""
        with self._lock:
            owners = [*self._locked.values(), *self._slabs.slabs]
            return [
                SharedMap(id(m), m.fd, len(m.map), m.tensor.data_ptr()) for m in owners if m.fd is not None
            ]

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
        self._quit.set()
        try:
            self._end_reservation()
        finally:
            self._quit.clear()
        self._deferred.clear()
        with self._lock:
            for locked in self._locked.values():
                locked.release()
            self._locked.clear()
            for entries in self._pool.values():
                for entry in entries:
                    if entry.locked is not None:
                        entry.locked.release()
            self._pool.clear()
            self._slabs.release()
            self._small.clear()
            self._bufs.clear()
            self.allocated_bytes = 0


def specs_of(obj: Any) -> list[Spec]:
    """The kind (shape, dtype, pinned) of every tensor in `obj` (nested dicts, lists and tuples; a DTensor's local
    shard), for `HostStage.reserve`."""
    if isinstance(obj, torch.Tensor):
        local = dtensor_local(obj) if _is_dtensor(obj) else obj
        return [(tuple(local.shape), local.dtype, local.device.type == "cuda" and torch.cuda.is_available())]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [spec for v in obj for spec in specs_of(v)]
    return []


__all__ = ["BACKGROUND_NICE", "HostStage", "SharedMap", "lower_priority", "specs_of", "touch"]
