"""Every private name of torch (and of pickle) torchrelay uses, in one adapter, with the versions it was tested on.

DCP's public API covers saving and loading; torchrelay's verified reader (verified_read.py) and its allow-listed
metadata unpickler (dcp_metadata.py) need five things it does not expose. Each is imported here and nowhere else, so
a torch release that moves one breaks this module alone, at import, naming it.

Tested with torch 2.8.0 (the floor pyproject.toml declares), 2.11.0+cu130 (the GPU host) and 2.13.0 (the dev build).
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import torch

# Narrows a loaded tensor to the part a read request asks for (DCP's own reader uses it the same way).
from torch.distributed._shard._utils import narrow_tensor_by_index

# DCP's record of where an item lies in its file (offset, length, transforms); public DCP readers receive it as
# `storage_data` values, but the class itself is private.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

TESTED_TORCH = ("2.8.0", "2.11.0", "2.13.0")

# The Python unpickler, not the C one: its dispatch table can be hooked, so BUILD is checked before it acts.
PythonUnpickler = pickle._Unpickler


def zip_reader(stream: IO[bytes]) -> Any:
    """torch's reader of a torch.save zip archive, over an open stream (what torch.load uses inside)."""
    return torch._C.PyTorchFileReader(stream)


def storage_offset_in_file(storage: Any) -> int | None:
    """Where torch.load(mmap=False) found a storage's bytes in the item's file, if it recorded it."""
    return getattr(storage, "_checkpoint_offset", None)


__all__ = [
    "TESTED_TORCH",
    "PythonUnpickler",
    "StorageInfo",
    "narrow_tensor_by_index",
    "storage_offset_in_file",
    "zip_reader",
]
