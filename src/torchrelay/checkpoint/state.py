"""What a checkpoint holds and how each part is written: DCP tensors, JSON, safetensors — never a pickle, except
the files of a DeepSpeed engine's own checkpoint (deepspeed_engine.py)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import save as _safetensors_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from torchrelay import rng
from torchrelay.checkpoint import dcp_io, dcp_save, ranks
from torchrelay.checkpoint import deepspeed_engine as ds_engine
from torchrelay.checkpoint.host_stage import HostStage, shapes_of
from torchrelay.checkpoint.inventory import INVENTORY, read_inventory, safe_relpath
from torchrelay.checkpoint.persist import canonical_safetensors, write_bytes
from torchrelay.errors import CheckpointError, IntegrityError, RecordError
from torchrelay.util import collective
from torchrelay.util.hashing import sha256_many
from torchrelay.util.records import Optional, check, read_json, read_safetensors
from torchrelay.util.records import exists as records_exists

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


@dataclass
class Snapshot:
    """One rank's part of a checkpoint as it was at the save: host copies of its tensors and the bytes of its
    small files, ready to be written by `write_snapshot` on any thread while training goes on."""

    rank: int
    tensors_doc: dict[str, Any] | None  # the DCP document (host tensors), None without a model
    rng: bytes
    rank_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # statefuls that differ by rank
    rank_json: bytes | None = None
    shared_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: statefuls' tensors
    trainer_json: bytes | None = None  # rank 0: relay_state.json
    planned: dcp_save.PlannedSave | None = None  # the DCP save of tensors_doc, planned during the stall

    def plan(self, group: Any = None) -> dcp_save.PlannedSave | None:
        """Plan the DCP save of the tensors with the other ranks (every rank calls it, once or again): on the
        training thread while the copies into the host buffers are in flight, so that the persist thread only
        writes. None without tensors."""
        if self.tensors_doc is not None and self.planned is None:
            self.planned = dcp_save.plan(self.tensors_doc, group)
        return self.planned


def safetensors_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes, the same for the same tensors and metadata (see canonical_safetensors)."""
    return canonical_safetensors(_safetensors_save(tensors, metadata=metadata))


def _json_bytes(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def capture_state(
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    loop: dict[str, Any],
    stage: HostStage | None = None,
    engine: dict[str, Any] | None = None,
    group: Any = None,
) -> Snapshot:
    """Take this rank's part of a checkpoint (every rank calls it, at the same update: it agrees with the others
    on what differs by rank). Tensors are copied into `stage`'s reused host buffers; after `stage.synchronize()`
    the snapshot no longer depends on the live state.

    What is equal on every rank is stored once; what differs between ranks (see ranks.py) is stored for each
    rank: model and optimizer tensors under DCP's `per_rank/<r>`, statefuls in `statefuls/rank-<r>.*`.
    """
    stage = stage or HostStage()
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
    differ: set[str] = set()
    if (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    ):  # one rank differs from none
        digests = {k: ranks.tensor_digest(v) for k, v in ranks.compared(model, msd, otensors).items()}
        digests |= {f"state/{n}": ranks.stateful_digest(trees[n], own_tensors[n]) for n in statefuls}
        differ = ranks.differing(digests, group)
    per_rank = {
        "model": sorted(k.removeprefix("model/") for k in differ if k.startswith("model/")),
        "optim": sorted(k.removeprefix("optim/") for k in differ if k.startswith("optim/")),
        "statefuls": sorted(k.removeprefix("state/") for k in differ if k.startswith("state/")),
    }
    tensors_doc = None
    if model is not None:
        tensors_doc = stage.copy_tree("dcp", _dcp_layout(msd, otensors, per_rank, rank)[0])
    rng_tensors, rng_meta = rng.capture()
    snap = Snapshot(rank=rank, tensors_doc=tensors_doc, rng=safetensors_save(rng_tensors, metadata=rng_meta))
    # A stateful's tensors may be the live ones (`.cpu()` of a CPU tensor is the tensor itself): copied too.
    if per_rank["statefuls"]:
        mine = {n: trees[n] for n in per_rank["statefuls"]}
        flat = {k: v for n in per_rank["statefuls"] for k, v in own_tensors[n].items()}
        snap.rank_tensors = stage.copy_tree("own", flat)
        snap.rank_json = _json_bytes({"format": RANK_STATE_FORMAT, "rank": rank, "statefuls": mine})
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
        if engine is not None:  # what save_engine recorded of the DeepSpeed engine's own files
            doc["deepspeed"] = engine
        snap.shared_tensors = stage.copy_tree("shared", flat)
        snap.trainer_json = _json_bytes(doc)
    return snap


def reserve(
    stage: HostStage, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, rank: int
) -> None:
    """Start allocating the host buffers a save of this model and optimizer will copy into (background)."""
    if model is None or ds_engine.is_engine(model):  # an engine writes its own files (save_state)
        return
    msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
    otensors = _split_optimizer(osd)[0] if optimizer is not None else {}
    doc, _ = _dcp_layout(msd, otensors, {"model": [], "optim": [], "statefuls": []}, rank)
    shapes: dict[str, Any] = {}
    shapes_of("dcp", doc, shapes)
    stage.reserve(shapes)


def write_snapshot(
    snap: Snapshot,
    directory: Path,
    *,
    kill_hook: Any = None,
    group: Any = None,
    background: bool = False,
) -> dict[str, tuple[str, int]]:
    """Write a snapshot into `directory` (every rank, with the others: DCP plans across `group`), every file
    fsynced; returns {relative path: (SHA-256, size)} of the files this rank wrote, hashed as they were written.
    `background`: called on the persist thread, beside the training loop."""
    written: dict[str, tuple[str, int]] = {}
    planned = snap.plan(group)  # made during the stall already, unless saved in one go (save_state)
    if planned is not None:
        planned.write(directory / MODEL_DIR, written, background=background)
    if kill_hook:
        kill_hook("shards")
    (directory / "rng").mkdir(exist_ok=True)
    write_bytes(rng.rank_file(directory, snap.rank), snap.rng, written)
    if snap.rank_json is not None:
        (directory / RANK_STATE_DIR).mkdir(exist_ok=True)
        if snap.rank_tensors:
            write_bytes(
                rank_state_file(directory, snap.rank, ".safetensors"),
                safetensors_save(snap.rank_tensors),
                written,
            )
        write_bytes(rank_state_file(directory, snap.rank, ".json"), snap.rank_json, written)
    if snap.trainer_json is not None:
        if snap.shared_tensors:
            write_bytes(directory / STATE_TENSORS, safetensors_save(snap.shared_tensors), written)
        write_bytes(directory / RELAY_STATE, snap.trainer_json, written)
    # .metadata is written by DCP's coordinator only: it is hashed with whatever else this rank did not write
    return {str(Path(p).relative_to(directory)): v for p, v in written.items()}


def save_state(
    directory: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    loop: dict[str, Any],
    kill_hook: Any = None,
) -> dict[str, tuple[str, int]]:
    """Capture and write this rank's part of a checkpoint into `directory` in one go (every rank calls it).

    A DeepSpeed engine writes model, optimizer partitions, LR scheduler and counters itself, into `directory`'s
    deepspeed/ (deepspeed_engine.py), before the rest is captured."""
    engine: dict[str, Any] | None = None
    written: dict[str, tuple[str, int]] = {}
    if ds_engine.is_engine(model):
        engine, written = ds_engine.save_engine(model, directory)
        model, optimizer = None, None
    stage = HostStage()
    snap = capture_state(
        rank=rank,
        model=model,
        optimizer=optimizer,
        statefuls=statefuls,
        loop=loop,
        stage=stage,
        engine=engine,
    )
    stage.synchronize()
    try:
        return written | write_snapshot(snap, directory, kill_hook=kill_hook)
    finally:
        stage.release()


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
    checked before anything is allocated (util/records.read_safetensors)."""
    return read_safetensors(path, what=what, root=root)[0] if records_exists(path) else {}


def tree_of(tree: Any, tensors: dict[str, torch.Tensor], *, source: str, name: str) -> Any:
    """A stored stateful's state from its JSON tree; a tree no save writes (a missing tensor, a malformed node)
    is one RecordError naming the file and the stateful."""
    try:
        return _from_tree(tree, tensors)
    except CheckpointError as exc:
        raise RecordError(source, exc.message, field=f"statefuls.{name}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(
            source,
            f"not a tree a save writes ({type(exc).__name__}: {str(exc)[:120]})",
            field=f"statefuls.{name}",
        ) from None


def load_state(
    ckpt_dir: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    verify: bool = False,
    resharded: bool = False,
) -> dict[str, Any]:
    """Restore everything this rank holds from `ckpt_dir` (its own copy of what differs by rank); returns the loop state.

    verify: check every file against COMPLETE.json on the way (every rank calls it): the small files first, hashed
    in shares by the ranks; the DCP files by each rank that reads them, as it reads them, in parallel; the DCP files
    no rank read, last, in shares. Every rank raises the first failure, naming the file.
    resharded: the checkpoint was saved on another layout (another world size). DCP reshards model and optimizer
    onto this one (DDP's replicated tensors, FSDP2's shards); tensors stored per rank come from rank 0, and
    per-rank statefuls were refused before (resume.validate_resume).
    """
    # One phase of the failure protocol (util/collective.py): a rank that fails anywhere in here joins the exchange
    # the others wait in, and every rank raises the same error. DCP and DeepSpeed run collectives of their own, so
    # the ranks agree before entering them: none enters one that a failed rank will never join.
    peers = collective.ranks()
    with peers.phase(f"loading {ckpt_dir.name}"):
        return _load_state(ckpt_dir, peers, rank, model, optimizer, statefuls, verify, resharded)


def _load_state(
    ckpt_dir: Path,
    peers: collective.Ranks,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    verify: bool,
    resharded: bool,
) -> dict[str, Any]:
    inventory: dict[str, tuple[str, int]] = {}
    phase = f"loading {ckpt_dir.name}"
    if verify:
        inventory = {e["path"]: (e["sha256"], e["size"]) for e in read_inventory(ckpt_dir)["files"]}
        _verify_share(peers, ckpt_dir, [p for p in inventory if not p.endswith(".distcp")], inventory, rank)
    read_by_me: set[str] = set()
    doc = read_trainer_state(ckpt_dir)
    per_rank = per_rank_of(doc)
    if ds_engine.is_engine(model):  # its files were verified above when `verify`, at the open otherwise
        peers.exchange(phase)
        ds_engine.load_engine(model, ckpt_dir, doc.get("deepspeed"))
        model = None
    elif doc.get("deepspeed") is not None:
        raise CheckpointError(
            f"{ckpt_dir}: holds a DeepSpeed engine's checkpoint, but no DeepSpeed engine is tracked",
            hint="track the engine deepspeed.initialize returned: run.track(model=engine)",
        )
    source = 0 if resharded else rank  # whose per-rank tensors this rank takes
    if model is not None:
        msd, osd = get_state_dict(model, optimizer or [], options=_OPTS)
        otensors, _ = _split_optimizer(osd) if optimizer is not None else ({}, None)
        target, has_own = _dcp_layout(msd, otensors, per_rank, source)
        prefix = f"{MODEL_DIR}/"
        expected = {k.removeprefix(prefix): v for k, v in inventory.items() if k.startswith(prefix)}
        peers.exchange(phase)
        read_by_me = {
            prefix + n for n in dcp_io.load(target, ckpt_dir / MODEL_DIR, expected=expected or None)
        }
        if has_own:
            mine = target[ranks.PER_RANK][str(source)]
            target["model"] = {**target["model"], **mine["model"]}
            target["optim"] = {**target["optim"], **mine["optim"]}
        kwargs: dict[str, Any] = {"model_state_dict": target["model"]}
        if optimizer is not None:
            if doc.get("optimizer") is None:
                raise CheckpointError(f"{ckpt_dir}: holds no optimizer state but an optimizer is tracked")
            kwargs["optim_state_dict"] = _join_optimizer(target["optim"], doc["optimizer"])
        set_state_dict(model, optimizer or [], options=_OPTS, **kwargs)
    tensors = read_tensors(ckpt_dir / STATE_TENSORS, what="the statefuls' tensors", root=ckpt_dir)
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
    if verify:  # a DCP file that no rank read (another rank's own tensors) is checked all the same
        read = peers.all_gather(phase, lambda: read_by_me)
        unread = [p for p in inventory if p.endswith(".distcp") and not any(p in r for r in read)]
        _verify_share(peers, ckpt_dir, unread, inventory, rank)
    for name, obj in statefuls.items():
        obj.load_state_dict(tree_of(stored[name], tensors, source=str(state_path(ckpt_dir)), name=name))
    return dict(doc["loop"])


def _verify_share(
    peers: collective.Ranks, ckpt_dir: Path, rels: list[str], inventory: dict[str, tuple[str, int]], rank: int
) -> None:
    """Hash this rank's share of `rels` (on every core); every rank raises the first mismatch any rank found."""
    mine = [
        safe_relpath(ckpt_dir, rel, ckpt_dir / INVENTORY)
        for i, rel in enumerate(sorted(rels))
        if i % peers.size == rank
    ]

    def check() -> None:
        damaged = (
            f"the file is damaged; restore it, or remove {ckpt_dir.name} to resume from an older checkpoint"
        )
        try:
            digests = sha256_many(mine)
        except OSError as exc:
            raise IntegrityError(f"cannot read {exc.filename}: {exc.strerror or exc}", hint=damaged) from exc
        for path in mine:
            rel = path.relative_to(ckpt_dir).as_posix()
            if digests[path] != inventory[rel]:
                raise IntegrityError(f"{path} does not match its SHA-256 in {INVENTORY}", hint=damaged)

    peers.agree(f"loading {ckpt_dir.name}", check)


def load_rng(ckpt_dir: Path, rank: int) -> None:
    """Restore this rank's generators; called right before the first update so nothing draws in between."""
    rng_file = rng.rank_file(ckpt_dir, rank)
    if not records_exists(rng_file):
        raise CheckpointError(
            f"{rng_file} is missing: the checkpoint was saved by fewer ranks",
            hint="resume with the world size that saved it",
        )
    rng.load(rng_file, root=ckpt_dir)
