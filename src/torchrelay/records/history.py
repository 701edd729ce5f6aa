"""history.jsonl: one record per launch (segment) — who ran which updates, where, and how it ended."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Final

from torchrelay.paths.layout import HISTORY_FILE
from torchrelay.paths.rundir import RunDir
from torchrelay.records.ended import Ended
from torchrelay.records.reshard import LAYOUT_CHANGE_SCHEMA
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.jsonl import read_records
from torchrelay.util.records import Field, Optional, Schema, fit


class _Absent(Enum):
    ABSENT = "absent"  # an Enum member: one object, also after pickling


ABSENT: Final = _Absent.ABSENT


@dataclass(kw_only=True, slots=True)
class Segment:
    """One launch's record in history.jsonl (docs/FORMATS.md); `to_dict()` is exactly what the file holds."""

    segment: str
    parent: str | None
    lineage: str | None
    parent_lineage: str | None
    job: str | None
    command: list[str]
    hosts: list[Any]
    world_size: int
    first_update: int
    last_update: int | None
    resumed_from: int | None
    started: float
    contract_sha256: str | None
    code: dict[str, Any]
    versions: dict[str, Any]
    runtime_changes: dict[str, Any]
    notes: list[str]
    ended: str = Ended.RUNNING
    exit_code: int | None = None
    stopped: float | None = None
    # The job's deadline and which ranks ran on which host; absent in a launch refused while opening and in runs
    # made before the field existed.
    deadline: float | None | _Absent = ABSENT
    ranks_by_host: dict[str, list[int]] | _Absent = ABSENT
    # A move to another layout (reshard.change_record): only in the segment that made it.
    layout_change: dict[str, Any] | _Absent = ABSENT
    # What decides the bits its kernels compute (numerics.gather), and how it differs from the earlier segments'
    # (numerics.compare_with_history, only where it does); absent in runs made before the fields existed.
    numerics: dict[str, Any] | _Absent = ABSENT
    numerics_change: dict[str, Any] | _Absent = ABSENT
    # The tier the resume's checkpoint came from ("memory" or "durable": checkpoint/tiers.py); absent in a segment
    # that resumed nothing and in runs made before the field existed.
    resumed_tier: str | _Absent = ABSENT
    extra: dict[str, Any] = field(default_factory=dict)  # fields another version wrote, kept as they were

    def to_dict(self) -> dict[str, Any]:
        """The record as history.jsonl holds it."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **{k: v for k, v in doc.items() if v is not ABSENT}}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Segment:
        """The record of one history.jsonl line written by this version (ValueError names a missing field)."""
        names = {f.name for f in fields(cls)} - {"extra"}
        optional = {
            "ended",
            "exit_code",
            "stopped",
            "deadline",
            "ranks_by_host",
            "layout_change",
            "numerics",
            "numerics_change",
            "resumed_tier",
        }
        missing = sorted(names - optional - set(doc))
        if missing:
            raise ValueError(f"a segment of {HISTORY_FILE} lacks {missing}")
        return cls(
            **{k: v for k, v in doc.items() if k in names},
            extra={k: v for k, v in doc.items() if k not in names},
        )


_NONE = type(None)
_COUNT = 1 << 40  # updates: more than any run (records/contract.py)
_TIME = Field((float, _NONE), low=0, high=1e12)  # unix seconds
_ID = Field((str, _NONE), length=200)
# The types and bounds of what status, report and a bundle's README show of a segment: each may be absent (a
# record another version wrote), none may be of another type or out of its bounds (a hand edit, a forged bundle):
# util/records.check. The bounds together keep a line far below the reader's LINE_LIMIT, and `write_history`
# fits each segment into them (a value echoed from elsewhere is cut, never written past what this reader takes).
SEGMENT_SCHEMA = Schema({
    name: Optional(rule)
    for name, rule in {
        "segment": _ID, "parent": _ID, "lineage": _ID, "parent_lineage": _ID, "job": _ID,
        "command": Field([str], items=1024), "hosts": Field([str], items=1 << 14, length=255),
        "world_size": Field((int, _NONE), low=1, high=1 << 20), "first_update": Field(int, low=0, high=_COUNT),
        "last_update": Field((int, _NONE), low=0, high=_COUNT),
        "resumed_from": Field((int, _NONE), low=0, high=_COUNT), "started": _TIME,
        "contract_sha256": Field((str, _NONE), length=128), "code": Field((dict, _NONE), size=8 << 20),
        "versions": Field((dict, _NONE), size=64 << 10), "runtime_changes": Field((dict, _NONE), size=1 << 20),
        "notes": Field([str], items=1024), "ended": Field((str, _NONE), length=64),
        "exit_code": Field((int, _NONE), low=-(1 << 16), high=1 << 16), "stopped": _TIME, "deadline": _TIME,
        "ranks_by_host": Field((dict, _NONE), size=8 << 20),
        "layout_change": Field((dict, _NONE), fields=LAYOUT_CHANGE_SCHEMA),
        "numerics": Field((dict, _NONE), size=64 << 10), "numerics_change": Field((dict, _NONE), size=256 << 10),
        "resumed_tier": Field((str, _NONE), length=16),
    }.items()
})  # fmt: skip


def read_history(run_dir: str | os.PathLike[str] | RunDir) -> list[dict[str, Any]]:
    """The segment records of history.jsonl, each checked against SEGMENT_SCHEMA; none when it does not exist
    (see util.jsonl for a torn line)."""
    return read_records(RunDir.of(run_dir).history_path, schema=SEGMENT_SCHEMA)


def write_history(run: RunDir, segments: list[dict[str, Any]]) -> None:
    """Rewrite the whole (small) file atomically, each segment fitted into SEGMENT_SCHEMA's bounds (what
    read_history accepts)."""
    lines = (json.dumps(fit(s, SEGMENT_SCHEMA), sort_keys=True) + "\n" for s in segments)
    atomic_write_text(run.history_path, "".join(lines))


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def close_crashed(segments: list[dict[str, Any]], last_update: int | None) -> list[dict[str, Any]]:
    """A segment still 'running' when the next one starts ended in a crash."""
    for seg in segments:
        if seg.get("ended") == Ended.RUNNING:
            seg["ended"] = Ended.CRASH
            if last_update is not None and seg.get("last_update") is None:
                seg["last_update"] = last_update
    return segments


def upsert(run: RunDir, segment: dict[str, Any]) -> None:
    """Replace the record with the same id, or append it."""
    segments = read_history(run)
    for i, seg in enumerate(segments):
        if seg.get("segment") == segment["segment"]:
            segments[i] = segment
            break
    else:
        segments.append(segment)
    write_history(run, segments)
