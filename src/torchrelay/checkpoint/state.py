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
from torchrelay.checkpoint import dcp_io, ranks
from torchrelay.errors import CheckpointError
from torchrelay.fsutil import fsync_file

# Format 1: everything but the RNG from rank 0. Format 2 (written only when something differs by rank): adds
# "per_rank" and the files it names. A checkpoint where nothing differs is still written as format 1.
STATE_FORMAT = 2
READABLE_FORMATS = (1, 2)
RANK_STATE_FORMAT = 1
RANK_STATE_DIR = "statefuls"
RELAY_STATE = "relay_state.json"
# Its name in 0.1.0 checkpoints: Hugging Face's Trainer writes a file of this name with its own schema into its checkpoints
# (and HF tools read any checkpoint-N/trainer_state.json as theirs), so it is only read, for older checkpoints.
LEGACY_STATE = "trainer_state.json"
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


def _dcp_layout(
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


_OPTS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def rank_state_file(ckpt_dir: Path, rank: int, suffix: str) -> Path:
    """statefuls/rank-<r>.json (or .safetensors): the statefuls that differ by rank, as this rank holds them."""
    return ckpt_dir / RANK_STATE_DIR / f"rank-{rank}{suffix}"


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))
    fsync_file(path)


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
    """Write this rank's part of a checkpoint into `directory` (every rank calls it).

    What is equal on every rank is stored once; what differs between ranks (see ranks.py) is stored for each
    rank: model and optimizer tensors under DCP's `per_rank/<r>`, statefuls in `statefuls/rank-<r>.*`.
    """
    optim_meta: dict[str, Any] | None = None
    msd: dict[str, Any] = {}
    otensors: dict[str, torch.Tensor] = {}
    if model is not None:
        msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
        otensors, optim_meta = _split_optimizer(osd) if optimizer is not None else ({}, None)
    trees: dict[str, Any] = {}
    own_tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in statefuls.items():
        own_tensors[name] = {}
        trees[name] = _to_tree(obj.state_dict(), name, own_tensors[name])
    digests = {k: ranks.tensor_digest(v) for k, v in ranks.compared(model, msd, otensors).items()}
    digests |= {f"state/{n}": ranks.stateful_digest(trees[n], own_tensors[n]) for n in statefuls}
    differ = ranks.differing(digests)
    per_rank = {
        "model": sorted(k.removeprefix("model/") for k in differ if k.startswith("model/")),
        "optim": sorted(k.removeprefix("optim/") for k in differ if k.startswith("optim/")),
        "statefuls": sorted(k.removeprefix("state/") for k in differ if k.startswith("state/")),
    }
    if model is not None:
        tensors_doc, _ = _dcp_layout(msd, otensors, per_rank, rank)
        dcp_io.save(tensors_doc, directory / MODEL_DIR)
    if kill_hook:
        kill_hook("shards")
    (directory / "rng").mkdir(exist_ok=True)
    rng.save(rng.rank_file(directory, rank))
    fsync_file(rng.rank_file(directory, rank))
    if per_rank["statefuls"]:
        (directory / RANK_STATE_DIR).mkdir(exist_ok=True)
        mine = {n: trees[n] for n in per_rank["statefuls"]}
        flat = {k: v for n in per_rank["statefuls"] for k, v in own_tensors[n].items()}
        if flat:
            _write_tensors(rank_state_file(directory, rank, ".safetensors"), flat)
        _write_json(
            rank_state_file(directory, rank, ".json"),
            {"format": RANK_STATE_FORMAT, "rank": rank, "statefuls": mine},
        )
    if rank == 0:
        shared = [n for n in statefuls if n not in per_rank["statefuls"]]
        flat = {k: v for n in shared for k, v in own_tensors[n].items()}
        doc: dict[str, Any] = {
            "format": STATE_FORMAT if any(per_rank.values()) else 1,
            "loop": loop,
            "optimizer": optim_meta,
            "statefuls": {n: trees[n] for n in shared},
        }
        if any(per_rank.values()):
            doc["per_rank"] = per_rank
        if flat:
            _write_tensors(directory / STATE_TENSORS, flat)
        _write_json(directory / RELAY_STATE, doc)


def state_path(ckpt_dir: Path) -> Path:
    """The checkpoint's loop-and-statefuls record: relay_state.json, or trainer_state.json in one written before
    the rename (never both from us: a trainer_state.json beside relay_state.json is Hugging Face's, not read)."""
    path = ckpt_dir / RELAY_STATE
    legacy = ckpt_dir / LEGACY_STATE
    return legacy if not path.exists() and legacy.exists() else path


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    """relay_state.json (or an older checkpoint's trainer_state.json), checked to be a format this reads."""
    path = state_path(ckpt_dir)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: state format {doc.get('format') if isinstance(doc, dict) else None!r} is not one of {list(READABLE_FORMATS)}",
            hint="continue this run with the torchrelay version that wrote it",
        )
    return doc


def per_rank_of(doc: dict[str, Any]) -> dict[str, list[str]]:
    """What a checkpoint stores per rank: {"model": [fqn], "optim": [key], "statefuls": [name]}."""
    stored = doc.get("per_rank") or {}
    return {part: list(stored.get(part, [])) for part in ("model", "optim", "statefuls")}


def read_rank_statefuls(ckpt_dir: Path, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON trees and tensors of the statefuls stored for `rank`."""
    path = rank_state_file(ckpt_dir, rank, ".json")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} is missing: the checkpoint was saved by fewer ranks",
            hint="resume with the world size that saved it",
        ) from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if doc.get("format") != RANK_STATE_FORMAT or doc.get("rank") != rank:
        raise CheckpointError(
            f"{path}: not rank {rank}'s state of format {RANK_STATE_FORMAT} (format {doc.get('format')!r}, "
            f"rank {doc.get('rank')!r})"
        )
    tensor_file = rank_state_file(ckpt_dir, rank, ".safetensors")
    return dict(doc["statefuls"]), load_file(str(tensor_file)) if tensor_file.exists() else {}


def load_state(
    ckpt_dir: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
) -> dict[str, Any]:
    """Restore everything this rank holds from `ckpt_dir` (its own copy of what differs by rank); returns the loop state."""
    doc = read_trainer_state(ckpt_dir)
    per_rank = per_rank_of(doc)
    if model is not None:
        msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
        otensors, _ = _split_optimizer(osd) if optimizer is not None else ({}, None)
        target, has_own = _dcp_layout(msd, otensors, per_rank, rank)
        dcp_io.load(target, ckpt_dir / MODEL_DIR)
        if has_own:
            mine = target[ranks.PER_RANK][str(rank)]
            target["model"] = {**target["model"], **mine["model"]}
            target["optim"] = {**target["optim"], **mine["optim"]}
        kwargs: dict[str, Any] = {"model_state_dict": target["model"]}
        if optimizer is not None:
            if doc.get("optimizer") is None:
                raise CheckpointError(f"{ckpt_dir}: holds no optimizer state but an optimizer is tracked")
            kwargs["optim_state_dict"] = _join_optimizer(target["optim"], doc["optimizer"])
        set_state_dict(model, optimizer or [], options=_OPTS, **kwargs)
    tensors = load_file(str(ckpt_dir / STATE_TENSORS)) if (ckpt_dir / STATE_TENSORS).exists() else {}
    stored = dict(doc.get("statefuls", {}))
    if per_rank["statefuls"]:
        own_trees, own_tensors = read_rank_statefuls(ckpt_dir, rank)
        stored |= own_trees
        tensors = {**tensors, **own_tensors}
    missing = sorted(set(statefuls) - set(stored))
    extra = sorted(set(stored) - set(statefuls))
    if missing or extra:
        raise CheckpointError(
            f"{state_path(ckpt_dir)}: tracked state differs from the checkpoint "
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
