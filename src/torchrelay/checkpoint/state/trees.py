"""A stateful's state as a JSON tree with its tensors set aside (stored beside it as safetensors): dicts, lists,
tuples, numbers, strings and tensors, never a pickle."""

from __future__ import annotations

import math
from typing import Any

import torch

from torchrelay.errors import CheckpointError, RecordError

# The dtypes a stateful's tensors are stored in (safetensors writes these, util/safetensors_records.DTYPE_SIZES reads them).
STORABLE_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz,
    torch.float8_e4m3fnuz, torch.int16, torch.uint16, torch.float16, torch.bfloat16, torch.int32, torch.uint32,
    torch.float32, torch.int64, torch.uint64, torch.float64, torch.complex64,
})  # fmt: skip


def to_tree(
    obj: Any, key: str, tensors: dict[str, torch.Tensor], views: dict[tuple[Any, ...], str] | None = None
) -> Any:
    views = {} if views is None else views
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in STORABLE_DTYPES:
            raise CheckpointError(
                f"state {key!r} holds a {str(obj.dtype).removeprefix('torch.')} tensor, which a checkpoint cannot "
                "store (safetensors)",
                hint="store it as another dtype in state_dict() and convert it back in load_state_dict() (a "
                "complex128 tensor: torch.view_as_real, then torch.view_as_complex)",
            )
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


def like_live(stored: Any, live: Any, *, source: str, field: str, open_none: bool = False) -> Any:
    """`stored`, checked to hold each scalar with the kind of value the live object holds there (a number for a
    number, a bool for a bool, a string, None), lists and tuples item by item and dicts key by key; else one
    RecordError naming `source` and the field. A number stays as stored (an lr given as 1 is 0.5 once scheduled):
    it is what the run that saved held. What the live object lacks, or holds as a tensor or another object, is
    left to its own load_state_dict. open_none: a live None takes any stored value (a scheduler's state: an
    attribute that is None until something happens, a held lr, a LambdaLR factor object's peak, is what the saver
    held later; where a setting is fixed at construction, as an optimizer's param groups, None is checked)."""
    if live is None and open_none:
        return stored
    if isinstance(live, dict):
        if not isinstance(stored, dict):
            raise _unlike(stored, live, source, field)
        return {
            k: like_live(v, live[k], source=source, field=f"{field}.{k}", open_none=open_none)
            if k in live
            else v
            for k, v in stored.items()
        }
    if isinstance(live, list | tuple):
        if not isinstance(stored, list | tuple) or (isinstance(live, tuple) and len(stored) != len(live)):
            raise _unlike(stored, live, source, field)
        # a list may have grown since the live object began (a history): its items past the live ones stay
        items = [
            like_live(s, live[i], source=source, field=f"{field}.{i}", open_none=open_none)
            if i < len(live)
            else s
            for i, s in enumerate(stored)
        ]
        return type(stored)(items)
    if isinstance(live, bool) or live is None or isinstance(live, str):
        if type(stored) is not type(live):
            raise _unlike(stored, live, source, field)
    elif isinstance(live, int | float) and (isinstance(stored, bool) or not isinstance(stored, int | float)):
        raise _unlike(stored, live, source, field)
    return stored


def _unlike(stored: Any, live: Any, source: str, field: str) -> RecordError:
    def kind(value: Any) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return "a number"
        if isinstance(value, tuple):
            return f"{len(value)} values"
        return "None" if value is None else f"a {type(value).__name__}"

    shown = repr(stored)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return RecordError(
        source,
        f"holds {shown} ({kind(stored)}) where the live object holds {kind(live)}",
        field=field,
        hint="the checkpoint is damaged or forged; resume from another checkpoint",
    )
