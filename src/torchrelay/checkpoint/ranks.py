"""Which tensors and statefuls differ between ranks at a save, and are therefore stored once per rank.

The rule is the same for every wrapper: a value equal on every rank is stored once; a value that differs is
stored for each rank, and each rank restores its own. That is exactly what the uninterrupted run holds at the
boundary, whatever the wrapper does with it next. (DDP broadcasts rank 0's buffers before a forward only when
the previous forward synchronized: not after one under `no_sync` or `no_grad`. Storing rank 0's copy alone
would be right sometimes; storing each rank's is right always.)

What is compared, by a SHA-256 of its bytes on every rank, gathered once per save:
- DDP: parameters and optimizer state are equal on every rank by construction (DDP all-reduces gradients);
  only the other model tensors (BatchNorm running statistics and other buffers) are compared.
- FSDP2 (`fully_shard`): sharded tensors (DTensor) are each rank's own shard and DCP stores them as shards;
  the plain ones (buffers, which FSDP2 never synchronizes, and scalar optimizer steps) are compared.
- no wrapper, or one of your own, with more than one rank: every tensor, since nothing says ranks agree.
- SyncBatchNorm computes its statistics over all ranks, so its buffers compare equal and are stored once.
Every stateful registered with `run.track` is compared as a whole (its JSON and its tensors).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

from torchrelay.util import collective

PER_RANK = "per_rank"  # the DCP key that holds, under str(rank), the tensors each rank stores for itself


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def tensor_digest(t: torch.Tensor, h: Any = None) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (feeds `h` too when given)."""
    own = h or hashlib.sha256()
    flat = t.detach().cpu().contiguous().reshape(-1)
    own.update(f"{flat.dtype}{tuple(t.shape)}".encode())
    own.update(flat.view(torch.uint8).numpy().tobytes())
    return str(own.hexdigest())


def stateful_digest(tree: Any, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a stored stateful: its JSON tree and each of its tensors, by key."""
    h = hashlib.sha256(json.dumps(tree, sort_keys=True).encode())
    for key in sorted(tensors):
        h.update(key.encode())
        tensor_digest(tensors[key], h)
    return h.hexdigest()


def compared(
    model: torch.nn.Module | None, msd: dict[str, Any], otensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model ("model/<fqn>") and optimizer ("optim/<key>") tensors whose equality across ranks is not given."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        params = {p.data_ptr() for p in model.parameters()}
        return {
            f"model/{k}": v
            for k, v in msd.items()
            if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.data_ptr() not in params
        }
    out: dict[str, torch.Tensor] = {}
    for prefix, tensors in (("model", msd), ("optim", otensors)):
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor) and not _is_dtensor(value):
                out[f"{prefix}/{key}"] = value
    return out


def differing(digests: dict[str, str], group: Any = None) -> set[str]:
    """Keys whose digest is not the same on every rank (or missing on one); the same set on every rank. Gathered
    through the failure protocol over `group` (util/collective.py): called inside a save's phase, it is also the
    exchange where a rank that failed before it joins the others."""
    peers = collective.ranks(group)
    if peers.alone:
        return set()
    gathered = peers.all_gather("comparing the ranks' state", lambda: digests)
    keys = set().union(*(set(g) for g in gathered))
    return {k for k in keys if len({g.get(k) for g in gathered}) > 1}


def split(tensors: dict[str, Any], keys: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, per-rank): `tensors` divided by whether each key is one of `keys`."""
    chosen = set(keys)
    shared = {k: v for k, v in tensors.items() if k not in chosen}
    own = {k: v for k, v in tensors.items() if k in chosen}
    return shared, own
