"""Model and optimizer tensors through torch.distributed.checkpoint, read back without executing pickles.

DCP writes its `.metadata` with pickle. torchrelay reads it only through an unpickler that admits the
handful of DCP and torch classes a metadata file is made of, and refuses byte (pickled object) entries,
so a planted payload is refused instead of run. Tensor shards are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from torchrelay.checkpoint.inventory import safe_relpath
from torchrelay.errors import CheckpointError, UnsafeInput

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


class _SafeUnpickler(pickle.Unpickler):
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


def read_metadata(ckpt_model_dir: Path) -> Metadata:
    """DCP's `.metadata`, through the allow-listed unpickler; byte entries are refused."""
    path = ckpt_model_dir / ".metadata"
    try:
        md = _SafeUnpickler(path.read_bytes(), path).load()
    except UnsafeInput:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is an unreadable checkpoint
        raise UnsafeInput(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(md, Metadata):
        raise UnsafeInput(f"{path}: does not hold DCP Metadata")
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            raise UnsafeInput(
                f"{path}: entry {key!r} is a pickled object; torchrelay checkpoints hold tensors only"
            )
    return md


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata comes from the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        md.storage_meta = md.storage_meta or dcp.metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def save(state: dict[str, Any], directory: Path) -> None:
    """Write tensors only (every rank calls it); DCP deduplicates replicated tensors across ranks."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))


def load(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> None:
    """Fill `state`'s tensors in place from `directory`."""
    read_metadata(directory)  # refuse a tampered file before DCP opens anything
    dcp.load(state, storage_reader=SafeReader(str(directory)), no_dist=no_dist)


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
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"{path}: ends before the {info.length} bytes of {key!r} at {info.offset}")
    try:
        part = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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
