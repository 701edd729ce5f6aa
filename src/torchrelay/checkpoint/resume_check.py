"""The trainer's own resume validation, also run by `prepare` and `launch` before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.handed_off import PACKING, RECLAIM_ENV, guarding_record
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.select import latest_complete
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.errors import ConfigError, ContractMismatch, ForkRefused, RelayError
from torchrelay.manifest import Manifest
from torchrelay.paths.layout import PREPARE_RECORD
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import (
    build_contract,
    comparable,
    contract_changes,
    contract_manifest,
    load_contract,
    runtime_changes,
)
from torchrelay.records.reshard import (
    GRAD_ACCUM_MIRRORS,
    LAYOUT_CHANGE_SCHEMA,
    LAYOUT_FIELDS,
    Layout,
    change_record,
    checkpoint_layout,
    contract_global_batch,
    contract_layout,
    refuse_global_batch,
    refuse_unasked,
    resolve,
)
from torchrelay.util.dotted import flatten
from torchrelay.util.records import Field, Optional, Schema, read_json


@dataclass(slots=True)
class ResumeCheck:
    """What a resume would do: from which checkpoint, under which contract, with which runtime changes."""

    contract: dict[str, Any]
    recorded: dict[str, Any]
    manifest: Manifest
    checkpoint: Path | None
    update: int
    runtime_changes: dict[str, list[Any]] = field(default_factory=dict)
    passed: list[str] = field(default_factory=list)
    config: RelayConfig | None = None  # the configuration with the layout this launch runs with
    layout_change: dict[str, Any] | None = None  # reshard.change_record when the layout changes here
    code_changes: list[tuple[str, Any, Any]] = field(
        default_factory=list
    )  # files of the tree, not of the code


def schedule_gate(cfg: RelayConfig, update: int, where: str) -> str:
    """The schedule must still hold the checkpoint's update; returns the gate's line."""
    if update > cfg.total_updates:
        raise ConfigError(
            f"{where}: checkpoint update {update} is past total_updates {cfg.total_updates}",
            hint="the schedule is part of the contract and cannot shrink",
        )
    return f"SCHEDULE_GATE_PASS ({cfg.total_updates}, {cfg.warmup_updates})"


def check_fork_guard(ckpt: Path) -> None:
    record = guarding_record(ckpt)
    if record is None:
        return
    if record.get("state") == PACKING:
        raise ForkRefused(
            f"{ckpt.name}: a pack of it into {record.get('bundle', '?')} (lineage {record.get('lineage', '?')}) "
            "was interrupted; until it is finished or rolled back, continuing here could fork the run",
            hint=f"run `torchrelay pack {ckpt.parent} ...` again: it rolls back a bundle that never got its "
            f"SHA256SUMS, or says why it cannot; {RECLAIM_ENV}=1 continues here regardless",
        )
    raise ForkRefused(
        f"{ckpt.name} was handed off (bundle lineage {record.get('lineage', '?')}, "
        f"packed {record.get('packed_at', '?')}); continuing it here would fork the run",
        hint=f"continue from the bundle instead, or set {RECLAIM_ENV}=1 to reclaim it here on purpose",
    )


def validate_resume(
    run_dir: str | os.PathLike[str] | RunDir,
    cfg: RelayConfig,
    world_size: int,
    code_dir: str | os.PathLike[str] | None = None,
    *,
    deep: bool = True,
    code_from_bundle: bool = False,
    code_files: list[str] | tuple[str, ...] = (),
    reshard: bool = False,
    explicit: set[str] | frozenset[str] = frozenset(),
    asked_by: str = "reshard",
) -> ResumeCheck:
    """Recompute the contract and compare, pass the schedule gate, pick and verify the newest checkpoint.

    code_from_bundle: `code_dir` came out of a bundle, so no program (git) is run inside it.
    code_files: the running program's files (identity.running_files), when the trainer itself checks.
    reshard: this launch may change the layout (world size, micro_batch x grad_accum) with the same global batch
    (records/reshard.py); `prepare --world-size` asks for it on the run it prepares. explicit: the config keys the launch
    overrode on purpose (a split the script merely repeats is the run's current one). asked_by: who asked for
    the move, recorded as its `asked_by` (reshard.reshard_asker).
    """
    rd = RunDir.of(run_dir)
    stored = stored_config(rd)
    recorded = load_contract(rd)
    fields = recorded["fields"]
    ckpt = latest_complete(rd)
    update = 0
    doc: dict[str, Any] | None = None
    if ckpt is not None:
        doc = validate_complete(ckpt, hashes=deep)
        update = int(doc["update"])
    state = _trainer_state(ckpt)
    current = checkpoint_layout(state.get("loop"), fields)
    prepared = prepared_layout(rd, update)
    by_prepare = prepared is not None and prepared.world_size == world_size  # asked for once, by prepare
    reshard = reshard or by_prepare
    new, notes = resolve(
        global_batch=contract_global_batch(fields),
        world_size=world_size,
        micro_batch=cfg.micro_batch,
        grad_accum=cfg.grad_accum,
        original=contract_layout(fields),
        current=current,
        explicit=set(explicit),
        reshard=reshard,
    )
    if (new.micro_batch, new.grad_accum) != (cfg.micro_batch, cfg.grad_accum):
        cfg = cfg.replace(micro_batch=new.micro_batch, grad_accum=new.grad_accum)
    manifest_path = Path(cfg.manifest) if Path(cfg.manifest).is_absolute() else rd.path / cfg.manifest
    # the run's own copy (relative to the run, or the absolute path of it that prepare passes) stays in the run
    own = not Path(cfg.manifest).is_absolute() or manifest_path == rd.manifest_path
    # the run's copy is written under the root it was last re-pointed at (stored), unless this launch names another
    roots = [stored.data_root, cfg.data_root] if own else [cfg.data_root]
    manifest = contract_manifest(
        manifest_path, roots, fields, index=rd.manifest_index_path, root=rd.path if own else None
    )
    contract = build_contract(
        cfg,
        world_size,
        code_dir,
        manifest,
        use_git=not code_from_bundle,
        code_files=code_files,
        known=fields,
        run_dir=rd.path,
    )
    contract = comparable(fields, contract)
    other = _check_math_and_layout(
        rd.contract_path, fields, contract["fields"], current, new, reshard, cfg.strict_code, manifest_path
    )
    # The recorded digest is the run's one identity: prepare, the trainer and the bundle README print it. (A
    # recomputed digest can differ in fields the comparison skips, e.g. the commit of an extracted archive.)
    passed = [f"contract {recorded['sha256']} matches {rd.contract_path}"]
    change = None
    if new != current:
        notes += _per_rank_on_layout_change(ckpt, state)
        change = change_record(current, new, update, "prepare" if by_prepare else asked_by, notes)
        passed.append(f"layout change accepted: {current} -> {new}, global batch {new.global_batch} kept")
    if ckpt is not None and doc is not None:
        checked = "verified" if deep else "listed with their sizes (hashed as they are loaded)"
        passed.append(f"{ckpt.name}: inventory of {len(doc['files'])} files {checked}")
        check_fork_guard(ckpt)
    passed.append(schedule_gate(cfg, update, str(rd.path)))
    return ResumeCheck(
        contract,
        recorded,
        manifest,
        ckpt,
        update,
        runtime_changes(stored, cfg),
        passed,
        config=cfg,
        layout_change=change,
        code_changes=other,
    )


def _check_math_and_layout(
    path: Path,
    recorded: dict[str, Any],
    recomputed: dict[str, Any],
    current: Layout,
    new: Layout,
    reshard: bool,
    strict_code: bool,
    manifest: Path,
) -> list[tuple[str, Any, Any]]:
    """Refuse a change of the math (any contract field but the layout's) or of the code, naming every field; a
    change of the global batch names its product; a layout change only when asked for. Returns the changes of
    the code's tree that are not the code (identity.code_changes)."""
    expected = {**recorded, **{k: v for k, v in current.to_dict().items() if k in recorded}}
    diffs, other = contract_changes(expected, recomputed, strict_code=strict_code)
    if not any(d[0] == "global_batch" for d in diffs):
        diffs = [d for d in diffs if d[0] not in GRAD_ACCUM_MIRRORS]
    math_diffs = [d for d in diffs if d[0] not in LAYOUT_FIELDS + GRAD_ACCUM_MIRRORS]
    if [d[0] for d in math_diffs] == ["global_batch"]:
        raise refuse_global_batch(str(path), contract_global_batch(recorded), current, new, diffs)
    if any(d[0].startswith("data.") for d in math_diffs):
        raise ContractMismatch(
            str(path),
            diffs,
            detail=f"{manifest} lists other samples than the manifest this run was created with",
            hint="restore the run's copy of its manifest (as created, or as prepare rebased it), or start a new "
            "run directory",
        )
    if math_diffs:
        raise ContractMismatch(str(path), diffs)
    if diffs and not reshard:
        raise refuse_unasked(str(path), current, new)
    return other


def _trainer_state(ckpt: Path | None) -> dict[str, Any]:
    """A checkpoint's loop-and-statefuls record (verified by its inventory), or {} without a checkpoint; one that
    cannot be read here is refused when the state is loaded (checkpoint/state/records.py words that)."""
    if ckpt is None:
        return {}
    from torchrelay.checkpoint.state import read_trainer_state  # imports torch: only with a checkpoint

    try:
        doc = read_trainer_state(ckpt)
    except RelayError:
        return {}
    return doc if isinstance(doc.get("loop", {}), dict) else {}


def _per_rank_on_layout_change(ckpt: Path | None, state: dict[str, Any]) -> list[str]:
    """What a checkpoint stored per rank cannot follow its ranks to another layout: statefuls that differed by rank
    (a per-rank generator, a counter) are refused; model and optimizer tensors that differed (buffers no wrapper
    synchronizes) are taken from rank 0, as DDP itself broadcasts them; returns the note saying so."""
    engine = state.get("deepspeed")
    notes = []
    if engine is not None:
        stage = engine.get("zero_stage") if isinstance(engine, dict) else None
        if stage not in (1, 2):
            raise ConfigError(
                f"{ckpt}: holds a DeepSpeed ZeRO stage {stage} engine's checkpoint (its parameters partitioned "
                "over the ranks), which torchrelay does not reshard to another layout",
                hint="keep the world size; ZeRO-1/2 checkpoints are resharded (docs/ELASTIC.md)",
            )
        notes.append(
            f"DeepSpeed ZeRO-{stage} optimizer partitions resharded for the new ranks at load, proven bit for bit "
            "(fp32 masters and both moments gathered)"
        )
    per_rank = state.get("per_rank") or {}
    statefuls = list(per_rank.get("statefuls") or [])
    if statefuls:
        raise ConfigError(
            f"{ckpt}: the tracked state {statefuls} differed between ranks when it was saved, and a layout change "
            "has no rank to give each copy to",
            hint="keep the world size, or derive that randomness per sample (tr.SampleContext) instead of per "
            "rank (docs/ELASTIC.md)",
        )
    tensors = [*(per_rank.get("model") or []), *(per_rank.get("optim") or [])]
    if not tensors:
        return notes
    shown = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
    return [*notes, f"tensors stored per rank ({shown}) taken from rank 0 for every new rank"]


_NONE = type(None)
# REBASE_RECORD.json as `prepare` writes it (handoff/prepare.py): what a resume and a second prepare use of it.
PREPARE_RECORD_SCHEMA = Schema(
    {
        "format": Optional(Field(int, low=1, high=1)),
        "bundle_lineage": Optional(Field((str, _NONE), length=200)),
        "parent_lineage": Optional(Field((str, _NONE), length=200)),
        "checkpoint": Optional(Field((str, _NONE), length=255, path=True)),
        "update": Optional(Field((int, _NONE), low=0, high=1 << 40)),
        "contract_sha256": Optional(Field((str, _NONE), length=128)),
        "time": Optional(Field((str, _NONE), length=64)),
        "changes": Optional(Field((dict, _NONE), size=1 << 20)),
        "layout_change": Optional(Field((dict, _NONE), fields=LAYOUT_CHANGE_SCHEMA)),
        "proofs": Optional(Field([str], items=1024)),
        "numerics": Optional(Field((dict, _NONE), size=256 << 10)),
        "originals": Optional(Field([str], items=16, path=True)),
    }
)


def _prepare_record(path: Path) -> Any:
    """REBASE_RECORD.json read the guarded way, or None without one; a damaged one is refused (ConfigError)."""
    try:
        return read_json(path, what="prepare's record", root=path.parent, schema=PREPARE_RECORD_SCHEMA)
    except FileNotFoundError:
        return None
    except (OSError, RelayError) as exc:  # unreadable, not UTF-8, not JSON, too deep, a link, a pipe
        raise ConfigError(
            f"{path} cannot be read ({str(exc).splitlines()[0]})", hint="restore it from the bundle's prepare"
        ) from None


def prepared_layout(run: RunDir, update: int) -> Layout | None:
    """The layout `prepare --world-size` set for the checkpoint of `update` (REBASE_RECORD.json), or None."""
    path = run.prepare_record_path
    record = _prepare_record(path)
    if record is None:
        return None
    change = record.get("layout_change") if isinstance(record, dict) else None
    if not isinstance(change, dict) or change.get("at_update") != update:
        return None
    to = change.get("to") or {}
    try:
        return Layout(int(to["world_size"]), int(to["micro_batch"]), int(to["grad_accum"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: layout_change.to is malformed ({exc})") from exc


def prepared_keys(run: RunDir) -> list[str]:
    """The runtime fields `prepare` set on this run directory (REBASE_RECORD.json `changes`), dotted."""
    record = _prepare_record(run.prepare_record_path)
    if record is None:
        return []
    changes = record.get("changes") if isinstance(record, dict) else None
    return sorted(changes) if isinstance(changes, dict) else []


def refuse_contract_overrides(stored: RelayConfig, cfg: RelayConfig, overrides: dict[str, Any]) -> None:
    """On a resume, an explicit override (`--set`, `overrides=`, TORCHRELAY_OVERRIDES) may change runtime fields
    only (the layout's split aside: a reshard decides it): refuse one that changes a contract field, in one line
    naming it, before the contract is rebuilt."""
    top = stored.to_dict()
    before, after = flatten(top), flatten(cfg.to_dict())
    for key in overrides:
        dotted = (
            key if key.partition(".")[0] in top else f"params.{key}"
        )  # (`lr` is params.lr: with_overrides)
        for name in sorted(k for k in set(before) | set(after) if k == dotted or k.startswith(dotted + ".")):
            if name in LAYOUT_FIELDS or cfg.is_runtime(name) or stored.is_runtime(name):
                continue
            if before.get(name) != after.get(name):
                raise ConfigError(
                    f"resume refused: override {name}: {before.get(name)!r} -> {after.get(name)!r} changes the "
                    "training contract (not a runtime field)",
                    hint=f"only runtime fields may change on a resume ({', '.join(stored.runtime_keys())}); "
                    "start a new run directory to change the math",
                )


def _overridden(key: str, overrides: dict[str, Any]) -> bool:
    head = key.split(".", 1)[0]
    return key in overrides or head in overrides or key.removeprefix("params.") in overrides


def keep_prepared(
    run: RunDir, stored: RelayConfig, cfg: RelayConfig, overrides: dict[str, Any]
) -> tuple[RelayConfig, list[str]]:
    """The script's configuration with every field that `prepare` set taken from the run's stored config.

    A script passes the configuration it was written with (the old cluster's data root, say) on every launch;
    on a prepared run that would quietly rewind what `prepare` re-pointed. Those fields keep the run's value
    unless this launch overrides them explicitly (`overrides`, TORCHRELAY_OVERRIDES, a script's --set). Returns
    the configuration and one note per field kept.
    """
    keys = prepared_keys(run)
    if not keys:
        return cfg, []
    have, want = flatten(cfg.to_dict()), flatten(stored.to_dict())
    kept = {k: want.get(k) for k in keys if have.get(k) != want.get(k) and not _overridden(k, overrides)}
    if not kept:
        return cfg, []
    notes = [
        f"kept {key}={value!r} set by prepare ({PREPARE_RECORD}); the script's config says {have.get(key)!r} "
        "(to change it, override it: --set / TORCHRELAY_OVERRIDES)"
        for key, value in kept.items()
    ]
    return cfg.with_dotted(kept, source="config"), notes
