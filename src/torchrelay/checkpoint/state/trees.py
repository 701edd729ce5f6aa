"""A stateful's state as a JSON tree with its tensors set aside (stored beside it as safetensors): dicts, lists,
tuples, numbers, strings and tensors, never a pickle."""

from __future__ import annotations

import math
from typing import Any

import torch

from torchrelay.errors import CheckpointError, RecordError


def to_tree(
    obj: Any, key: str, tensors: dict[str, torch.Tensor], views: dict[tuple[Any, ...], str] | None = None
) -> Any:
    views = {} if views is None else views
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # Tied weights (an EMA of a model whose embedding is its output layer) reach here twice as one tensor:
        # stored once and referenced twice (loading gives both entries the same values). safetensors refuses
        # tensors that share memory, so a partly overlapping view is stored as a copy.
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if view in views:
            return {"__tensor__": views[view]}
        if any(seen[0] == view[0] for seen in views):
            t = t.clone()
        views[view] = key
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, str | int) for k in obj):
            raise CheckpointError(f"state {key!r}: dict keys must be str or int to be stored as JSON")
        return {"__dict__": [[k, to_tree(v, f"{key}.{k}", tensors, views)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        items = [to_tree(v, f"{key}.{i}", tensors, views) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise CheckpointError(
        f"state {key!r} holds a {type(obj).__name__}, which torchrelay cannot store without pickle",
        hint="keep state_dict() to tensors, numbers, strings, lists and dicts",
    )


def from_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: from_tree(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(from_tree(v, tensors) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise CheckpointError(f"unknown node in stored state: {sorted(obj)}")
    if isinstance(obj, list):
        return [from_tree(v, tensors) for v in obj]
    return obj


def tree_of(tree: Any, tensors: dict[str, torch.Tensor], *, source: str, name: str) -> Any:
    """A stored stateful's state from its JSON tree; a tree no save writes (a missing tensor, a malformed node)
    is one RecordError naming the file and the stateful."""
    try:
        return from_tree(tree, tensors)
    except CheckpointError as exc:
        raise RecordError(source, exc.message, field=f"statefuls.{name}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(
            source,
            f"not a tree a save writes ({type(exc).__name__}: {str(exc)[:120]})",
            field=f"statefuls.{name}",
        ) from None
