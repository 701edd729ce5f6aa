"""Every private name of torch (and of pickle) torchrelay uses, in one adapter, with the torch versions it was tested on.

DCP's public API covers saving and loading (dcp_save.py drives its SavePlanner/StorageWriter protocol, the hashing
writer and the verified reader are a FileSystemWriter and a FileSystemReader); what it does not expose, and what
torchrelay's refusals and its faster paths need, is here and nowhere else (tests/test_torch_privates.py scans src/
for any other use); an exact DDP resume on more than two ranks needs DDP's reducer settled
(settle_ddp_buckets). A torch release that moves one breaks this module alone, at import, naming it.

Tested window: torch 2.8.0 (the floor pyproject.toml declares; the fast tier: `scripts/test.sh --fast --floor`),
2.11.0+cu130 (the GPU host) and 2.13.0 (the dev build). A torch outside it fails
tests/test_torch_privates.py::test_torch_is_within_the_tested_window until each name below is checked against it
and the window widened.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.data.dataloader import _BaseDataLoaderIter

TESTED_TORCH = ("2.8.0", "2.11.0", "2.13.0")

# --- DCP's files (checkpoint/dcp_metadata.py, items.py, verified_read.py) ------------------------------------

# DCP's record of where an item lies in its file (offset, length, transforms); public DCP readers receive it as
# `storage_data` values, but the class itself is private.
StorageInfo = _StorageInfo

# The private names a `.metadata` pickle of DCP refers to (module, name), beside the public metadata classes the
# allow-listed unpickler admits: the storage record, the memory-format enum, the layout rebuilders of torch.Size's
# properties (torch moved it from torch._utils to torch.serialization: a file may name either), the stream-transform extension.
METADATA_PICKLE_NAMES = frozenset(
    {
        (StorageInfo.__module__, StorageInfo.__qualname__),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
        ("torch._utils", "_get_layout"),
        ("torch.serialization", "_get_layout"),
    }
)

# The Python unpickler, not the C one: its dispatch table can be hooked, so BUILD is checked before it acts.
PythonUnpickler = pickle._Unpickler


def zip_reader(stream: IO[bytes]) -> Any:
    """torch's reader of a torch.save zip archive, over an open stream (what torch.load uses inside)."""
    return torch._C.PyTorchFileReader(stream)


def tensor_layout(stream: IO[bytes]) -> tuple[Any, int | None]:
    """What a torch.save archive holds, read weights_only without reading its bytes (a tensor's dtype, shape,
    strides and storage offset, its storage on the meta device or allocated and left unread), and where that
    storage's bytes lie in the archive (None if unknown): the verified reader then views the verified bytes in
    place instead of copying them (one copy less)."""
    if _meta_load_says_where():
        meta = torch.load(stream, map_location="meta", weights_only=True)
        if not isinstance(meta, torch.Tensor):
            return meta, None
        return meta, getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    # torch 2.8: a load onto meta reads every byte before moving the tensor there and records no offset; with
    # skip_data the storage is allocated and left unread, and the archive's one data record says where it lies
    start = stream.tell()
    with torch.serialization.skip_data():
        layout = torch.load(stream, weights_only=True)
    stream.seek(start)
    reader = zip_reader(stream)
    data = [name for name in reader.get_all_records() if name.startswith("data/")]
    if not isinstance(layout, torch.Tensor) or len(data) != 1:
        return layout, None
    return layout, int(reader.get_record_offset(data[0]))


@functools.cache
def _meta_load_says_where() -> bool:
    """Whether torch.load(map_location="meta") records where each storage lies (torch 2.13 does, 2.8 does not)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    buf.seek(0)
    meta = torch.load(buf, map_location="meta", weights_only=True)
    return isinstance(getattr(meta.untyped_storage(), "_checkpoint_offset", None), int)


# --- FSDP2's DTensor (checkpoint/host_stage.py) ---------------------------------------------------------------


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard itself, not a view through autograd (`to_local` is one under grad mode)."""
    return t._local_tensor


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor over `local` with `like`'s spec (mesh, placements, global shape and stride) as it is: no check,
    no collective and no autograd node, one per tensor in the save's stall (`from_local` would add all three)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


# --- modules elastic: exact refuses (run/exact_reduce.py) -----------------------------------------------------

# The base of every BatchNorm (1d/2d/3d, lazy, sync, and a user's subclass of the base itself).
BatchNormBase = _BatchNorm
# The base of Dropout, Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout.
DropoutBase = _DropoutNd

# --- the audit's probe inside a user's script (audit/probe.py) ------------------------------------------------

# Every DataLoader iterator (single- and multi-process) is one of these: the probe wraps its __next__.
DataLoaderIter = _BaseDataLoaderIter


def index_sampler(it: Any) -> Any:
    """The batch sampler a DataLoader iterator draws from (None if it has none)."""
    return getattr(it, "_index_sampler", None)


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
    "METADATA_PICKLE_NAMES",
    "TESTED_TORCH",
    "BatchNormBase",
    "DataLoaderIter",
    "DropoutBase",
    "PythonUnpickler",
    "StorageInfo",
    "dtensor_like",
    "dtensor_local",
    "index_sampler",
    "settle_ddp_buckets",
    "tensor_layout",
    "zip_reader",
]
