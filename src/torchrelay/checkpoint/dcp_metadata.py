"""DCP's `.metadata`, read without executing a pickle.

DCP writes its `.metadata` with pickle. torchrelay reads it only through an unpickler that admits the
handful of DCP and torch classes a metadata file is made of, gives state (BUILD) only to fresh instances of
DCP's own record types, refuses byte (pickled object) entries and checks the type of everything it returns,
so a planted payload is refused instead of run. Every shard path it names must be a file of the checkpoint's
inventory. Tensor shards are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
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
from torchrelay.checkpoint.torch_compat import METADATA_PICKLE_NAMES, PythonUnpickler, StorageInfo
from torchrelay.errors import UnsafeInput
from torchrelay.util.gcpause import no_collections
from torchrelay.util.records import read_bounded

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    *METADATA_PICKLE_NAMES,  # the private ones (torch_compat.py)
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
    StorageInfo,
)
# A file no DCP writer makes this large; reading an endless one (a device) must stop somewhere.
METADATA_LIMIT = 4 << 30


# The Python unpickler (torch_compat says why), so that BUILD is checked before it acts.
class _SafeUnpickler(PythonUnpickler):
    dispatch = dict(PythonUnpickler.dispatch)
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
        with no_collections():  # its tens of thousands of new objects set off collections of the whole heap
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
        if not isinstance(info, StorageInfo):
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
    resolved: set[str] = set()  # each file's path checked once, not once per tensor it holds
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in resolved:
            safe_relpath(
                model_dir, rel, path
            )  # absolute, '..', a symlink on the way: refused naming the path
            resolved.add(rel)
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
