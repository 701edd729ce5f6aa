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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from torchrelay.errors import UnsafeInput

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
