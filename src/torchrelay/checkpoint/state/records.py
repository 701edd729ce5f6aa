"""The files of a checkpoint's state besides DCP's: their names and formats, and their readers, each record checked
against its schema before a field is used (relay_state.json, statefuls/rank-<r>.*, state_tensors.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save as _safetensors_save

from torchrelay.checkpoint.hashing_writer import canonical_safetensors
from torchrelay.errors import CheckpointError, RecordError
from torchrelay.util.records import Optional, check, read_json
from torchrelay.util.records import exists as records_exists
from torchrelay.util.safetensors_records import read_safetensors

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


def rank_state_file(ckpt_dir: Path, rank: int, suffix: str) -> Path:
    """statefuls/rank-<r>.json (or .safetensors): the statefuls that differ by rank, as this rank holds them."""
    return ckpt_dir / RANK_STATE_DIR / f"rank-{rank}{suffix}"


def safetensors_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes, the same for the same tensors and metadata (see canonical_safetensors)."""
    return canonical_safetensors(_safetensors_save(tensors, metadata=metadata))


def json_bytes(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def state_path(ckpt_dir: Path) -> Path:
    """The checkpoint's loop-and-statefuls record: relay_state.json, or trainer_state.json in one written before
    the rename (never both from us: a trainer_state.json beside relay_state.json is Hugging Face's, not read)."""
    path = ckpt_dir / RELAY_STATE
    legacy = ckpt_dir / LEGACY_STATE
    return legacy if not os.path.lexists(path) and legacy.exists() else path


# What relay_state.json (and an older trainer_state.json) holds, checked before a field is used.
STATE_SCHEMA = {
    "format": int,
    "loop": dict,
    "statefuls": Optional(dict),
    "optimizer": Optional((dict, type(None))),
    "per_rank": Optional(dict),
    "deepspeed": Optional((dict, type(None))),
}
RANK_STATE_SCHEMA = {"format": int, "rank": int, "statefuls": dict}
OPTIMIZER_SCHEMA = {"param_groups": list, "scalars": dict}
PER_RANK_SCHEMA = {part: Optional(list) for part in ("model", "optim", "statefuls")}


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    """relay_state.json (or an older checkpoint's trainer_state.json), checked to be a format this reads; a file
    that is not such a record (not JSON, too deep, a field of the wrong type, a link out) is one RecordError."""
    path = state_path(ckpt_dir)
    try:
        doc = read_json(path, what="the checkpoint's state", root=ckpt_dir, schema=STATE_SCHEMA)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} is missing", hint="the checkpoint is damaged; resume from another"
        ) from exc
    except OSError as exc:  # unreadable
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if doc["format"] not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: state format {doc['format']!r} is not one of {list(READABLE_FORMATS)}",
            hint="continue this run with the torchrelay version that wrote it",
        )
    if doc.get("optimizer") is not None:
        optimizer = check(doc["optimizer"], OPTIMIZER_SCHEMA, source=f"{path} optimizer")
        if not all(isinstance(v, dict) for v in optimizer["scalars"].values()):
            raise RecordError(str(path), "holds a value that is not an object", field="optimizer.scalars")
    per_rank = check(doc.get("per_rank") or {}, PER_RANK_SCHEMA, source=f"{path} per_rank")
    for part in PER_RANK_SCHEMA:
        if not all(isinstance(n, str) for n in per_rank.get(part) or []):
            raise RecordError(str(path), "names a part that is not a string", field=f"per_rank.{part}")
    return doc


def per_rank_of(doc: dict[str, Any]) -> dict[str, list[str]]:
    """What a checkpoint stores per rank: {"model": [fqn], "optim": [key], "statefuls": [name]}."""
    stored = doc.get("per_rank") or {}
    return {part: list(stored.get(part, [])) for part in ("model", "optim", "statefuls")}


def read_rank_statefuls(ckpt_dir: Path, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON trees and tensors of the statefuls stored for `rank`."""
    path = rank_state_file(ckpt_dir, rank, ".json")
    try:
        doc = read_json(path, what=f"rank {rank}'s statefuls", root=ckpt_dir, schema=RANK_STATE_SCHEMA)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} is missing: the checkpoint was saved by fewer ranks",
            hint="resume with the world size that saved it",
        ) from exc
    except OSError as exc:  # unreadable
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if doc["format"] != RANK_STATE_FORMAT or doc["rank"] != rank:
        raise CheckpointError(
            f"{path}: not rank {rank}'s state of format {RANK_STATE_FORMAT} (format {doc['format']!r}, "
            f"rank {doc['rank']!r})"
        )
    tensor_file = rank_state_file(ckpt_dir, rank, ".safetensors")
    return dict(doc["statefuls"]), read_tensors(
        tensor_file, what=f"rank {rank}'s stateful tensors", root=ckpt_dir
    )


def read_tensors(path: Path, *, what: str, root: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file of the checkpoint `root`, none when there is no such file; its header is
    checked before anything is allocated (util/safetensors_records.read_safetensors)."""
    return read_safetensors(path, what=what, root=root)[0] if records_exists(path) else {}
