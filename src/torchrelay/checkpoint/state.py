"""What a checkpoint holds and how each part is written: DCP tensors, JSON, safetensors — never a pickle."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from torchrelay import rng
from torchrelay.checkpoint import dcp_io
from torchrelay.errors import CheckpointError
from torchrelay.fsutil import fsync_file

STATE_FORMAT = 1
TRAINER_STATE = "trainer_state.json"
STATE_TENSORS = "state_tensors.safetensors"
MODEL_DIR = "model"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


# --- JSON trees with tensors set aside -------------------------------------------------------------


def _to_tree(
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
        return {"__dict__": [[k, _to_tree(v, f"{key}.{k}", tensors, views)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        items = [_to_tree(v, f"{key}.{i}", tensors, views) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise CheckpointError(
        f"state {key!r} holds a {type(obj).__name__}, which torchrelay cannot store without pickle",
        hint="keep state_dict() to tensors, numbers, strings, lists and dicts",
    )


def _from_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _from_tree(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_from_tree(v, tensors) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise CheckpointError(f"unknown node in stored state: {sorted(obj)}")
    if isinstance(obj, list):
        return [_from_tree(v, tensors) for v in obj]
    return obj


# --- model and optimizer -------------------------------------------------------------------------


def _split_optimizer(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, name = key.split("\x1f", 1)
        state.setdefault(fqn, {})[name] = value
    for fqn, values in meta["scalars"].items():
        state.setdefault(fqn, {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


_OPTS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def save_state(
    directory: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    loop: dict[str, Any],
    kill_hook: Any = None,
) -> None:
    """Write this rank's part of a checkpoint into `directory` (every rank calls it)."""
    optim_meta: dict[str, Any] | None = None
    if model is not None:
        msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
        otensors, optim_meta = _split_optimizer(osd) if optimizer is not None else ({}, None)
        dcp_io.save({"model": msd, "optim": otensors}, directory / MODEL_DIR)
    if kill_hook:
        kill_hook("shards")
    (directory / "rng").mkdir(exist_ok=True)
    rng.save(rng.rank_file(directory, rank))
    fsync_file(rng.rank_file(directory, rank))
    if rank == 0:
        tensors: dict[str, torch.Tensor] = {}
        trees = {name: _to_tree(obj.state_dict(), name, tensors) for name, obj in statefuls.items()}
        doc = {"format": STATE_FORMAT, "loop": loop, "optimizer": optim_meta, "statefuls": trees}
        if tensors:
            save_file(tensors, str(directory / STATE_TENSORS))
            fsync_file(directory / STATE_TENSORS)
        with open(directory / TRAINER_STATE, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / TRAINER_STATE
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if doc.get("format") != STATE_FORMAT:
        raise CheckpointError(
            f"{path}: state format {doc.get('format')!r} is not {STATE_FORMAT}",
            hint="continue this run with the torchrelay version that wrote it",
        )
    return doc


def load_state(
    ckpt_dir: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
) -> dict[str, Any]:
    """Restore everything this rank holds from `ckpt_dir`; returns the loop state."""
    doc = read_trainer_state(ckpt_dir)
    if model is not None:
        msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
        otensors, _ = _split_optimizer(osd) if optimizer is not None else ({}, None)
        target: dict[str, Any] = {"model": msd, "optim": otensors}
        dcp_io.load(target, ckpt_dir / MODEL_DIR)
        kwargs: dict[str, Any] = {"model_state_dict": target["model"]}
        if optimizer is not None:
            if doc.get("optimizer") is None:
                raise CheckpointError(f"{ckpt_dir}: holds no optimizer state but an optimizer is tracked")
            kwargs["optim_state_dict"] = _join_optimizer(otensors, doc["optimizer"])
        set_state_dict(model, optimizer or [], options=_OPTS, **kwargs)
    tensors = load_file(str(ckpt_dir / STATE_TENSORS)) if (ckpt_dir / STATE_TENSORS).exists() else {}
    stored = doc.get("statefuls", {})
    missing = sorted(set(statefuls) - set(stored))
    extra = sorted(set(stored) - set(statefuls))
    if missing or extra:
        raise CheckpointError(
            f"{ckpt_dir / TRAINER_STATE}: tracked state differs from the checkpoint "
            f"(missing in checkpoint: {missing}, not tracked now: {extra})",
            hint="track the same objects with run.track(...) as the run that saved it",
        )
    for name, obj in statefuls.items():
        obj.load_state_dict(_from_tree(stored[name], tensors))
    return dict(doc["loop"])


def load_rng(ckpt_dir: Path, rank: int) -> None:
    """Restore this rank's generators; called right before the first update so nothing draws in between."""
    rng_file = rng.rank_file(ckpt_dir, rank)
    if not rng_file.exists():
        raise CheckpointError(
            f"{rng_file} is missing: the checkpoint was saved by fewer ranks",
            hint="resume with the world size that saved it",
        )
    rng.load(rng_file)
