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
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchrelay.checkpoint.inventory import INVENTORY, read_inventory, safe_relpath
from torchrelay.errors import CheckpointError, IntegrityError, UnsafeInput, mark_reported
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
    """A FileSystemReader whose metadata comes from the allow-listed unpickler.

    Given `expected` ({file name in the DCP directory: (SHA-256, size)}), every file this rank loads from is read
    whole by a pool of threads ahead of DCP, hashed as it is read and checked before DCP parses a byte of it: one
    pass over the disk, on as many cores as files, while DCP turns the bytes already read into tensors."""

    def __init__(self, path: str, expected: dict[str, tuple[str, int]] | None = None) -> None:
        super().__init__(path)
        self.expected = expected
        self.verified: set[str] = set()  # names of the files read and checked

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        md.storage_meta = md.storage_meta or dcp.metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.expected is None:
            return super().read_data(plan, planner)
        order: list[str] = []  # the files in the order DCP opens them (it groups the plan's items by file)
        for item in plan.items:
            rel = self.storage_data[item.storage_index].relative_path
            if rel not in order:
                order.append(rel)
        prefetch = _Prefetch(Path(self.path), order, self.expected)
        self.fs = prefetch  # DCP opens each file through self.fs.create_stream
        try:
            return super().read_data(plan, planner)
        finally:
            prefetch.close()
            self.verified |= prefetch.done


class _Prefetch(FileSystem):
    """Reads and verifies the files of one load ahead of DCP, holding at most a core's worth of them in memory."""

    def __init__(self, root: Path, order: list[str], expected: dict[str, tuple[str, int]]) -> None:
        super().__init__()
        self.root, self.expected = root, expected
        self.done: set[str] = set()
        jobs = max(1, min(len(order), default_jobs()))
        # Bytes read but not yet parsed, at most LOAD_BUFFER (a file larger than that is read alone): every rank of
        # a node loads at once, and each would otherwise hold a core's worth of files
        self._room = _Budget(LOAD_BUFFER, order)
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="torchrelay-load")
        self._futures = {rel: self._pool.submit(self._read, rel) for rel in order}

    def _read(self, rel: str) -> memoryview:
        digest, size = self.expected.get(rel, ("", 0))
        self._room.take(rel, size)  # first, whatever happens next: the files after this one wait for its turn
        path = safe_relpath(self.root, rel, self.root / ".metadata")
        if rel not in self.expected:
            raise UnsafeInput(f"{path}: not listed in the checkpoint's inventory; refusing to read it")
        data = torch.empty(size, dtype=torch.uint8).numpy().data  # not zero-filled: read over at once
        view = data
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < size:
                n = f.readinto(view[got : got + _CHUNK])
                if not n:
                    break
                h.update(view[got : got + n])  # still in cache: hashed as it is read
                got += n
            extra = f.read(1)
        if got != size or extra:
            raise IntegrityError(
                f"{path} has {'more than ' if extra else ''}{got} bytes, the inventory says {size}",
                hint="the file is damaged; restore it, or remove the checkpoint to resume from an older one",
            )
        if h.hexdigest() != digest:
            raise IntegrityError(
                f"{path} does not match its SHA-256 in {INVENTORY}",
                hint="the file is damaged; restore it, or remove the checkpoint to resume from an older one",
            )
        return data

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        rel = Path(path).relative_to(self.root).as_posix()
        future = self._futures.get(rel)
        if future is None or mode != "rb":
            raise CheckpointError(f"{path}: opened by DCP outside its load plan")
        data = future.result()
        try:
            yield _Memory(data)
        finally:
            self.done.add(rel)
            del self._futures[rel]
            self._room.give(rel)

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._room.open()  # a read still waiting for room goes on (and is dropped)
        self._pool.shutdown(wait=True)


_CHUNK = 16 << 20
LOAD_BUFFER = (
    4 << 30
)  # per rank: 4 files of a 14.5 GB state's 16 read at once, hashed on 4 cores, > disk speed


class _Budget:
    """Bytes in memory: a read takes its file's size before it starts, in the order DCP parses the files (so that
    the file parsed next is never waiting for room that files after it hold), and the parse gives it back."""

    def __init__(self, limit: int, order: list[str]) -> None:
        self._limit, self._used = limit, 0
        self._held: dict[str, int] = {}
        self._turn = {key: i for i, key in enumerate(order)}
        self._next = 0
        self._cond = threading.Condition()
        self._open = False

    def take(self, key: str, size: int) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._open
                    or (
                        self._turn[key] == self._next and (not self._used or self._used + size <= self._limit)
                    )
                )
            )
            self._next += 1
            self._used += size
            self._held[key] = size

    def give(self, key: str) -> None:
        with self._cond:
            self._used -= self._held.pop(key, 0)
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


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
) -> set[str]:
    """Fill `state`'s tensors in place from `directory`. With `expected` ({name: (SHA-256, size)} of the files
    in `directory`), each file read is verified as it is read; returns the names of the files verified."""
    read_metadata(directory)  # refuse a tampered file before DCP opens anything
    reader = SafeReader(str(directory), expected)
    try:
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except CheckpointException as exc:  # a file failed its check on some rank: every rank raises it
        for _, (failure, _tb) in sorted(exc.failures.items()):
            if isinstance(failure, IntegrityError | UnsafeInput):
                err = type(failure)(failure.message, hint=failure.hint)
                first = dist.get_rank() == 0 if dist.is_available() and dist.is_initialized() else True
                raise err if first else mark_reported(err) from None  # rank 0 says it
        raise
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
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{source}: {key!r} is stored with transforms {list(info.transform_descriptors)}, "
            "which torchrelay never writes",
            hint="this checkpoint was not written by torchrelay; read it with torch.distributed.checkpoint",
        )
    path = safe_relpath(model_dir, info.relative_path, source)
    with open(path, "rb") as f:
        if f.seek(0, io.SEEK_END) < info.offset + info.length:
            raise CheckpointError(f"{path}: ends before the {info.length} bytes of {key!r} at {info.offset}")
        try:
            # torch.load reads the item's zip straight from the file into the tensor's storage: one copy in memory
            item_file = io.BufferedReader(_Window(f, info.offset, info.length), buffer_size=1 << 16)
            part = torch.load(item_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - weights_only refuses any payload that is not plain tensors
            raise UnsafeInput(
                f"{path}: the bytes of {key!r} are not a plain tensor ({type(exc).__name__}: {exc})"
            ) from exc
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
