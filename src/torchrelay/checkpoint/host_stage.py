"""Host buffers a save copies the state into: one per tensor, allocated once (page-locked for CUDA tensors, so the
copy is a DMA at bus speed) and reused by every save. `HostStage.reserve` obtains them on a background thread ahead
of the first save, paced so that the loop's CUDA calls never wait for it (`SaveTuning.pin_pace`), and without the GIL: a
touch of a buffer's pages runs in torch (which releases it), never in Python.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch

from torchrelay.checkpoint.host_buffers import (
    PAGE,
    Locked,
    Slabs,
    copy_in_pieces,
    lower_priority,
    pieces,
    touch,
    touch_shared,
)
from torchrelay.checkpoint.torch_compat import dtensor_like, dtensor_local
from torchrelay.config.tuning import SaveTuning


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class SharedMap:
    """One shared mapping a stage's buffers live in, as the writer process maps it: `fd` (a memfd) of `size`
    bytes, at address `base` in this process."""

    def __init__(self, key: int, fd: int, size: int, base: int) -> None:
        self.key, self.fd, self.size, self.base = key, fd, size, base


Spec = tuple[tuple[int, ...], torch.dtype, bool]  # a buffer's kind: shape, dtype, page-locked


class _Entry:
    """One obtained buffer: the tensor, its own mapping (if any), whether a slab's is page-locked (if cut from one)."""

    def __init__(self, buf: torch.Tensor, locked: Locked | None, small: bool | None, nbytes: int) -> None:
        self.buf, self.locked, self.small, self.nbytes = buf, locked, small, nbytes


class HostStage:
    """Host copies of a state's tensors in buffers allocated once and reused by every save. `shared`: every
    buffer lives in a memfd mapping (`shared_maps`) that a writer process can map too."""

    def __init__(self, *, shared: bool = False, tuning: SaveTuning | None = None) -> None:
        self.shared = shared
        self.tuning = tuning or SaveTuning()
        self._slabs = Slabs()
        self._bufs: dict[str, torch.Tensor] = {}
        self._locked: dict[str, Locked] = {}
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
        # per_rank) are known only at the save, and asking DCP for them then would stall the loop.
        self._pool: dict[Spec, list[_Entry]] = {}
        self._could_spill = (
            False  # the reservation holds CUDA tensors: a save may cut it short (spill_to_device)
        )
        self._room: int | None = None  # device bytes the clones of this save may still take (spill_to_device)
        # key: its tensor's clone on the device, until `finish_deferred` copies it into key's buffer
        self._deferred: dict[str, torch.Tensor] = {}
        self.allocated_bytes = 0
        self.unlocked = 0  # buffers of CUDA tensors CUDA would not page-lock (their copies are synchronous)

    @staticmethod
    def _pinned(t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and torch.cuda.is_available()

    def _pause(self, seconds: float) -> None:
        """`pin_pace`'s pause after a registration of `seconds`, cut short when a save waits."""
        if not self._hurry.is_set():
            self._hurry.wait((self.tuning.pin_pace - 1) * seconds)

    def _touch(self, locked: Locked, threads: int | None = None) -> None:
        """Fault in a buffer's own mapping (a shared one by `touch_threads` threads, or `threads`)."""
        if locked.fd is None:
            touch(locked.tensor)
        else:
            touch_shared(locked.tensor, self.tuning.touch_threads if threads is None else threads)

    def _lock_pages(self, locked: Locked, pace: bool) -> None:
        """Fault in a buffer's own mapping, then page-lock it in `pin_piece_bytes` pieces (`pin_pace`'s pause
        after each, when `pace`)."""
        self._touch(locked)
        if not locked.lock(self.tuning.pin_piece_bytes, self._pause if pace else None):
            self.unlocked += 1

    def _make(self, spec: Spec, pace: bool, defer: bool = False) -> _Entry:
        """Allocate, touch and (for a CUDA tensor) page-lock one buffer of `spec`. `defer`: a large buffer's
        mapping only, untouched and pageable (`finish_deferred` touches and registers it)."""
        shape, dtype, pinned = spec
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        locked: Locked | None = None
        small: bool | None = None
        if self.shared and nbytes == 0:  # no bytes to share (the writer is sent the empty tensor itself)
            buf = torch.empty(shape, dtype=dtype)
        elif self.shared and nbytes < self.tuning.pin_min_bytes:
            with self._lock:
                flat, small = self._slabs.take(nbytes, pinned)
            buf = flat.view(dtype).view(shape)
        elif self.shared or (pinned and self.tuning.pin_by_register and nbytes >= self.tuning.pin_min_bytes):
            locked = Locked(nbytes, shared=self.shared)
            if pinned and not defer:
                self._lock_pages(locked, pace)
            elif not defer:  # a shared buffer of a CPU tensor: faulted in, never page-locked
                self._touch(locked)
            buf = locked.tensor[:nbytes].view(dtype).view(shape)
        elif pinned:
            t0 = time.perf_counter()
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
            if pace:
                self._pause(time.perf_counter() - t0)
        else:
            buf = torch.empty(shape, dtype=dtype)
            # the first touch of each page (a fault per page) happens here, not in the copy
            buf.view(-1).view(torch.uint8)[::PAGE].fill_(0)
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
        to the persist (`spill_to_device`: CUDA tensors), else it obtains the rest without pauses; `_lock_later`'s
        thread registers the rest without pauses (a copy into its buffers needs them)."""
        with self._lock:
            threads = list(self._threads)
        if not threads:
            return
        if self.tuning.spill_to_device and self._could_spill and torch.cuda.is_available():
            self._stop.set()
        self._hurry.set()
        for thread in threads:
            thread.join()
        with self._lock:
            self._threads = [t for t in self._threads if t not in threads]
        self._hurry.clear()  # `finish_deferred`'s registrations pause as the reservation did
        self._room = None  # asked again at this save's first clone

    def _spill(self, key: str, src: torch.Tensor) -> torch.Tensor | None:
        """key's copy left to the persist: its buffer's mapping and a clone of `src` on the device; None where that
        cannot be had (the copy then obtains its buffer now). Only where the device has the room, past
        `spill_headroom` of its memory left free (the loop's own peak is already held by torch's allocator)."""
        nbytes = src.numel() * src.element_size()
        tuning = self.tuning
        if (
            not (tuning.spill_to_device and self._pinned(src) and (self.shared or tuning.pin_by_register))
            or nbytes < tuning.pin_min_bytes
        ):
            return None
        if self._room is None:
            try:
                free, total = torch.cuda.mem_get_info(src.device)
            except RuntimeError:
                free, total = 0, 1
            self._room = int(free - tuning.spill_headroom * total)
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
        synchronous, a piece (`pin_piece_bytes`) a copy, on a stream of its own (`defer_threads`: by several
        threads at once, each its own buffers); drop the clones; then page-lock those buffers on a thread of their
        own, paced as the reservation is (the next save's copies wait for it, without its pauses). On the persist
        thread, before a byte is written: registering them first, paced, would make the persist and the next
        save's stall wait for it."""
        deferred = dict(self._deferred)  # `deferred` stays counted until every copy landed
        if not deferred:
            return
        device = next(iter(deferred.values())).device
        keys = list(deferred)
        threads = max(1, min(self.tuning.defer_threads, len(keys)))
        piece = self.tuning.pin_piece_bytes

        def fill(share: list[str]) -> None:
            stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(stream):
                for key in share:
                    locked = self._locked[key]
                    # one thread: its shared buffers faulted in by `touch_threads`; more: each its own buffers
                    self._touch(locked, None if threads == 1 else 1)
                    cuts = pieces(locked.tensor.data_ptr(), locked.size, piece)
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

    def _lock_later(self, todo: list[Locked]) -> None:
        """Page-lock `todo` (buffers already faulted in and filled) on a background thread with `pin_pace`'s pauses;
        the next save's `_end_reservation` lets it finish without them (it never stops short: a buffer a copy
        will use is locked before the copy)."""

        def register() -> None:
            lower_priority()
            for locked in todo:
                if self._quit.is_set():  # released: nothing will copy into them
                    return
                if not locked.lock(self.tuning.pin_piece_bytes, self._pause):
                    self.unlocked += 1

        self._start(register)

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with `t`'s values, in this key's buffer (call `synchronize` before reading it). A tensor
        with no buffer yet may be left to the persist (`spill_to_device`): the buffer returned then holds its values
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


__all__ = ["HostStage", "SharedMap", "specs_of"]
