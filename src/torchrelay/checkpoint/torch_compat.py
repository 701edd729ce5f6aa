"""Every private name of torch (and of pickle) torchrelay uses, in one adapter, with the versions it was tested on.

DCP's public API covers saving and loading; torchrelay's verified reader (verified_read.py) and its allow-listed
metadata unpickler (dcp_metadata.py) need five things it does not expose, and an exact DDP resume on more than two
ranks needs DDP's reducer settled (settle_ddp_buckets). Each is used here and nowhere else, so a torch release that
moves one breaks this module alone, naming it.

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


def settle_ddp_buckets(model: Any) -> bool:
    """Give a DistributedDataParallel model its final gradient-bucket layout now, the same in every process of the
    run; True if it changed. Every rank calls it together (DDP agrees on the layout with a broadcast).

    DDP reduces its first backward's gradients in buckets laid out in reverse registration order, then rebuilds the
    buckets in the order the gradients became ready. A resumed process's first update therefore ran on another
    layout than the same update of the uninterrupted run; on more than two ranks the ring all-reduce then adds
    each element's terms in another association, and the update parts in the last bits (measured: examples/
    train_lm.py on 4 ranks, resumed after update 14, its loss at update 16 4.4403460 against 4.4403465). Rebuilt
    here, before any backward, from the parameters in registration order, the layout never changes again."""
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "_rebuild_buckets"):
        return False
    reducer._push_all_rebuilt_params()  # no-op where DDP never rebuilds (find_unused_parameters=True)
    return bool(reducer._rebuild_buckets())


__all__ = [
    "TESTED_TORCH",
    "PythonUnpickler",
    "StorageInfo",
    "narrow_tensor_by_index",
    "settle_ddp_buckets",
    "storage_offset_in_file",
    "zip_reader",
]
