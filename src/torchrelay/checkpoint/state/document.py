"""Model and optimizer as DCP stores them: the optimizer's tensors beside the model's (its param groups and scalars
go to JSON), what is equal on every rank once and what differs under `per_rank/<rank>`; the same document for a
save and a load."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from torchrelay.checkpoint import ranks


def split_optimizer(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer tensors go to DCP (sharded); param groups and scalar state go to JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, per_param in osd.get("state", {}).items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}\x1f{name}"] = value
            else:
                scalars.setdefault(fqn, {})[name] = value
    return tensors, {"param_groups": osd.get("param_groups", []), "scalars": scalars}


def join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, name = key.split("\x1f", 1)
        state.setdefault(fqn, {})[name] = value
    for fqn, values in meta["scalars"].items():
        state.setdefault(fqn, {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def dcp_document(
    msd: dict[str, Any], otensors: dict[str, Any], per_rank: dict[str, list[str]], rank: int
) -> tuple[dict[str, Any], bool]:
    """The DCP document of one rank (shared tensors once, its own under per_rank/<rank>), for save and load alike;
    and whether it holds tensors of its own."""
    shared_m, own_m = ranks.split(msd, per_rank["model"])
    shared_o, own_o = ranks.split(otensors, per_rank["optim"])
    doc: dict[str, Any] = {"model": shared_m, "optim": shared_o}
    if own_m or own_o:
        doc[ranks.PER_RANK] = {str(rank): {"model": own_m, "optim": own_o}}
    return doc, bool(own_m or own_o)


STATE_DICT_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
