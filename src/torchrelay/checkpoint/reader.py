"""Read a checkpoint's tensors without a model or a process group (audits, tests, diffs)."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchrelay.checkpoint import dcp_io
from torchrelay.checkpoint.deepspeed_engine import DS_DIR, DS_TAG, safe_load
from torchrelay.checkpoint.ranks import PER_RANK
from torchrelay.checkpoint.state import (
    MODEL_DIR,
    RANK_STATE_DIR,
    STATE_TENSORS,
    per_rank_of,
    rank_state_file,
    read_rank_statefuls,
    read_tensors,
    read_trainer_state,
    state_path,
    tree_of,
)

_DS_RANK = re.compile(r"^zero_pp_rank_(\d+)_")
_RANK_FILE = re.compile(r"^rank-(\d+)\.json$")
_PER_RANK_KEY = re.compile(rf"^{PER_RANK}\.(\d+)\.(model|optim)\.(.+)$", re.S)


def _name(key: str) -> str:
    """A DCP key as the reader names it: `model.<fqn>`, `optim.<fqn>.<state>`, `…@rank<r>` when stored per rank."""
    own = _PER_RANK_KEY.match(key)
    if own:
        key = f"{own.group(2)}.{own.group(3)}@rank{own.group(1)}"
    return key.replace("\x1f", ".")


def load_tensors(ckpt_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, full (unsharded), named `model.<fqn>` / `optim.<fqn>.<state>`.

    A tensor that differed between ranks at the save is stored per rank and read as `<name>@rank<r>`. A DeepSpeed
    engine's checkpoint: see _engine_tensors.
    """
    if (Path(ckpt_dir) / DS_DIR).is_dir():
        record = read_trainer_state(Path(ckpt_dir)).get("deepspeed")
        if isinstance(record, dict):
            return _engine_tensors(Path(ckpt_dir), record)
    model_dir = Path(ckpt_dir) / MODEL_DIR
    md = dcp_io.read_metadata(model_dir)
    state: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        assert isinstance(item, TensorStorageMetadata)
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp_io.load(state, model_dir, no_dist=True)
    return {_name(k): v for k, v in sorted(state.items())}


def _engine_tensors(ckpt_dir: Path, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a DeepSpeed engine's files (read weights_only): the model as `model.<fqn>` (ZeRO-3: each
    rank's partition as `model@rank<r>.<fqn>`), each rank's optimizer partition as `optim@rank<r>.<path>`, the
    engine's other tensors (the LR scheduler's) as `<file>.<path>`."""
    root = ckpt_dir / str(record.get("dir", DS_DIR)) / str(record.get("tag", DS_TAG))
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.pt")):
        doc = safe_load(path, "cpu")
        name = path.name.removesuffix(".pt")
        owner = _DS_RANK.match(name)
        if name.endswith("_optim_states") and owner:
            out |= flat_tensors(doc.get("optimizer_state_dict"), f"optim@rank{int(owner.group(1))}")
        elif isinstance(doc, dict):
            prefix = f"model@rank{int(owner.group(1))}" if owner else "model"
            module = doc.get("module") or {}
            out |= {f"{prefix}.{k}": v for k, v in module.items() if isinstance(v, torch.Tensor)}
            out |= flat_tensors({k: v for k, v in doc.items() if k not in ("module", "ds_config")}, name)
    return dict(sorted(out.items()))


MODEL_PREFIX = "model."  # DCP flattens {"model": state_dict} into "model.<fqn>"
# A model tensor that differed between ranks at the save is stored per rank; an export takes rank 0's copy, the
# one DDP hands every rank at its next synchronizing forward.
EXPORT_RANK = 0


def _model_keys(md: Any) -> dict[str, str]:
    """{fqn: DCP key} of the model's tensors; a tensor stored per rank maps to EXPORT_RANK's copy."""
    out = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        own = _PER_RANK_KEY.match(key)
        if key.startswith(MODEL_PREFIX):
            out[key.removeprefix(MODEL_PREFIX)] = key
        elif own and own.group(2) == "model" and int(own.group(1)) == EXPORT_RANK:
            out[own.group(3)] = key
    return dict(sorted(out.items()))


def model_tensor_specs(ckpt_dir: str | os.PathLike[str]) -> dict[str, tuple[list[int], torch.dtype]]:
    """{fqn: (shape, dtype)} of the model's tensors, keyed as the module's own state_dict; reads no tensor."""
    md = dcp_io.read_metadata(Path(ckpt_dir) / MODEL_DIR)
    out = {}
    for fqn, key in _model_keys(md).items():
        item = md.state_dict_metadata[key]
        assert isinstance(item, TensorStorageMetadata)
        out[fqn] = (list(item.size), item.properties.dtype)
    return out


def iter_model_tensors(
    ckpt_dir: str | os.PathLike[str], names: list[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, full tensor) of the model (not the optimizer), one at a time, in the order of `names` (default: all,
    sorted): only one tensor is in memory at a time, whatever the checkpoint's size."""
    model_dir = Path(ckpt_dir) / MODEL_DIR
    md = dcp_io.read_metadata(model_dir)
    keys = _model_keys(md)
    for name in names if names is not None else list(keys):
        yield name, dcp_io.read_tensor(model_dir, md, keys.get(name, MODEL_PREFIX + name))


def load_statefuls(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every registered stateful's state (JSON values and tensors), by name; `<name>@rank<r>` when stored per rank."""
    root = Path(ckpt_dir)
    doc = read_trainer_state(root)
    shared = read_tensors(root / STATE_TENSORS, what="the statefuls' tensors", root=root)
    source = str(state_path(root))
    out = {
        name: tree_of(tree, shared, source=source, name=name)
        for name, tree in doc.get("statefuls", {}).items()
    }
    if per_rank_of(doc)["statefuls"]:
        found = (_RANK_FILE.match(p.name) for p in (root / RANK_STATE_DIR).iterdir())
        for rank in sorted(int(m.group(1)) for m in found if m):
            trees, tensors = read_rank_statefuls(root, rank)
            source = str(rank_state_file(root, rank, ".json"))
            out |= {
                f"{name}@rank{rank}": tree_of(tree, tensors, source=source, name=name)
                for name, tree in trees.items()
            }
    return dict(sorted(out.items()))


def flat_tensors(state: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors inside a nested state (dicts, lists), named `<prefix>.<key>...`."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for key, value in state.items():
            out |= flat_tensors(value, f"{prefix}.{key}")
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            out |= flat_tensors(value, f"{prefix}.{i}")
    return out
