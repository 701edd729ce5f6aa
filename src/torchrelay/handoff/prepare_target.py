"""The run directory prepare lays out: refused where it is unrelated or another bundle's, the record of an earlier
prepare read, a killed prepare's temporaries removed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.resume_check import PREPARE_RECORD_SCHEMA
from torchrelay.errors import ConfigError
from torchrelay.paths.rundir import RunDir, read_record
from torchrelay.util.records import check


def _remove_stale_temporaries(parent: Path, prefix: str) -> None:
    """A prepare killed mid-way leaves only its temporary sibling; the next one removes it."""
    if parent.is_dir():
        for child in parent.iterdir():
            if child.name.startswith(prefix) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)


def _refuse_unrelated(run: RunDir) -> None:
    """Refuse at once a non-empty directory that no prepare wrote (the bundle's lineage is compared later)."""
    run_dir = run.path
    if run_dir.is_dir() and any(run_dir.iterdir()) and not run.prepare_record_path.is_file():
        shown = sorted(p.name for p in run_dir.iterdir())[:5]
        raise ConfigError(
            f"{run_dir} is not empty ({shown}) and was not prepared from a bundle",
            hint="choose a new or empty --run-dir; prepare never writes into an unrelated directory",
        )


def _existing_state(run: RunDir, info: dict[str, Any]) -> dict[str, Any] | None:
    """None for a new or empty run dir; the record if it was prepared from this bundle; refuse otherwise."""
    run_dir = run.path
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} exists and is not a directory", hint="choose another --run-dir")
    if not any(run_dir.iterdir()):
        return None
    record_path = run.prepare_record_path
    if record_path.is_file():
        record = check(
            read_record(record_path, "the rebase record"),
            PREPARE_RECORD_SCHEMA,
            source=f"{record_path} (the rebase record)",
        )
        if record.get("bundle_lineage") == info.get("lineage"):
            return record
        raise ConfigError(
            f"{run_dir} was prepared from another bundle (lineage {record.get('bundle_lineage')}, "
            f"this bundle is {info.get('lineage')})",
            hint="choose a new --run-dir",
        )
    shown = sorted(p.name for p in run_dir.iterdir())[:5]
    raise ConfigError(
        f"{run_dir} is not empty ({shown}) and was not prepared from this bundle",
        hint="choose a new or empty --run-dir; prepare never writes into an unrelated directory",
    )
