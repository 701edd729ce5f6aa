"""validation/ of a run directory: each checkpoint's validation record and what the last pass left to do.

The records only (layer of the run's files): the status summary, the report and `pack` read them without the
validation runner (validation.py), which writes them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError

VALIDATION_DIR = "validation"
RECORD = "record.json"
METRICS = "metrics.json"
LOG = "output.log"
PENDING = "pending.json"
RECORD_FORMAT = 1
DONE = ("ok", "failed")  # an interrupted validation is still to do
KEPT = "kept"  # the selection "every complete checkpoint the run keeps"


@dataclass(kw_only=True, slots=True)
class ValidationRecord:
    """What one validation of one checkpoint did: `record.json`."""

    update: int
    checkpoint: str
    command: str
    status: str  # ok | failed | interrupted
    reason: str = ""  # why it failed or was interrupted
    exit_code: int | None = None
    metrics: dict[str, Any] | None = None
    started: float = 0.0
    ended: float = 0.0
    seconds: float = 0.0
    attempt: int = 1
    host: str = ""
    cwd: str = ""
    code: dict[str, Any] = field(default_factory=dict)
    inventory_sha256: str = ""  # of the checkpoint's COMPLETE.json: exactly which bytes were validated
    contract_sha256: str | None = None
    format: int = RECORD_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationRecord:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def done(self) -> bool:
        return self.status in DONE


def parse_updates(value: Any, source: str = "validate.updates") -> list[int] | None:
    """'kept' (or None) -> None; [10, 20] or '10,20' -> [10, 20]."""
    if value is None or value == KEPT:
        return None
    if isinstance(value, str):
        try:
            value = [int(x) for x in value.replace(" ", "").split(",") if x]
        except ValueError as exc:
            raise ConfigError(
                f"{source}: {value!r} is neither 'kept' nor a list of updates like 10,20"
            ) from exc
    if not isinstance(value, list) or not value or not all(isinstance(u, int) and u >= 1 for u in value):
        raise ConfigError(f"{source}: must be 'kept' or a non-empty list of updates >= 1, got {value!r}")
    return sorted(set(value))


def folder(run_dir: str | os.PathLike[str], update: int) -> Path:
    return Path(run_dir) / VALIDATION_DIR / f"checkpoint-{update}"


def read_records(run_dir: str | os.PathLike[str]) -> dict[int, ValidationRecord]:
    """Every recorded validation, by update; a folder without a readable record holds none (killed mid-way)."""
    root = Path(run_dir) / VALIDATION_DIR
    out: dict[int, ValidationRecord] = {}
    if not root.is_dir():
        return out
    for child in root.iterdir():
        if not child.name.startswith("checkpoint-") or not child.name[11:].isdigit():
            continue
        try:
            data = json.loads((child / RECORD).read_text())
            record = ValidationRecord.from_dict(data)
        except (OSError, ValueError, TypeError):
            continue
        out[record.update] = record
    return dict(sorted(out.items()))


def read_pending(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What the last validation pass left to do (`pending.json`), or None."""
    try:
        data = json.loads((Path(run_dir) / VALIDATION_DIR / PENDING).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
