"""Model and optimizer as DCP stores them: the optimizer's tensors beside the model's (its param groups and scalars
go to JSON), what is equal on every rank once and what differs under `per_rank/<rank>`; the same document for a
save and a load."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

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


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The tracked optimizer as a list: none, one, or several (a list or tuple of them)."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def named_params(osd: dict[str, Any], optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """Each parameter of `optimizer` (one or several) with its name in `osd`, get_state_dict's document of them:
    its param groups name the parameters in the optimizers' own order, one optimizer after the other."""
    params = [p for o in optimizers_of(optimizer) for g in o.param_groups for p in g["params"]]
    names = [n for g in osd.get("param_groups", []) for n in g["params"]]
    return list(zip(names, params, strict=True))


def state_dicts(model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """get_state_dict(model, optimizer) that leaves the optimizer as it found it.

    For an optimizer that holds no state yet (no update yet, or none of its parameters had a gradient), torch makes
    some up: a step with zero gradients and lr 0 (`_init_optim_state`). Kept, it would change the run that saves
    (AdamW's step count, SGD's momentum buffer: weight decay leaves it non-zero) and not the run that does not;
    so that state leaves the optimizer and the document again: a save holds none for those parameters, as the
    optimizer did."""
    empty = [o for o in optimizers_of(optimizer) if not o.state]
    msd, osd = get_state_dict(model, optimizer or [], options=STATE_DICT_OPTIONS)
    if empty:
        made = {id(p) for o in empty for p in o.state}
        state = cast(dict[str, Any], osd["state"])
        for name, param in named_params(osd, optimizer):
            if id(param) in made:
                state.pop(name, None)
        for each in empty:
            each.state.clear()
    return msd, osd
