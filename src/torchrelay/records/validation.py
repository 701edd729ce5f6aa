"""validation/ of a run directory: each checkpoint's validation record and what the last pass left to do.

The records only (layer of the run's files): the status summary, the report and `pack` read them without the
validation runner (controller/validation.py), which writes them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError, RecordError
from torchrelay.paths.layout import parse_checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.durable import remove_temps, temp_prefix
from torchrelay.util.records import Field, Optional, Schema, check, read_json
from torchrelay.util.safepath import is_inside

RECORD = "record.json"
METRICS = "metrics.json"
LOG = "output.log"
PENDING = "pending.json"
RECORD_FORMAT = 1
DONE = ("ok", "failed")  # an interrupted validation is still to do
KEPT = "kept"
RECORD_LIMIT = (
    16 << 20
)  # a record holds a command line and a few metrics  # the selection "every complete checkpoint the run keeps"


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
    def from_dict(cls, data: dict[str, Any], *, source: str = RECORD) -> ValidationRecord:
        """The record of a record.json, every field checked against RECORD_SCHEMA (a RecordError names it)."""
        check(data, RECORD_SCHEMA, source=source)
        if not isinstance(data.get("code", {}), dict):
            raise RecordError(source, "not an object", field="code")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def done(self) -> bool:
        return self.status in DONE


_NONE = type(None)
_TIME = Optional(Field(float, low=0, high=1e12))  # unix seconds
METRICS_LIMIT = 1 << 20  # bytes of JSON of a command's metrics: a page of numbers, far below RECORD_LIMIT
# The fields status, report and pack read of a record, with their types and bounds (the rest are shown as they
# are). `_finish` (controller/validation.py) fits what it writes into them: a command line or a reason echoed from elsewhere
# is cut, never written past what this reader takes.
RECORD_SCHEMA = Schema({
    "update": Field(int, low=0, high=1 << 40),
    "checkpoint": Field(str, length=255, path=True),
    "command": Field(str, length=1 << 16),
    "status": Field(str, length=64),
    "reason": Optional(Field(str, length=1 << 16)),
    "exit_code": Optional(Field((int, _NONE), low=-(1 << 16), high=1 << 16)),
    "metrics": Optional(Field((dict, _NONE), size=METRICS_LIMIT)),
    "started": _TIME,
    "ended": _TIME,
    "seconds": Optional(Field(float, low=-1e12, high=1e12)),  # (a wall clock may step back)
    "attempt": Optional(Field(int, low=0, high=1 << 20)),
    "host": Optional(Field(str, length=255)),
    "cwd": Optional(Field(str)),
    "code": Optional(Field(dict, size=1 << 20)),
    "inventory_sha256": Optional(Field(str, length=128)),
    "contract_sha256": Optional(Field((str, _NONE), length=128)),
    "format": Optional(Field(int, low=0, high=1 << 20)),
})  # fmt: skip


PENDING_SCHEMA = {"left": Optional(dict), "missing": Optional(dict), "command": Optional(str)}


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


def read_records(run: RunDir) -> dict[int, ValidationRecord]:
    """Every recorded validation, by update. A folder without a record holds none (a validation killed mid-way:
    the record is written atomically, last); a record that is there but unreadable, or not a record, is damage:
    one RecordError naming the file and the field."""
    root = run.validation_dir
    out: dict[int, ValidationRecord] = {}
    if not root.is_dir():
        return out
    for child in root.iterdir():
        if parse_checkpoint_name(child.name) is None:
            continue
        path = child / RECORD
        if not os.path.lexists(path):
            continue
        data = read_json(path, what="a validation record", root=run.path, limit=RECORD_LIMIT)
        record = ValidationRecord.from_dict(data, source=str(path))
        if record.update != parse_checkpoint_name(child.name):
            raise RecordError(str(path), f"says update {record.update}, in {child.name}", field="update",
                              hint=f"remove {child} to validate that checkpoint again")  # fmt: skip
        out[record.update] = record
    return dict(sorted(out.items()))


def remove_stale_temps(rd: RunDir) -> list[Path]:
    """Remove what a validation pass killed mid-write left: the temporaries of `pending.json` and of each
    checkpoint's `record.json` (hold the run's lock: no other pass is writing them)."""
    run = rd.path
    root = rd.validation_dir
    if not root.is_dir() or not is_inside(run, root):  # the folders the pass writes in, and no other
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(temp_prefix(PENDING)):
            found.append(child)
        elif parse_checkpoint_name(child.name) is not None and child.is_dir() and is_inside(run, child):
            found += [p for p in child.iterdir() if p.name.startswith(temp_prefix(RECORD))]
    return remove_temps(found)


def read_pending(run: RunDir) -> dict[str, Any] | None:
    """What the last validation pass left to do (`pending.json`), or None without one."""
    path = run.validation_dir / PENDING
    if not os.path.lexists(path):
        return None
    return read_json(
        path, what="what validation left to do", root=run.path, limit=RECORD_LIMIT, schema=PENDING_SCHEMA
    )
