"""A save of one rank's part of a checkpoint: captured into host buffers at the update (`capture_state`, every rank
together), then written on any thread while training goes on (`write_snapshot`), or both in one go (`save_state`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.checkpoint import dcp_save, ranks, recycle
from torchrelay.checkpoint import deepspeed_engine as ds_engine
from torchrelay.checkpoint.hashing_writer import write_bytes
from torchrelay.checkpoint.host_stage import HostStage, specs_of
from torchrelay.checkpoint.state import rng
from torchrelay.checkpoint.state.document import dcp_document, split_optimizer, state_dicts
from torchrelay.checkpoint.state.records import (
    MODEL_DIR,
    RANK_STATE_DIR,
    RANK_STATE_FORMAT,
    RELAY_STATE,
    STATE_FORMAT,
    STATE_TENSORS,
    Stateful,
    json_bytes,
    rank_state_file,
    safetensors_save,
)
from torchrelay.checkpoint.state.trees import to_tree
from torchrelay.checkpoint.writer_process import WriterProcess
from torchrelay.config.tuning import SaveTuning


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
    tuning: SaveTuning = field(default_factory=SaveTuning)  # how the files are written (the stage's)

    def plan(self, group: Any = None) -> dcp_save.PlannedSave | None:
        """Plan the DCP save of the tensors with the other ranks (every rank calls it, once or again): on the
        training thread while the copies into the host buffers are in flight, so that the persist thread only
        writes. None without tensors."""
        if self.tensors_doc is not None and self.planned is None:
            self.planned = dcp_save.plan(self.tensors_doc, group)
        return self.planned


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
        msd, osd = state_dicts(model, optimizer)
        otensors, optim_meta = split_optimizer(osd) if optimizer is not None else ({}, None)
    trees: dict[str, Any] = {}
    own_tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in statefuls.items():
        own_tensors[name] = {}
        trees[name] = to_tree(obj.state_dict(), name, own_tensors[name])
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
        tensors_doc = stage.copy_tree("dcp", dcp_document(msd, otensors, per_rank, rank)[0])
    rng_tensors, rng_meta = rng.capture()
    snap = Snapshot(
        rank=rank,
        tensors_doc=tensors_doc,
        rng=safetensors_save(rng_tensors, metadata=rng_meta),
        tuning=stage.tuning,
    )
    # A stateful's tensors may be the live ones (`.cpu()` of a CPU tensor is the tensor itself): copied too.
    if per_rank["statefuls"]:
        mine = {n: trees[n] for n in per_rank["statefuls"]}
        flat = {k: v for n in per_rank["statefuls"] for k, v in own_tensors[n].items()}
        snap.rank_tensors = stage.copy_tree("own", flat)
        snap.rank_json = json_bytes({"format": RANK_STATE_FORMAT, "rank": rank, "statefuls": mine})
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
        snap.trainer_json = json_bytes(doc)
    return snap


def reserve(stage: HostStage, model: torch.nn.Module | None, optimizer: Any, rank: int) -> None:
    """Start allocating the host buffers a save of this model and optimizer (one, or several: a list) will copy
    into (background): one for each tensor of the model's state dict and of each optimizer's state, by kind (shape,
    dtype, device), never by DCP's name (asking DCP for the names would lengthen the loop's update). A tensor it did not foresee gets its buffer at the save."""
    if model is None or ds_engine.is_engine(model):  # an engine writes its own files (save_state)
        return
    optimizers = [] if optimizer is None else [optimizer] if hasattr(optimizer, "state") else list(optimizer)
    stage.reserve(
        specs_of([model.state_dict(keep_vars=True), *(getattr(o, "state", {}) for o in optimizers)])
    )


def write_snapshot(
    snap: Snapshot,
    directory: Path,
    *,
    kill_hook: Any = None,
    group: Any = None,
    background: bool = False,
    process: WriterProcess | None = None,
) -> dict[str, tuple[str, int]]:
    """Write a snapshot into `directory` (every rank, with the others: DCP plans across `group`), every file
    fsynced; returns {relative path: (SHA-256, size)} of the files this rank wrote, hashed as they were written.
    `background`: called on the persist thread, beside the training loop; `process`: the DCP files written by
    that writer process (the snapshot's tensors in its stage's shared buffers), the same bytes."""
    written: dict[str, tuple[str, int]] = {}
    planned = snap.plan(group)  # made during the stall already, unless saved in one go (save_state)
    if planned is not None:
        spare = recycle.spare_of(directory, MODEL_DIR)  # a retired checkpoint's files, written over
        planned.write(
            directory / MODEL_DIR,
            written,
            background=background,
            process=process,
            spare=spare,
            tuning=snap.tuning,
        )
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
    tuning: SaveTuning | None = None,
) -> dict[str, tuple[str, int]]:
    """Capture and write this rank's part of a checkpoint into `directory` in one go (every rank calls it).

    A DeepSpeed engine writes model, optimizer partitions, LR scheduler and counters itself, into `directory`'s
    deepspeed/ (deepspeed_engine.py), before the rest is captured."""
    engine: dict[str, Any] | None = None
    written: dict[str, tuple[str, int]] = {}
    if ds_engine.is_engine(model):
        engine, written = ds_engine.save_engine(model, directory)
        model, optimizer = None, None
    stage = HostStage(tuning=tuning)
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
