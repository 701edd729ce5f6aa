"""The trainer's own resume validation, also run by `prepare` and `launch` before anything starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.handed_off import PACKING, RECLAIM_ENV, guarding_record
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.select import latest_complete
from torchrelay.config import RelayConfig
from torchrelay.contract import (
    build_contract,
    check_contract,
    comparable,
    load_contract,
    runtime_changes,
)
from torchrelay.errors import ConfigError, ForkRefused
from torchrelay.layout import PREPARE_RECORD
from torchrelay.manifest import Manifest
from torchrelay.rundir import RunDir
from torchrelay.util.dotted import flatten


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
    run_dir: str | os.PathLike[str],
    cfg: RelayConfig,
    world_size: int,
    code_dir: str | os.PathLike[str] | None = None,
    *,
    deep: bool = True,
    code_from_bundle: bool = False,
    code_files: list[str] | tuple[str, ...] = (),
) -> ResumeCheck:
    """Recompute the contract and compare, pass the schedule gate, pick and verify the newest checkpoint.

    code_from_bundle: `code_dir` came out of a bundle, so no program (git) is run inside it.
    code_files: the running program's files (identity.running_files), when the trainer itself checks.
    """
    rd = RunDir(run_dir)
    stored = rd.load_config()
    manifest_path = Path(cfg.manifest) if Path(cfg.manifest).is_absolute() else rd.path / cfg.manifest
    manifest = Manifest.load(manifest_path, cfg.data_root, index=rd.manifest_index_path)
    recorded = load_contract(rd.path)
    contract = build_contract(
        cfg,
        world_size,
        code_dir,
        manifest,
        use_git=not code_from_bundle,
        code_files=code_files,
        known=recorded["fields"],
    )
    contract = comparable(recorded["fields"], contract)
    check_contract(rd.path, contract, recorded)
    # The recorded digest is the run's one identity: prepare, the trainer and the bundle README print it. (A
    # recomputed digest can differ in fields the comparison skips, e.g. the commit of an extracted archive.)
    passed = [f"contract {recorded['sha256']} matches {rd.contract_path}"]
    ckpt = latest_complete(rd.path)
    update = 0
    if ckpt is not None:
        doc = validate_complete(ckpt, hashes=deep)
        update = int(doc["update"])
        checked = "verified" if deep else "listed with their sizes (hashed as they are loaded)"
        passed.append(f"{ckpt.name}: inventory of {len(doc['files'])} files {checked}")
        check_fork_guard(ckpt)
    passed.append(schedule_gate(cfg, update, str(rd.path)))
    return ResumeCheck(contract, recorded, manifest, ckpt, update, runtime_changes(stored, cfg), passed)


def prepared_keys(run_dir: str | os.PathLike[str]) -> list[str]:
    """The runtime fields `prepare` set on this run directory (REBASE_RECORD.json `changes`), dotted."""
    path = Path(run_dir) / PREPARE_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path} cannot be read ({exc})", hint="restore it from the bundle's prepare"
        ) from exc
    changes = record.get("changes") if isinstance(record, dict) else None
    return sorted(changes) if isinstance(changes, dict) else []


def _overridden(key: str, overrides: dict[str, Any]) -> bool:
    head = key.split(".", 1)[0]
    return key in overrides or head in overrides or key.removeprefix("params.") in overrides


def keep_prepared(
    run_dir: str | os.PathLike[str], stored: RelayConfig, cfg: RelayConfig, overrides: dict[str, Any]
) -> tuple[RelayConfig, list[str]]:
    """The script's configuration with every field that `prepare` set taken from the run's stored config.

    A script passes the configuration it was written with (the old cluster's data root, say) on every launch;
    on a prepared run that would quietly rewind what `prepare` re-pointed. Those fields keep the run's value
    unless this launch overrides them explicitly (`overrides`, TORCHRELAY_OVERRIDES, a script's --set). Returns
    the configuration and one note per field kept.
    """
    keys = prepared_keys(run_dir)
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
