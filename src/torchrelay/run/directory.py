"""Rank 0's part of opening a segment, under the run's writer lock: create a new run directory, or reopen one (the
contract checked, stale cleanup, crash repair, log trim, lineage and reclaim). Either way the outcome is a `Start`,
which the opener (opening.py) turns into the segment's record and sends to every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.commit import clean_stale
from torchrelay.checkpoint.handed_off import HANDED_OFF, RECLAIMED_PREFIX
from torchrelay.checkpoint.replica import replica_dir
from torchrelay.checkpoint.replica_resume import choose as choose_nodes
from torchrelay.checkpoint.resume_check import (
    keep_prepared,
    refuse_contract_overrides,
    schedule_gate,
    validate_resume,
)
from torchrelay.checkpoint.tiers import DURABLE, MEMORY, Binding, choose_memory, memory_root, missing_note
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.errors import ConfigError
from torchrelay.identity import running_files, tree_note
from torchrelay.identity.numerics import check_resume
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.paths.layout import LINEAGE_FILE, MANIFEST_REL, checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import build_contract, write_contract
from torchrelay.records.history import close_crashed, new_id, read_history, write_history
from torchrelay.records.reshard import Layout
from torchrelay.records.train import metrics_path, refuse_linked_logs, trim_after
from torchrelay.run.saver import last_save_seconds
from torchrelay.storage.durable import restore as restore_durable
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.jsonl import iter_records
from torchrelay.util.records import Schema, read_json, read_json_or_none
from torchrelay.util.safepath import open_writable, refuse_link


@dataclass(slots=True)
class Start:
    """Where the segment starts, as rank 0 settled it in the run directory (before the segment is recorded)."""

    config: RelayConfig
    contract_sha: str
    code_fields: dict[str, Any]  # the contract's fields, of which the segment records the code's
    manifest: Manifest  # rank 0's, indexed: the other ranks read only its index
    update: int = 0  # the update the checkpoint holds (0: a new run)
    checkpoint: Path | None = None  # the checkpoint to resume from
    runtime_changes: dict[str, list[Any]] = field(default_factory=dict)
    last_save_s: float | None = None  # how long that checkpoint took to save
    parent: str | None = None  # the segment this one continues
    notes: list[str] = field(default_factory=list)
    layout_change: dict[str, Any] | None = None
    numerics_change: dict[str, Any] | None = None
    gate: str = ""  # the line that says which resume gate passed
    tier: str | None = None  # the tier the checkpoint came from (checkpoint/tiers.py); None: a new run
    plan: list[int] | None = (
        None  # several nodes: the node holding each node's memory part (checkpoint/replica_resume.py)
    )


def create_run(
    rd: RunDir, config: RelayConfig, overrides: dict[str, Any], *, world_size: int, code_dir: Path | None
) -> Start:
    """A new run: everything that can refuse (the manifest, the code identity) is checked before anything is
    written, the contract last (from then on the directory holds a run)."""
    cfg = config.with_overrides(overrides) if overrides else config
    # A stop request may be written before the first launch (audits stop at chosen updates), a controller may have
    # recorded its attempts there, and a creation killed before it wrote the contract leaves files that this
    # creation overwrites.
    leftovers = rd.unexplained_entries()[:5]
    if leftovers:
        raise ConfigError(
            f"{rd.path} is not empty ({leftovers}) and holds no torchrelay run",
            hint="choose an empty or new run directory",
        )
    # an empty train/ passes as a killed creation's leftover, not one linked elsewhere
    refuse_linked_logs(rd.train_dir)
    source_manifest = cfg.manifest
    manifest = Manifest.load(source_manifest, cfg.data_root)
    cfg = cfg.replace(manifest=MANIFEST_REL)
    contract = build_contract(
        cfg, world_size, code_dir, manifest, code_files=running_files(code_dir), run_dir=rd.path
    )
    # a killed creation's data/ is written into again: a link there (or at the copy's name) would have the copy
    # replace whatever it points to, outside the run
    refuse_link(rd.data_dir, what="the run's data folder")
    rd.data_dir.mkdir(parents=True, exist_ok=True)
    rd.train_dir.mkdir(exist_ok=True)
    rd.remove_stale_temps()
    copy_manifest(source_manifest, rd.path / MANIFEST_REL)
    manifest.save_index(rd.manifest_index_path)
    # The source's arrays go before the copy's are read (10 M samples: 240 MB each).
    source_sha = manifest.sha256()
    del manifest
    copy = Manifest.load(  # the run's copy, found by its index
        rd.path / MANIFEST_REL, cfg.data_root, index=rd.manifest_index_path, sha256=source_sha
    )
    atomic_write_text(rd.config_path, json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    atomic_write_text(rd.path / LINEAGE_FILE, json.dumps({"lineage": new_id(), "parent_lineage": None}))
    write_contract(rd, contract)  # last: from here on the directory holds a run
    return Start(
        config=cfg,
        contract_sha=contract["sha256"],
        code_fields=contract["fields"],
        manifest=copy,
        gate=schedule_gate(cfg, 0, str(rd.path)),
    )


def _is_own_copy(rd: RunDir, manifest: Manifest) -> bool:
    """Whether the manifest read is the run's own copy (not one a launch named), which the run may rewrite."""
    try:
        return os.path.samefile(manifest.path, rd.manifest_path)
    except OSError:
        return False


def copy_manifest(source: str | os.PathLike[str], dest: Path) -> None:
    """Copy the manifest `source` to the run's `dest`, replacing a killed creation's copy; never through a link."""
    with (
        open(source, "rb") as src,
        os.fdopen(open_writable(dest, what="the run's copy of its manifest"), "wb") as out,
    ):
        if os.path.samestat(os.fstat(src.fileno()), os.fstat(out.fileno())):
            return  # the killed creation's copy named as the source: it is the copy already
        out.truncate(0)
        shutil.copyfileobj(src, out, 1 << 20)


def reopen_run(
    rd: RunDir,
    config: RelayConfig | None,
    overrides: dict[str, Any],
    *,
    world_size: int,
    code_dir: Path | None,
    reshard: bool,
    numerics: dict[str, Any],
    asked_by: str = "reshard",
    holdings: list[dict[str, Any]] | None = None,
) -> Start:
    """A run that exists: its contract rebuilt and compared (only runtime fields may change), the checkpoint to
    resume chosen, and the directory repaired where a crash left it (temporaries, an unclosed segment, logs past
    that checkpoint); `config` None continues with the recorded configuration."""
    refuse_linked_logs(rd.train_dir)  # before anything is written: the logs are appended to and trimmed below
    stored = stored_config(rd)
    check_lineage(rd)
    cfg = config if config is not None else stored
    kept: list[str] = []
    if config is not None and cfg.manifest != stored.manifest:
        cfg = cfg.replace(manifest=stored.manifest)  # the run's own copy, unless overridden below
    if config is not None:
        cfg, kept = keep_prepared(rd, stored, cfg, overrides)  # prepare's fields win
        for note in kept:
            logger.warning(f"[torchrelay] warning: {note}")
    cfg = cfg.with_overrides(overrides) if overrides else cfg
    refuse_contract_overrides(stored, cfg, overrides)
    clean_stale(rd.path)  # our own leftovers (a killed save or pack) are removed, never refused
    # TORCHRELAY_DURABLE: the store's newest committed checkpoint, downloaded verified when this directory lacks it
    restored = restore_durable(rd)
    if restored:
        logger.info(f"[torchrelay] {restored}")
    # The script and the modules it imported from the code directory, tracked by git or not.
    # Names and sizes only here: every rank hashes the files it loads as it reads them (run.track), so no
    # rank waits while this one reads the whole checkpoint
    check = validate_resume(
        rd,
        cfg,
        world_size,
        code_dir,
        code_files=running_files(code_dir),
        deep=False,
        reshard=reshard,
        explicit=set(overrides),
        asked_by=asked_by,
    )
    assert check.config is not None
    cfg = check.config  # with the layout this launch runs with
    code_note = tree_note(check.code_changes, commit=check.recorded["fields"].get("code.commit") is not None)
    if code_note:
        logger.warning(f"[torchrelay] warning: {code_note}")
    rd.remove_stale_temps()
    history = read_history(rd)
    last_logged = max((int(r["update"]) for r in iter_records(metrics_path(rd.train_dir, 0))), default=None)
    tier = _newest_across_tiers(rd, cfg, check, world_size, history, holdings, last_logged)
    update, ckpt = tier.update, tier.checkpoint
    numerics_change = None
    if ckpt is not None and update < cfg.total_updates:  # refused before any write
        numerics_change = check_resume(history, numerics, upto=update, strict=cfg.strict_numerics)
    write_history(rd, close_crashed(history, last_logged))
    archived = trim_after(rd.train_dir, update)
    manifest, repointed = check.manifest, None
    if not manifest.written_under(cfg.data_root) and _is_own_copy(rd, manifest):
        # data_root is a runtime field: the run's copy is re-pointed at this launch's root, as `prepare` does,
        # its fingerprint proven unchanged, and its index saved before config.json names the root (a kill in
        # between leaves a copy whose root the next launch finds: contract.contract_manifest)
        old_root = manifest.data_root
        manifest = manifest.rebase_into(rd.manifest_path, cfg.data_root, index=rd.manifest_index_path)
        repointed = (
            f"{MANIFEST_REL} re-pointed from data_root {old_root!r} to {cfg.data_root!r}, "
            f"fingerprint unchanged ({manifest.fingerprint()})"
        )
        logger.info(f"[torchrelay] {repointed}")
    layout_change = check.layout_change
    split = (cfg.micro_batch, cfg.grad_accum)
    if check.runtime_changes or split != (stored.micro_batch, stored.grad_accum):
        atomic_write_text(rd.config_path, json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    if not manifest.index_current:  # the next launch, and the other ranks now, read no line
        manifest.save_index(rd.manifest_index_path)
    reclaim_note = _reclaim(rd, ckpt) if ckpt is not None and tier.tier == DURABLE else None
    notes = [f"trimmed logs past update {update} into {archived.relative_to(rd.path)}"] if archived else []
    notes += tier.notes
    if restored:
        notes.append(restored)
    if reclaim_note:
        notes.append(reclaim_note)
    if repointed:
        notes.append(repointed)
    if code_note:
        notes.append(code_note)
    if numerics_change:
        notes.append(numerics_change["line"])
    notes += kept
    if layout_change:
        notes += layout_change["notes"]
        logger.info(
            f"[torchrelay] layout change at update {update}: {Layout(**layout_change['from'])} -> "
            f"{Layout(**layout_change['to'])}, global batch {layout_change['global_batch']} kept; "
            f"per-rank random streams {layout_change['rng']}"
        )
    return Start(
        config=cfg,
        contract_sha=check.recorded["sha256"],  # the run's one digest (see resume_check.validate_resume)
        code_fields=check.recorded["fields"],
        manifest=manifest,
        update=update,
        checkpoint=ckpt,
        runtime_changes=check.runtime_changes,
        last_save_s=last_save_seconds(ckpt),
        parent=last_segment(history),
        notes=notes,
        layout_change=layout_change,
        numerics_change=numerics_change,
        gate=check.passed[-1] if tier.tier == DURABLE else f"resuming from the {tier.tier} tier: {ckpt}",
        tier=tier.tier if ckpt is not None else None,
        plan=tier.plan,
    )


@dataclass(frozen=True, slots=True)
class _Tiered:
    checkpoint: Path | None
    update: int
    tier: str
    notes: list[str]  # the refused candidates, and the parts taken from a replica
    plan: list[int] | None = None


def _newest_across_tiers(
    run: RunDir,
    cfg: RelayConfig,
    check: Any,
    world_size: int,
    history: list[dict[str, Any]],
    holdings: list[dict[str, Any]] | None = None,
    reached: int | None = None,
) -> _Tiered:
    """The checkpoint a resume takes: this node's newest verified memory checkpoint when it is newer than the
    durable tier's (checkpoint/tiers.py), else the durable one; each refused candidate in one line, logged, and
    so is a memory tier found empty though the run `reached` past the durable checkpoint an update it saves at."""
    lineage = read_lineage(run).get("lineage")
    if lineage is None or check.layout_change:  # a layout change resumes from the durable tier, as before
        return _Tiered(check.checkpoint, check.update, DURABLE, [])
    tier = _memory_or_durable(run, lineage, cfg, check, world_size, history, holdings)
    missing = None
    if tier.tier == DURABLE and not tier.notes:
        # the memory_every the run saved with, before a change this launch makes to it (a runtime field)
        every = int(check.runtime_changes.get("memory_every", [cfg.memory_every])[0] or 0)
        missing = missing_note(memory_root(lineage, run), every, check.update, reached)
    if missing is None:
        return tier
    logger.warning(f"[torchrelay] {missing}")
    return _Tiered(tier.checkpoint, tier.update, DURABLE, [missing])


def _memory_or_durable(
    run: RunDir,
    lineage: str,
    cfg: RelayConfig,
    check: Any,
    world_size: int,
    history: list[dict[str, Any]],
    holdings: list[dict[str, Any]] | None,
) -> _Tiered:
    run_dir = run.path
    binding = Binding(
        lineage=lineage,
        run_dir=str(run_dir),
        contract_sha256=check.recorded["sha256"],
        world_size=world_size,
        micro_batch=cfg.micro_batch,
        grad_accum=cfg.grad_accum,
    )
    segments = {str(s.get("segment")) for s in history}
    if holdings is not None:  # several nodes: each node's part, own or the partner's replica
        return _across_nodes(run, lineage, holdings, binding, check, segments)
    choice = choose_memory(memory_root(lineage, run), binding, check.update, segments)
    for line in choice.refused:
        logger.warning(f"[torchrelay] {line}; the next tier is used")
    if choice.checkpoint is None:
        return _Tiered(check.checkpoint, check.update, DURABLE, choice.refused)
    logger.info(f"[torchrelay] resuming from the memory tier: {choice.checkpoint} (update {choice.update})")
    return _Tiered(choice.checkpoint, choice.update, MEMORY, choice.refused)


def _across_nodes(
    run: RunDir,
    lineage: str,
    holdings: list[dict[str, Any]],
    binding: Binding,
    check: Any,
    segments: set[str],
) -> _Tiered:
    picked = choose_nodes(holdings, binding, check.update, segments)
    for line in picked.refused:
        logger.warning(f"[torchrelay] {line}; the next tier is used")
    if picked.update is None:
        return _Tiered(check.checkpoint, check.update, DURABLE, picked.refused)
    where = memory_root(lineage, run)  # rank 0's node: its part (or a replica) names the save's seconds
    held = where if picked.plan[0] == 0 else replica_dir(where, 0)
    logger.info(
        f"[torchrelay] resuming from the {picked.tier} tier: update {picked.update}, parts {picked.plan}"
    )
    notes = [*picked.refused, *picked.from_replicas]
    return _Tiered(held / checkpoint_name(picked.update), picked.update, picked.tier, notes, picked.plan)


def last_segment(history: list[dict[str, Any]]) -> str | None:
    """The segment a new one continues: the last that ran (a refused launch continued nothing)."""
    return next((s.get("segment") for s in reversed(history) if s.get("ended") != "refused"), None)


def _reclaim(run: RunDir, ckpt: Path) -> str | None:
    """Continuing a handed-off checkpoint on purpose (TORCHRELAY_RECLAIM=1) starts a new lineage, on record."""
    marker = ckpt / HANDED_OFF
    if not marker.exists():
        return None
    handed = read_json_or_none(marker, what="the hand-off record", root=ckpt)
    handed = handed if isinstance(handed, dict) else {}
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    os.replace(marker, ckpt / f"{RECLAIMED_PREFIX}{stamp}.json")
    old = read_lineage(run)
    new = {"lineage": new_id(), "parent_lineage": old.get("lineage")}
    atomic_write_text(run.lineage_path, json.dumps(new))
    return (
        f"reclaimed {ckpt.name}, handed off to bundle lineage {handed.get('lineage', '?')}: "
        f"new lineage {new['lineage']} (parent {old.get('lineage')})"
    )


_LINEAGE = Schema({"lineage": str, "parent_lineage": (str, type(None))})


def check_lineage(run: RunDir) -> None:
    """lineage.json, where it is, as `create_run` writes it (a RecordError naming the file and field, exit 2): a
    forged one was written into every segment of history.jsonl, which then refused every later open."""
    path = run.lineage_path
    if os.path.lexists(path):  # a run made before lineages has none
        read_json(path, what="the run's lineage", root=run.path, schema=_LINEAGE)


def read_lineage(run: RunDir) -> dict[str, Any]:
    """lineage.json's lineage and parent_lineage, each only where it is a string; none when unreadable, not JSON
    or not an object (a refused launch is recorded all the same; `check_lineage` refuses such a file)."""
    lineage = read_json_or_none(run.lineage_path, what="the run's lineage", root=run.path)
    if not isinstance(lineage, dict):
        return {}
    return {k: v for k, v in lineage.items() if k in _LINEAGE and isinstance(v, str)}
