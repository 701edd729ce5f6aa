"""A load of everything one rank holds from a checkpoint (model and optimizer through DCP, the statefuls, and
right before the first update its generators), every file checked against the inventory on the way when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchrelay.checkpoint import dcp_io, ranks
from torchrelay.checkpoint import deepspeed_engine as ds_engine
from torchrelay.checkpoint.inventory import INVENTORY, part_states, read_inventory, safe_relpath
from torchrelay.checkpoint.state import rng
from torchrelay.checkpoint.state.document import (
    STATE_DICT_OPTIONS,
    dcp_document,
    join_optimizer,
    named_params,
    optimizers_of,
    split_optimizer,
)
from torchrelay.checkpoint.state.records import (
    MODEL_DIR,
    STATE_TENSORS,
    Stateful,
    per_rank_of,
    rank_state_file,
    read_rank_statefuls,
    read_tensors,
    read_trainer_state,
    state_path,
)
from torchrelay.checkpoint.state.trees import like_live, tree_of
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import CheckpointError, IntegrityError
from torchrelay.util import collective
from torchrelay.util.hashing import sha256_many
from torchrelay.util.records import exists as records_exists


def load_state(
    ckpt_dir: Path,
    *,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    verify: bool = False,
    resharded: bool = False,
    tuning: LoadTuning | None = None,
) -> dict[str, Any]:
    """Restore everything this rank holds from `ckpt_dir` (its own copy of what differs by rank); returns the loop state.

    verify: check every file against COMPLETE.json on the way (every rank calls it): the small files first, hashed
    in shares by the ranks; the DCP files by each rank that reads them, as it reads them, in parallel; the DCP files
    no rank read, last, in shares. Every rank raises the first failure, naming the file.
    resharded: the checkpoint was saved on another layout (another world size). DCP reshards model and optimizer
    onto this one (DDP's replicated tensors, FSDP2's shards); tensors stored per rank come from rank 0, and
    per-rank statefuls were refused before (resume_check.validate_resume).
    """
    # One phase of the failure protocol (util/collective.py): a rank that fails anywhere in here joins the exchange
    # the others wait in, and every rank raises the same error. DCP and DeepSpeed run collectives of their own, so
    # the ranks agree before entering them: none enters one that a failed rank will never join.
    peers = collective.ranks()
    with peers.phase(f"loading {ckpt_dir.name}"):
        return _load_state(ckpt_dir, peers, rank, model, optimizer, statefuls, verify, resharded, tuning)


def _load_state(
    ckpt_dir: Path,
    peers: collective.Ranks,
    rank: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    statefuls: dict[str, Stateful],
    verify: bool,
    resharded: bool,
    tuning: LoadTuning | None = None,
) -> dict[str, Any]:
    inventory: dict[str, tuple[str, int]] = {}
    parts: dict[
        str, tuple[int, list[str]]
    ] = {}  # the part states of files that list them (inventory.part_states)
    phase = f"loading {ckpt_dir.name}"
    if verify:
        entries = read_inventory(ckpt_dir)["files"]
        inventory = {e["path"]: (e["sha256"], e["size"]) for e in entries}
        parts = {e["path"]: p for e in entries if (p := part_states(e)) is not None}
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
        # The fresh optimizer's state, made up by torch for every trainable parameter (document.state_dicts), is
        # the template DCP fills; a parameter the checkpoint holds no state for keeps none (see _unsaved).
        msd, osd = get_state_dict(model, optimizer or [], options=STATE_DICT_OPTIONS)
        otensors, _ = split_optimizer(osd) if optimizer is not None else ({}, None)
        # read (and refused if tampered) before DCP opens anything; DCP plans with it, not parsed again
        metadata = dcp_io.read_metadata(ckpt_dir / MODEL_DIR)
        unsaved = _unsaved(ckpt_dir, osd, doc, source, metadata) if optimizer is not None else set()
        if optimizer is not None:  # before DCP reads a byte: its load would leave a group half-filled
            _same_param_groups(doc.get("optimizer"), osd, source=str(state_path(ckpt_dir)))
        otensors = {k: v for k, v in otensors.items() if k.split("\x1f", 1)[0] not in unsaved}
        target, has_own = dcp_document(msd, otensors, per_rank, source)
        prefix = f"{MODEL_DIR}/"
        expected: dict[str, tuple[Any, ...]] = {
            k.removeprefix(prefix): v + ((parts[k],) if k in parts else ())
            for k, v in inventory.items()
            if k.startswith(prefix)
        }
        peers.exchange(phase)
        read_by_me = {
            prefix + n
            for n in dcp_io.load(
                target, ckpt_dir / MODEL_DIR, expected=expected or None, metadata=metadata, tuning=tuning
            )
        }
        if has_own:
            mine = target[ranks.PER_RANK][str(source)]
            target["model"] = {**target["model"], **mine["model"]}
            target["optim"] = {**target["optim"], **mine["optim"]}
        kwargs: dict[str, Any] = {"model_state_dict": target["model"]}
        if optimizer is not None:
            if doc.get("optimizer") is None:
                raise CheckpointError(f"{ckpt_dir}: holds no optimizer state but an optimizer is tracked")
            meta = _like_live_optimizer(doc["optimizer"], osd, source=str(state_path(ckpt_dir)))
            kwargs["optim_state_dict"] = osd_in = join_optimizer(target["optim"], meta)
            # set_state_dict wants state for every trainable parameter (its strict check): the unsaved ones are
            # given the fresh optimizer's, and lose it again right after
            osd_in["state"] |= {fqn: cast(dict[str, Any], osd["state"])[fqn] for fqn in unsaved}
        gone = {id(p) for fqn, p in named_params(osd, optimizer) if fqn in unsaved}
        set_state_dict(model, optimizer or [], options=STATE_DICT_OPTIONS, **kwargs)
        for each in optimizers_of(optimizer):
            for param in [p for p in each.state if id(p) in gone]:
                del each.state[param]
            ds_engine.replay_cpu_adam(each)
    tensors = read_tensors(ckpt_dir / STATE_TENSORS, what="the statefuls' tensors", root=ckpt_dir)
    stored = dict(doc.get("statefuls", {}))
    sources = dict.fromkeys(stored, str(state_path(ckpt_dir)))
    if per_rank["statefuls"]:
        own_trees, own_tensors = read_rank_statefuls(ckpt_dir, rank)
        stored |= own_trees
        sources |= dict.fromkeys(own_trees, str(rank_state_file(ckpt_dir, rank, ".json")))
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
    states = {}  # every one checked before any is loaded
    for name, obj in statefuls.items():
        states[name] = tree_of(stored[name], tensors, source=sources[name], name=name)
        if isinstance(obj, LRScheduler | ReduceLROnPlateau):  # its step() computes with what is loaded
            states[name] = like_live(
                states[name],
                obj.state_dict(),
                source=sources[name],
                field=f"statefuls.{name}",
                open_none=True,
            )
    for name, obj in statefuls.items():
        obj.load_state_dict(states[name])
    return dict(doc["loop"])


def _like_live_optimizer(meta: dict[str, Any], osd: dict[str, Any], *, source: str) -> dict[str, Any]:
    """relay_state.json's param groups and scalar state of the optimizer, checked against the live optimizer's
    (get_state_dict's `osd`): a value that its step() cannot compute with is refused naming the field."""
    live_scalars = {
        fqn: {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        for fqn, state in osd.get("state", {}).items()
    }
    return {
        **meta,
        "param_groups": like_live(
            meta["param_groups"], osd.get("param_groups", []), source=source, field="optimizer.param_groups"
        ),
        "scalars": like_live(meta["scalars"], live_scalars, source=source, field="optimizer.scalars"),
    }


def _same_param_groups(meta: Any, osd: dict[str, Any], *, source: str) -> None:
    """The checkpoint's param groups hold the same parameters, group by group, as the live optimizer's; else one
    CheckpointError naming the first difference. DCP's set_state_dict matches groups by parameter name and leaves a
    live group it finds no match for with its `params` alone (no lr, no betas): the load passed and the first step
    raised KeyError, or trained on with another group's settings."""
    stored = (meta or {}).get("param_groups") if isinstance(meta, dict) else None
    if not isinstance(stored, list):
        return  # no optimizer state, or not a list: refused by the load's own checks
    saved = [g.get("params") if isinstance(g, dict) else None for g in stored]
    live = [list(g["params"]) for g in osd.get("param_groups", [])]
    if saved == live:
        return

    def shown(names: Any) -> str:
        names = list(names) if isinstance(names, list) else []
        text = ", ".join(str(n) for n in names[:3]) + (
            f", ... ({len(names)} in all)" if len(names) > 3 else ""
        )
        return f"[{text}]"

    if len(saved) != len(live):
        what = f"the checkpoint holds {len(saved)} param group(s), the tracked optimizer has {len(live)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, live, strict=True)) if a != b)
        what = f"param group {i} holds {shown(saved[i])} in the checkpoint, {shown(live[i])} now"
    raise CheckpointError(
        f"{source}: the optimizer's param groups differ from the checkpoint's ({what})",
        hint="build the optimizer with the param groups it had at the checkpoint's update (a group added "
        "mid-run: add it before run.track when resuming past that update, and not before)",
    )


def _unsaved(
    ckpt_dir: Path,
    osd: dict[str, Any],
    doc: dict[str, Any],
    source: int,
    metadata: Metadata,
) -> set[str]:
    """The parameters (get_state_dict's names) the checkpoint holds no optimizer state for on rank `source`: they
    had no gradient yet when it was saved (used only later, frozen by `p.grad = None`, an expert given no tokens),
    and the optimizer that saved it held nothing for them. The resumed optimizer must hold nothing either.

    A parameter whose stored state lacks some of what this optimizer keeps is refused, naming what is missing:
    the checkpoint was saved by another optimizer (DCP's own error would name a key only)."""
    scalars = (doc.get("optimizer") or {}).get("scalars", {})
    held: dict[str, set[str]] = {fqn: set(names) for fqn, names in scalars.items()}
    # split_optimizer names a tensor "<fqn>\x1f<name>"; DCP joins the document's levels with dots
    for prefix in ("optim.", f"{ranks.PER_RANK}.{source}.optim."):
        for key in metadata.state_dict_metadata:
            if key.startswith(prefix) and "\x1f" in key:
                fqn, name = key.removeprefix(prefix).split("\x1f", 1)
                held.setdefault(fqn, set()).add(name)
    unsaved: set[str] = set()
    for fqn, state in osd.get("state", {}).items():
        if not (names := held.get(fqn)):
            unsaved.add(fqn)
        elif missing := sorted(set(state) - names):
            raise CheckpointError(
                f"{ckpt_dir / MODEL_DIR}: the optimizer state of {fqn} lacks {missing}, which this optimizer keeps",
                hint="track the same optimizer (class and settings) as the run that saved the checkpoint",
            )
    return unsaved


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
