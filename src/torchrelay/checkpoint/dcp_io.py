"""Model and optimizer tensors through torch.distributed.checkpoint, read back without executing pickles.

DCP writes its `.metadata` with pickle. torchrelay reads it only through an unpickler that admits the
handful of DCP and torch classes a metadata file is made of, gives state (BUILD) only to fresh instances of
DCP's own record types, refuses byte (pickled object) entries and checks the type of everything it returns,
so a planted payload is refused instead of run. Every shard path it names must be a file of the checkpoint's
inventory. Tensor shards are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from torchrelay.checkpoint.inventory import INVENTORY, read_inventory, safe_relpath
from torchrelay.errors import CheckpointError, IntegrityError, UnsafeInput
from torchrelay.fsutil import read_bounded
from torchrelay.util.hashing import default_jobs

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
# The only types a BUILD may give state to: instances DCP pickles as NEWOBJ + BUILD. A class object, an enum
# member or a dtype is shared by the whole process; state given to one would change it everywhere.
_BUILDABLE = (
    Metadata,
    TensorStorageMetadata,
    TensorProperties,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)
# A file no DCP writer makes this large; reading an endless one (a device) must stop somewhere.
METADATA_LIMIT = 4 << 30


# The Python unpickler, not the C one: its dispatch table can be hooked, so BUILD is checked before it acts.
class _SafeUnpickler(pickle._Unpickler):
    dispatch = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the pickle machine's stack (undocumented, so not in typeshed)

    def __init__(self, data: bytes, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeInput(
            f"{self.source}: refers to {module}.{name}, which a DCP metadata file never holds; refusing to load it",
            hint="the checkpoint was tampered with or is not a torchrelay checkpoint",
        )

    def load_build(self) -> None:
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("BUILD on an empty stack")
        target, state = self.stack[-2], self.stack[-1]
        if type(target) not in _BUILDABLE:
            what = f"the class {target.__qualname__}" if isinstance(target, type) else type(target).__name__
            raise UnsafeInput(
                f"{self.source}: gives state to {what}, which DCP never does (it would change it for the "
                "whole process); refusing to load it",
                hint="the checkpoint was tampered with or is not a torchrelay checkpoint",
            )
        dicts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in dicts:
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise UnsafeInput(
                    f"{self.source}: sets a special attribute of a {type(target).__name__}; refusing to load it",
                    hint="the checkpoint was tampered with or is not a torchrelay checkpoint",
                )
        super().load_build()  # type: ignore[misc]  # typeshed does not declare the undocumented loaders

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]  # typeshed types it for the base class


def read_metadata(ckpt_model_dir: Path) -> Metadata:
    """DCP's `.metadata`, through the allow-listed unpickler, type-checked; every shard it names must be a file
    of the checkpoint's inventory (COMPLETE.json) and each read must lie inside it."""
    path = ckpt_model_dir / ".metadata"
    data = read_bounded(path, METADATA_LIMIT, what="DCP metadata")
    try:
        md = _SafeUnpickler(data, path).load()
    except UnsafeInput:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is an unreadable checkpoint
        raise UnsafeInput(
            f"{path}: unreadable DCP metadata ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    _check_types(md, path)
    _check_storage(md, ckpt_model_dir, path)
    return md


def _bad(path: Path, what: str) -> UnsafeInput:
    return UnsafeInput(
        f"{path}: {what}; not DCP metadata as torch writes it",
        hint="the checkpoint was tampered with or is damaged; resume from another checkpoint",
    )


def _is_size(value: object) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def _check_types(md: object, path: Path) -> None:
    """Everything a load will touch has the type DCP gives it (a forged file may hold anything allow-listed)."""
    if not isinstance(md, Metadata):
        raise _bad(path, f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise _bad(path, "state_dict_metadata is not a dict")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _bad(path, f"entry name {key!r} is not text")
        if isinstance(item, BytesStorageMetadata):
            raise UnsafeInput(
                f"{path}: entry {key!r} is a pickled object; torchrelay checkpoints hold tensors only"
            )
        if not isinstance(item, TensorStorageMetadata):
            raise _bad(path, f"entry {key!r} is a {type(item).__name__}")
        props = item.properties
        if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
            raise _bad(path, f"entry {key!r} has no tensor dtype")
        if not _is_size(item.size) or not isinstance(item.chunks, list):
            raise _bad(path, f"entry {key!r} has a malformed size or chunk list")
        for chunk in item.chunks:
            if (
                not isinstance(chunk, ChunkStorageMetadata)
                or not _is_size(chunk.offsets)
                or not _is_size(chunk.sizes)
                or len(chunk.offsets) != len(item.size)
                or len(chunk.sizes) != len(item.size)
            ):
                raise _bad(path, f"entry {key!r} has a malformed chunk")
    if not isinstance(md.storage_data, dict):
        raise _bad(path, "storage_data is not a dict")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _bad(path, f"storage key {index!r} is not a MetadataIndex")
        if index.offset is not None and not _is_size(index.offset):
            raise _bad(path, f"storage key {index.fqn!r} has a malformed offset")
        if not isinstance(info, _StorageInfo):
            raise _bad(path, f"storage of {index.fqn!r} is a {type(info).__name__}")
        for name in ("offset", "length"):
            value = getattr(info, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _bad(path, f"storage of {index.fqn!r} has {name} {value!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and (
            not isinstance(descriptors, list | tuple) or not all(isinstance(d, str) for d in descriptors)
        ):
            raise _bad(path, f"storage of {index.fqn!r} has malformed transform descriptors")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise _bad(path, "planner_data is not a dict")
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        raise _bad(path, "storage_meta is not a StorageMeta")


def _check_storage(md: Metadata, model_dir: Path, path: Path) -> None:
    """Every shard path resolves inside the checkpoint and is a file its inventory lists, with room for the read."""
    ckpt = model_dir.parent
    listed: dict[str, int] = {}
    for item in read_inventory(ckpt)["files"]:
        if isinstance(item, dict) and isinstance(item.get("path"), str) and isinstance(item.get("size"), int):
            listed[item["path"]] = item["size"]
    assert md.storage_data is not None  # checked by _check_types
    for index, info in md.storage_data.items():
        rel = info.relative_path
        safe_relpath(model_dir, rel, path)  # absolute, '..', a symlink on the way: refused naming the path
        inner = f"{model_dir.name}/{rel}"
        if inner not in listed:
            raise UnsafeInput(
                f"{path}: tensor {index.fqn!r} is stored in {rel!r}, which {ckpt / INVENTORY} does not list",
                hint="the checkpoint was tampered with; resume from another checkpoint",
            )
        if info.offset + info.length > listed[inner]:
            raise UnsafeInput(
                f"{path}: tensor {index.fqn!r} reads bytes {info.offset}..{info.offset + info.length} of "
                f"{inner}, which has {listed[inner]} bytes",
                hint="the checkpoint was tampered with or is damaged; resume from another checkpoint",
            )


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata comes from the allow-listed unpickler and whose tensors are read by
    `_Load`: each file read whole by many threads at once (a few files at a time) into host memory allocated once
    per load and reused, hashed in order as its bytes arrive and checked against `expected` ({file name in the DCP
    directory: (SHA-256, size)}) before a byte of it is parsed, then its items parsed and copied into their
    targets on threads of their own while the next files are read."""

    def __init__(self, path: str, expected: dict[str, tuple[str, int]] | None = None) -> None:
        super().__init__(path)
        self.expected = expected
        self.verified: set[str] = set()  # names of the files read and checked
        # of the last read_data: seconds of each phase, summed over threads
        self.timings: dict[str, float] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        md.storage_meta = md.storage_meta or dcp.metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[ReadItem]] = {}  # in the plan's order, as DCP's own reader groups them
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        load = _Load(Path(self.path), per_file, self.storage_data, planner, self.expected)
        try:
            load.run()
        finally:
            self.verified |= load.verified
            self.timings = dict(load.timings)
        done: Future[None] = Future()
        done.set_result(None)
        return done


# Reads in flight per rank: a network or virtio disk reaches its bandwidth only with many requests queued (the
# GPU host's reads 1.42 GB/s on one stream, 1.87 on 16), whatever the number of files held.
READ_STREAMS = 16
_CHUNK = 16 << 20
_DAMAGED = "the file is damaged; restore it, or remove the checkpoint to resume from an older one"
# Per rank, host memory for bytes read but not yet copied into their tensors (a file larger than that is read
# alone): every rank of a node loads at once. 4 GiB hold 4 of a 14.5 GB state's 16 files.
LOAD_BUFFER = 4 << 30
# Threads that parse verified files and copy their items into the tensors: a copy runs at memory or bus speed, so
# a few keep up with the disk.
PARSE_THREADS = 4
# Files whose chunks are read at the same time, the reads spread evenly over them. A file is hashed in order on
# one core (1.1-1.4 GB/s on the GPU host, under its disk's 2.3 GB/s): read at a share of the disk's speed, its
# hash keeps up and the file is verified as its last chunk arrives. At most one file fewer than the buffer holds
# of the largest: files read together end together, and the next one must have its room already, else the disk
# idles while they are parsed and copied. 1 = the earliest file's chunks first.
FILES_AT_ONCE = 4
# Host memory is taken in slabs that stay for the whole load and hold the next files once theirs are done: a
# page is faulted in once, not for every file. False: a buffer of its own for each file. The slabs are pageable
# also for GPU targets: page-locked ones with asynchronous copies were measured on the H200 host (RESULTS.md) and
# were slower (pinning took 2 s and the reads waited on the copies: 10.0 s against 8.7 s from pageable slabs, whose
# copies overlap the reads on the parse threads).
REUSE_SLABS = True
# The size of a slab holding many small files (a slab is at least the largest file, so holds any file whole).
_SLAB = 256 << 20
_ALIGN = 4096


class _Slab:
    """Host memory holding whole files one after another; its room is handed out again once they are all done."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data = torch.empty(size, dtype=torch.uint8)  # not zero-filled: read over before use
        self.view = self.data.numpy().data.cast("B")
        self.top = 0  # bytes handed out
        self.files = 0  # files holding bytes of it

    def place(self, size: int) -> memoryview | None:
        """Room for `size` bytes after those handed out, or None."""
        if not self.files:
            self.top = 0
        start = -(-self.top // _ALIGN) * _ALIGN
        if start + size > self.size:
            return None
        self.top = start + size
        self.files += 1
        return self.view[start : start + size]


class _File:
    """One file of the load: its bytes in memory, how much of them has arrived and been hashed."""

    def __init__(self, rel: str, path: Path, size: int, digest: str | None, items: list[ReadItem]) -> None:
        self.rel, self.path, self.size, self.digest, self.items = rel, path, size, digest, items
        self.chunks = -(-size // _CHUNK)
        self.issued = 0  # chunks handed to a reading thread
        self.served = -1  # when a chunk of it was last handed out (see _Load._next)
        self.arrived = [False] * self.chunks
        self.hashed = 0  # chunks hashed, in order
        self.hashing = False  # a thread is hashing the arrived chunks: the others leave it to it
        self.sha = hashlib.sha256()
        self.lock = threading.Lock()
        self.fd = -1
        self.slab: _Slab | None = None
        self.view = memoryview(b"")
        self.left = len(items)  # items not yet in their targets

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Load:
    """Reads, verifies, parses and copies the files of one rank's load, holding at most LOAD_BUFFER of them.

    Files are taken in the plan's order as room in the slabs allows; READ_STREAMS threads read them in chunks,
    spread over the first few files not yet fully asked for (FILES_AT_ONCE); each file is hashed in order by
    whichever reading thread completes the chunk that extends the hashed prefix, so that no byte is read twice.
    Only once its size and SHA-256 match is a file's items parsed (`torch.load(weights_only=True)` onto meta), on
    PARSE_THREADS threads, and copied into the targets; its room in the slab is reused once they are all in."""

    def __init__(
        self,
        root: Path,
        per_file: dict[str, list[ReadItem]],
        storage: dict[MetadataIndex, _StorageInfo],
        planner: Any,
        expected: dict[str, tuple[str, int]] | None,
    ) -> None:
        self.root, self.storage, self.planner, self.expected = root, storage, planner, expected
        self.per_file = per_file
        self.verified: set[str] = set()
        self.timings = dict.fromkeys(("read", "hash", "parse", "copy", "alloc", "read_idle"), 0.0)
        self._cond = threading.Condition()
        self._slabs: list[_Slab] = []
        self._allocated = 0  # bytes of the slabs, those being allocated included
        self._reading: list[_File] = []  # admitted files with chunks not yet handed to a reading thread
        self._admitted_all = False
        self._turn = 0  # chunks handed out
        self._at_once = max(1, FILES_AT_ONCE)  # files read at the same time (run() lowers it to the room)
        self._slab_size = 0
        self._finished = 0
        self._error: BaseException | None = None
        self._plan = threading.Lock()  # the planner is not known to be thread-safe
        self._opened: list[_File] = []

    def run(self) -> None:
        self._parse = ThreadPoolExecutor(
            max(1, min(PARSE_THREADS, default_jobs())), thread_name_prefix="torchrelay-parse"
        )
        readers = [
            threading.Thread(target=self._reader, name=f"torchrelay-read-{i}", daemon=True)
            for i in range(max(1, READ_STREAMS))
        ]
        for thread in readers:
            thread.start()
        try:
            files = [self._describe(rel, items) for rel, items in self.per_file.items()]
            largest = max((f.size for f in files), default=0)
            total = sum(f.size for f in files)
            self._slab_size = max(largest, min(total, LOAD_BUFFER, _SLAB))
            room = max(1, LOAD_BUFFER // max(1, largest))  # files of the largest size the buffer holds
            self._at_once = max(1, min(FILES_AT_ONCE, room - 1))
            for f in files:
                if not self._admit(f):
                    break
                if f.chunks == 0:
                    self._guard(self._verified, f)
                else:
                    with self._cond:
                        self._reading.append(f)
                        self._cond.notify_all()
            with self._cond:
                self._admitted_all = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._error is not None or self._finished == len(self.per_file))
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._cond:
                self._admitted_all = True
                self._cond.notify_all()
            for thread in readers:
                thread.join()
            self._parse.shutdown(wait=True, cancel_futures=True)
            for f in self._opened:
                f.close()
                f.slab, f.view = None, memoryview(b"")
            self._slabs.clear()
        if self._error is not None:
            raise self._error

    def _describe(self, rel: str, items: list[ReadItem]) -> _File:
        path = safe_relpath(self.root, rel, self.root / ".metadata")
        if self.expected is None:
            digest, size = None, os.stat(path).st_size
        elif rel in self.expected:
            digest, size = self.expected[rel]
        else:
            raise UnsafeInput(f"{path}: not listed in the checkpoint's inventory; refusing to read it")
        return _File(rel, path, size, digest, items)

    def _admit(self, f: _File) -> bool:
        """Room for the file's bytes in a slab (a new one while the budget allows, or once enough of the files
        held are done), and the file opened; False after a failure."""
        if f.size:
            size = self._slab_size if REUSE_SLABS else f.size
            with self._cond:
                while True:
                    if self._error is not None:
                        return False
                    for slab in self._slabs:
                        view = slab.place(f.size)
                        if view is not None:
                            f.slab, f.view = slab, view
                            break
                    if f.slab is not None or not self._allocated or self._allocated + size <= LOAD_BUFFER:
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
                    f.slab, f.view = slab, view
        self._opened.append(f)
        f.fd = os.open(f.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return True

    def _release(self, f: _File) -> None:
        """The file is done: its room in the slab goes back (the slab itself, without reuse). Under _cond."""
        slab, f.slab, f.view = f.slab, None, memoryview(b"")
        if slab is not None:
            slab.files -= 1
            if not slab.files and not REUSE_SLABS:
                self._slabs.remove(slab)
                self._allocated -= slab.size
        self._finished += 1
        self._cond.notify_all()

    def _reader(self) -> None:
        while (job := self._next()) is not None:
            self._guard(self._read, *job)

    def _next(self) -> tuple[_File, int] | None:
        """The next chunk to read: of the first files not fully asked for (`_at_once`), the one served longest
        ago (round robin, each an equal share); None once every file is, or after a failure."""
        with self._cond:
            t0 = time.perf_counter()
            while True:
                if self._error is not None:
                    return None
                if self._reading:
                    f = min(self._reading[: self._at_once], key=lambda g: g.served)
                    k = f.issued
                    f.issued += 1
                    f.served = self._turn
                    self._turn += 1
                    if f.issued == f.chunks:
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
        start = k * _CHUNK
        want = min(_CHUNK, f.size - start)
        got = 0
        while got < want:
            n = os.preadv(f.fd, [f.view[start + got : start + want]], start + got)
            if not n:
                raise IntegrityError(
                    f"{f.path} has {start + got} bytes, the inventory says {f.size}",
                    hint=_DAMAGED,
                )
            got += n
        t1 = time.perf_counter()
        self._count("read", t1 - t0)
        with f.lock:
            f.arrived[k] = True
            if f.hashing:
                return
            f.hashing = True
        while True:  # hash the arrived prefix; a chunk that arrives meanwhile is left to this thread
            with f.lock:
                n = f.hashed
                if n == f.chunks or not f.arrived[n]:
                    f.hashing = False
                    break
            f.sha.update(f.view[n * _CHUNK : min((n + 1) * _CHUNK, f.size)])  # releases the GIL
            with f.lock:
                f.hashed = n + 1
        self._count("hash", time.perf_counter() - t1)
        with f.lock:
            complete = f.hashed == f.chunks and not f.hashing
            if complete:
                f.hashing = True  # once: no other thread verifies it again
        if complete:
            self._verified(f)

    def _verified(self, f: _File) -> None:
        """All bytes in: check the size and digest, then hand the items to the parse threads."""
        if os.pread(f.fd, 1, f.size):
            raise IntegrityError(
                f"{f.path} has more than {f.size} bytes, the inventory says {f.size}",
                hint=_DAMAGED,
            )
        f.close()
        if f.digest is not None:
            if f.sha.hexdigest() != f.digest:
                raise IntegrityError(
                    f"{f.path} does not match its SHA-256 in {INVENTORY}",
                    hint=_DAMAGED,
                )
            with self._cond:
                self.verified.add(f.rel)
        if not f.items:
            with self._cond:
                self._release(f)
        for req in f.items:
            self._parse.submit(self._guard, self._item, f, req)

    def _item(self, f: _File, req: ReadItem) -> None:
        t0 = time.perf_counter()
        info = self.storage[req.storage_index]
        _refuse_transforms(info, f.path, req.storage_index.fqn)
        tensor = _parse_item(f.view, info.offset, info.length, f.path, req.storage_index.fqn)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
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
            f.left -= 1
            if not f.left:  # every item in its target: the file's room goes back
                self._release(f)


def _parse_item(view: memoryview, offset: int, length: int, path: Path, fqn: str) -> torch.Tensor:
    """The tensor DCP stored at bytes [offset, offset + length) of a verified file (a torch.save archive).

    torch.load(weights_only=True) onto the meta device parses the archive's records and its pickle, without
    copying the data: it says where the tensor's bytes lie, and the tensor returned is a view of them in `view`
    (one copy less than torch.load to CPU, the largest cost of a load). An archive that asks for byte swapping,
    or a torch that does not say where a storage lies, is loaded by torch.load to CPU instead."""
    stream = io.BufferedReader(_Memory(view[offset : offset + length]), buffer_size=1 << 16)
    try:
        if sys.byteorder == "little" and _little_endian(stream):
            stream.seek(0)
            meta = torch.load(stream, map_location="meta", weights_only=True)
            start = (
                getattr(meta.untyped_storage(), "_checkpoint_offset", None)
                if isinstance(meta, torch.Tensor)
                else None
            )
            if isinstance(start, int):
                nbytes = meta.untyped_storage().nbytes()
                if start < 0 or start + nbytes > length:
                    raise CheckpointError(f"bytes {start}..{start + nbytes} lie outside the item's {length}")
                flat = (
                    torch.frombuffer(
                        view, dtype=meta.dtype, count=nbytes // meta.element_size(), offset=offset + start
                    )
                    if nbytes >= meta.element_size()
                    else torch.empty(0, dtype=meta.dtype)
                )
                # the storage is exactly the item's bytes: as_strided refuses sizes or strides that leave it
                return flat.as_strided(meta.size(), meta.stride(), meta.storage_offset())
    except Exception as exc:  # noqa: BLE001 - weights_only refuses any payload that is not plain tensors
        raise _not_plain(path, fqn, exc) from exc
    stream.seek(0)
    part = _load_item(stream, path, fqn)
    if not isinstance(part, torch.Tensor):
        raise UnsafeInput(f"{path}: the bytes of {fqn!r} hold a {type(part).__name__}, not a tensor")
    return part


def _load_item(stream: IO[bytes], path: Path, fqn: str) -> Any:
    """torch.load(weights_only=True) of one DCP item to CPU; anything it refuses is refused naming the file."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refuses any payload that is not plain tensors
        raise _not_plain(path, fqn, exc) from exc


def _not_plain(path: Path, fqn: str, exc: Exception) -> UnsafeInput:
    return UnsafeInput(f"{path}: the bytes of {fqn!r} are not a plain tensor ({type(exc).__name__}: {exc})")


def _refuse_transforms(info: _StorageInfo, where: Path, fqn: str) -> None:
    """torchrelay never writes DCP's stream transforms (compression and the like): such an item is not read."""
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{where}: {fqn!r} is stored with transforms {list(info.transform_descriptors or ())}, "
            "which torchrelay never writes",
            hint="this checkpoint was not written by torchrelay; read it with torch.distributed.checkpoint",
        )


def _little_endian(stream: IO[bytes]) -> bool:
    """The archive's byte order is the host's (torch.load onto meta would crash on another: torch 2.13)."""
    reader = torch._C.PyTorchFileReader(stream)
    return "byteorder" not in reader.get_all_records() or reader.get_record("byteorder") == b"little"


class _Seekable(io.RawIOBase):
    """A read-only, seekable file of `_size` bytes at position `_pos`; a subclass says how to read them."""

    _size: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + pos, 0), self._size)
        return self._pos


class _Memory(_Seekable):
    """A read-only, seekable file over bytes already in memory."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._view, self._pos = memoryview(data), 0
        self._size = len(self._view)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), len(self._view) - self._pos)
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def save(state: dict[str, Any], directory: Path) -> None:
    """Write tensors only (every rank calls it); DCP deduplicates replicated tensors across ranks."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))


def load(
    state: dict[str, Any],
    directory: Path,
    *,
    no_dist: bool = False,
    expected: dict[str, tuple[str, int]] | None = None,
    stats: dict[str, float] | None = None,
) -> set[str]:
    """Fill `state`'s tensors in place from `directory`. With `expected` ({name: (SHA-256, size)} of the files
    in `directory`), each file read is verified as it is read; returns the names of the files verified.
    `stats`, if given, receives the seconds each phase took, summed over its threads (read, hash, parse, copy)."""
    read_metadata(directory)  # refuse a tampered file before DCP opens anything
    reader = SafeReader(str(directory), expected)
    try:
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except CheckpointException as exc:  # a file failed its check on some rank: DCP raises it on every rank
        if not no_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise  # the caller's phase makes it one error, naming the rank (util/collective.py)
        for _, (failure, _tb) in sorted(exc.failures.items()):
            if isinstance(failure, IntegrityError | UnsafeInput | CheckpointError):
                raise type(failure)(failure.message, hint=failure.hint) from None
        raise
    finally:
        if stats is not None:
            stats.update(reader.timings)
    return reader.verified


def read_tensor(ckpt_model_dir: Path, md: Metadata, key: str) -> torch.Tensor:
    """One full tensor of a DCP checkpoint, assembled from its chunks without a process group.

    Only the bytes of this tensor's chunks are read (each one `torch.load(weights_only=True)`), so memory stays at
    about twice the largest tensor whatever the checkpoint's size: the way to stream a checkpoint tensor by tensor.
    """
    item = md.state_dict_metadata.get(key)
    if not isinstance(item, TensorStorageMetadata):
        raise CheckpointError(f"{ckpt_model_dir / '.metadata'}: holds no tensor {key!r}")
    whole = len(item.chunks) == 1 and list(item.chunks[0].sizes) == list(item.size)
    out = None if whole else torch.empty(item.size, dtype=item.properties.dtype)
    for chunk in item.chunks:
        part = _read_chunk(ckpt_model_dir, md, key, chunk.offsets, chunk.sizes)
        if part.dtype != item.properties.dtype:
            raise CheckpointError(
                f"{ckpt_model_dir}: tensor {key!r} is stored as {part.dtype}, its metadata says "
                f"{item.properties.dtype}",
                hint="the checkpoint is damaged; export another one",
            )
        if out is None:
            return part
        view = out
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            view = view.narrow(dim, start, length)
        view.copy_(part)
        del part
    assert out is not None  # a tensor has at least one chunk
    return out


def _read_chunk(
    model_dir: Path, md: Metadata, key: str, offsets: torch.Size, sizes: torch.Size
) -> torch.Tensor:
    info = md.storage_data.get(MetadataIndex(key, offsets))
    source = model_dir / ".metadata"
    if info is None:
        raise CheckpointError(f"{source}: no storage entry for {key!r} at offsets {list(offsets)}")
    _refuse_transforms(info, source, key)
    path = safe_relpath(model_dir, info.relative_path, source)
    with open(path, "rb") as f:
        if f.seek(0, io.SEEK_END) < info.offset + info.length:
            raise CheckpointError(f"{path}: ends before the {info.length} bytes of {key!r} at {info.offset}")
        # torch.load reads the item's zip straight from the file into the tensor's storage: one copy in memory
        item_file = io.BufferedReader(_Window(f, info.offset, info.length), buffer_size=1 << 16)
        part = _load_item(item_file, path, key)
    if not isinstance(part, torch.Tensor) or list(part.shape) != list(sizes):
        raise CheckpointError(
            f"{path}: {key!r} at offsets {list(offsets)} holds {type(part).__name__} "
            f"{list(getattr(part, 'shape', []))}, the metadata says {list(sizes)}"
        )
    return part


class _Window(_Seekable):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file (one DCP item)."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0
        self._size = length

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n])
        self._pos += got
        return got
