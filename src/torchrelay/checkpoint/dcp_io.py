"""Model and optimizer tensors through torch.distributed.checkpoint, read back without executing pickles.

save and load are DCP's own, with the verified reader (verified_read.py) and the allow-listed metadata
(dcp_metadata.py); read_tensor reads one tensor of a checkpoint offline, without a process group. Tensor shards are
parsed weights_only (torch.load(weights_only=True) where they cannot be viewed in place).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from torchrelay.checkpoint.dcp_metadata import read_metadata
from torchrelay.checkpoint.inventory import safe_relpath
from torchrelay.checkpoint.items import _parse_item, _refuse_transforms
from torchrelay.checkpoint.verified_read import SafeReader
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import CheckpointError, IntegrityError, UnsafeInput
from torchrelay.util.gcpause import no_collections
from torchrelay.util.safepath import open_regular

__all__ = ["SafeReader", "load", "read_metadata", "read_tensor", "save"]


def save(state: dict[str, Any], directory: Path) -> None:
    """Write tensors only (every rank calls it); DCP deduplicates replicated tensors across ranks."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))


def load(
    state: dict[str, Any],
    directory: Path,
    *,
    no_dist: bool = False,
    expected: dict[str, tuple[Any, ...]] | None = None,
    stats: dict[str, float] | None = None,
    metadata: Metadata | None = None,
    tuning: LoadTuning | None = None,
) -> set[str]:
    """Fill `state`'s tensors in place from `directory`. With `expected` ({name: (SHA-256, size)} of the files
    in `directory`, or (SHA-256, size, (part size, states)) for a file whose inventory entry lists its SHA-256
    states: util/sha256_parts.py), each file read is verified as it is read; returns the names of the files verified.
    `stats`, if given, receives the seconds each phase took, summed over its threads (read, hash, parse, copy).
    `metadata`: `directory`'s, already read by the caller with read_metadata (not parsed a second time).
    `tuning`: threads, buffers and reads of the verified reader (none of it changes a byte loaded)."""
    began = time.perf_counter()
    if metadata is None:
        metadata = read_metadata(directory)  # refuse a tampered file before DCP opens anything
    checked = time.perf_counter()
    reader = SafeReader(
        str(directory), expected, metadata, tuning
    )  # which DCP then plans with: it is parsed once
    try:
        with no_collections():  # the plan's and the reads' objects: no walk of the whole heap among them
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
            # where the wall time went around the reads: the metadata's check, DCP's planning (the metadata read
            # again by the reader included), the reads, DCP's finish after them
            ended = time.perf_counter()
            stats.update(reader.timings)
            stats["span_check"] = checked - began
            if reader.read_began:
                stats["span_plan"] = reader.read_began - checked
                stats["span_after_reads"] = ended - reader.read_ended
    return reader.verified


def read_tensor(ckpt_model_dir: Path, md: Metadata, key: str) -> torch.Tensor:
    """One full tensor of a DCP checkpoint, assembled from its chunks without a process group.

    Only the bytes of this tensor's chunks are read (each one parsed weights_only), into memory that leaves the
    process when the tensor is freed (own_memory), so memory stays at about twice the largest tensor whatever the
    checkpoint's size: the way to stream a checkpoint tensor by tensor.
    """
    item = md.state_dict_metadata.get(key)
    if not isinstance(item, TensorStorageMetadata):
        raise CheckpointError(f"{ckpt_model_dir / '.metadata'}: holds no tensor {key!r}")
    whole = len(item.chunks) == 1 and list(item.chunks[0].sizes) == list(item.size)
    out = None if whole else own_empty(item.size, item.properties.dtype)
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
    short = f"{path}: ends before the {info.length} bytes of {key!r} at {info.offset}"
    fd, _ = open_regular(path, what="checkpoint tensor file", root=model_dir)  # a pipe in its place: refused
    with os.fdopen(fd, "rb", buffering=0) as f:
        if f.seek(0, io.SEEK_END) < info.offset + info.length:
            raise CheckpointError(short)
        # the item's bytes are read into memory of their own and the tensor views them in place (as the verified
        # reader parses, items.py): one copy in memory, given back the moment the tensor is freed (own_memory)
        item = own_memory(info.length)
        f.seek(info.offset)
        done = 0
        while done < info.length:  # a read returns at most 2 GiB
            got = f.readinto(item[done:])
            if not got:
                raise CheckpointError(short)
            done += got
    part = _parse_item(item, 0, info.length, path, key)
    del item  # the tensor's storage holds the memory now, or a copy does (an archive read by torch.load)
    if list(part.shape) != list(sizes):
        raise CheckpointError(
            f"{path}: {key!r} at offsets {list(offsets)} holds {type(part).__name__} "
            f"{list(getattr(part, 'shape', []))}, the metadata says {list(sizes)}"
        )
    return part


def own_memory(nbytes: int) -> memoryview:
    """`nbytes` bytes (not zeroed where mapped) that go back to the system when the last view of them goes.

    A private anonymous mapping of their own, unmapped with its last view: memory from the C heap (what torch.empty
    and torch.load allocate a tensor of up to 32 MiB from) may stay resident after it is freed, and a tensor read
    after it then takes new memory: when any small allocation made while the first was alive lies above it, glibc
    cannot fold the freed tensor back into the heap's top, nor fit the next of the same size in it (an aligned
    allocation asks for a little more). An export then held two tensors instead of one, in 1 run of 30-100
    (tests/test_after_training.py::test_export_holds_about_one_tensor_in_memory)."""
    if nbytes > 0 and hasattr(mmap, "MAP_PRIVATE"):
        return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE))
    return memoryview(bytearray(nbytes))


def own_empty(size: list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(size, dtype=dtype) in `own_memory`: freed, it leaves the process's memory at once."""
    count = math.prod(size)
    nbytes = count * dtype.itemsize
    if not nbytes:
        return torch.empty(size, dtype=dtype)
    return torch.frombuffer(own_memory(nbytes), dtype=dtype, count=count).view(size)
