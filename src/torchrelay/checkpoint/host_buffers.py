"""Host buffers of their own mappings, page-locked by registration with CUDA in paced pieces (cudaHostAlloc on a
thread would hold every CUDA call of the training thread), their pages touched without the GIL, small ones cut from
shared slabs; and the background threads' lower CPU priority."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from typing import Any

import torch

# Nice value of the background threads (Linux: per thread). The loop keeps its core when cores are short.
BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux keeps a nice value per thread); best effort."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: it runs as it is
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))


# Buffers are page-locked by cudaHostRegister of mappings of their own, in pieces with pauses between them, on a
# background thread: cudaHostAlloc on a thread holds every CUDA call of the training thread for the whole
# allocation, a registration only for its own length (SaveTuning: pin_pace, pin_piece_bytes, pin_min_bytes).
PAGE = mmap.PAGESIZE


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


def touch(tensor: torch.Tensor) -> None:
    """Fault in every page of a flat uint8 host tensor (one byte written per page): a registration then only
    pins them, and a read into it faults nothing."""
    tensor[::PAGE].fill_(
        0
    )  # a torch fill releases the GIL: the loop's next launch does not wait for the touch


# A memfd's pages are small (shmem rarely has huge pages): one thread faulting them in was too slow to have the
# buffers ready before a first save, so a shared buffer is touched by several (SaveTuning.touch_threads).
_touch_pools: dict[int, Any] = {}
_touch_pool_lock = threading.Lock()


def touch_shared(tensor: torch.Tensor, threads: int = 4) -> None:
    """`touch`, by `threads` threads at once, each a page-aligned share of the buffer."""
    threads = max(1, threads)
    pages = -(-tensor.numel() // PAGE)
    if threads == 1 or pages < 2 * threads:
        touch(tensor)
        return
    with _touch_pool_lock:
        pool = _touch_pools.get(threads)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _touch_pools[threads] = ThreadPoolExecutor(
                threads, "torchrelay-touch", initializer=lower_priority
            )
    share = -(-pages // threads) * PAGE
    parts = [tensor[i : i + share] for i in range(0, tensor.numel(), share)]
    for done in [pool.submit(touch, part) for part in parts]:
        done.result()


class Locked:
    """One buffer's own mapping, page-locked by registration with CUDA until `release`. `shared`: a memfd's
    (MAP_SHARED), which the writer process maps too (writer_process.py); else anonymous and private."""

    def __init__(self, nbytes: int, *, shared: bool = False) -> None:
        self.size = -(-nbytes // PAGE) * PAGE  # what is page-locked: the mapping's last page in full
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


# Buffers under `pin_min_bytes` of a shared stage are cut from slabs of this size (one memfd each, one registration),
# not a memfd each: a state has hundreds of small tensors (biases, norms), and each mapping costs the writer a
# descriptor. Each buffer keeps a storage of exactly its own bytes (DCP's writer would clone a larger one).
SLAB_BYTES = 16 << 20
_ALIGN = 64


class Slabs:
    """Small buffers cut from shared slabs, each slab page-locked (when a CUDA tensor's buffer is in it)."""

    def __init__(self) -> None:
        self.slabs: list[Locked] = []
        self._used = SLAB_BYTES  # no slab yet

    def take(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        """A flat uint8 tensor of `nbytes` in a slab, and whether it is page-locked."""
        if self._used + nbytes > SLAB_BYTES:
            slab = Locked(SLAB_BYTES, shared=True)
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
