"""The verified reader of a DCP checkpoint: every file hashed as its bytes arrive and parsed only once it matched.

Each file is read whole, front to back by a thread of its own (as many files at once as the threads and a share
of the node's available memory allow), into host memory allocated once per load and reused, hashed in order from
that memory, checked against its inventory entry, and only then are its items parsed from that same memory and
copied into their targets, on threads of their own while the next files are read. No byte is read twice.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from torchrelay.checkpoint.dcp_metadata import read_metadata
from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.checkpoint.items import _narrow, _parse_item, _refuse_transforms
from torchrelay.checkpoint.load_file import _DAMAGED, _File, describe
from torchrelay.checkpoint.load_memory import (
    _FALLBACK_BUFFER,
    _aligned,
    _free,
    _Slab,
    files_at_once,
    load_budget,
    reads_per_file,
    slab_size,
    slabs_budget,
)
from torchrelay.checkpoint.torch_compat import StorageInfo
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import CheckpointError, IntegrityError
from torchrelay.util import sha256_parts
from torchrelay.util.hashing import default_jobs
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
            files = [
                describe(self.root, rel, items, self.expected, self.storage, tuning)
                for rel, items in self.per_file.items()
            ]
            largest = max((f.size for f in files), default=0)
            total = sum(f.size for f in files)
            self._budget = load_budget(tuning)
            self._slab_size = slab_size(largest, total, self._budget)
            self._at_once = files_at_once(tuning, largest, self._budget)
            self._per_file = reads_per_file(tuning, len(files), largest, self._budget)
            reading = min(tuning.read_streams, len(files)) if self._per_file else self._at_once
            self._budget = slabs_budget(tuning, self._budget, self._slab_size, reading, largest)
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
        if not f.chunk_arrived(k):
            return  # the thread hashing the file hashes this chunk too
        if self._hasher is not None:  # the reading thread goes back to reading at once
            self._hasher.submit(self._guard, self._hash, f)
        else:
            self._hash(f)

    def _short(self, f: _File, at: int) -> IntegrityError:
        return IntegrityError(f"{f.path} has {at} bytes, the inventory says {f.size}", hint=_DAMAGED)

    def _arrived_in_parts(self, f: _File, k: int) -> None:
        """Chunk k is in: hash each part it completes (on a hash thread, or this one without them)."""
        ready = f.parts_arrived(k)
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
        ready, complete = f.part_matched(p, self.storage)
        for req in ready:
            self._parse.submit(self._guard, self._item, f, req)
        if complete:
            self._verified(f, by_parts=True)

    def _hash(self, f: _File) -> None:
        """Hash the file's arrived prefix (the caller set f.hashing); verify it once all of it is hashed."""
        t1 = time.perf_counter()
        f.hash_arrived()
        self._count("hash", time.perf_counter() - t1)
        if f.hashed_all():
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
