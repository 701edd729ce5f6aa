"""history.jsonl: one record per launch (segment) — who ran which updates, where, and how it ended."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Final

from torchrelay.ended import Ended
from torchrelay.layout import HISTORY_FILE
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.jsonl import read_records
from torchrelay.util.records import Optional, Schema


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
# The types of what status, report and a bundle's README show of a segment: each may be absent (a record another
# version wrote), none may be of another type (a hand edit, a forged bundle): util/records.check.
SEGMENT_SCHEMA = Schema({
    name: Optional(rule)
    for name, rule in {
        "segment": (str, _NONE), "parent": (str, _NONE), "lineage": (str, _NONE), "parent_lineage": (str, _NONE),
        "job": (str, _NONE), "command": [str], "hosts": [str], "world_size": (int, _NONE), "first_update": int,
        "last_update": (int, _NONE), "resumed_from": (int, _NONE), "started": (float, _NONE),
        "contract_sha256": (str, _NONE), "code": (dict, _NONE), "versions": (dict, _NONE),
        "runtime_changes": (dict, _NONE), "notes": [str], "ended": (str, _NONE), "exit_code": (int, _NONE),
        "stopped": (float, _NONE), "deadline": (float, _NONE), "ranks_by_host": (dict, _NONE),
        "layout_change": (dict, _NONE), "numerics": (dict, _NONE), "numerics_change": (dict, _NONE),
        "resumed_tier": (str, _NONE),
    }.items()
})  # fmt: skip


def read_history(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The segment records of history.jsonl, each checked against SEGMENT_SCHEMA; none when it does not exist
    (see util.jsonl for a torn line)."""
    return read_records(Path(run_dir) / HISTORY_FILE, schema=SEGMENT_SCHEMA)


def write_history(run_dir: Path, segments: list[dict[str, Any]]) -> None:
    """Rewrite the whole (small) file atomically."""
    atomic_write_text(run_dir / HISTORY_FILE, "".join(json.dumps(s, sort_keys=True) + "\n" for s in segments))


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


def upsert(run_dir: Path, segment: dict[str, Any]) -> None:
    """Replace the record with the same id, or append it."""
    segments = read_history(run_dir)
    for i, seg in enumerate(segments):
        if seg.get("segment") == segment["segment"]:
            segments[i] = segment
            break
    else:
        segments.append(segment)
    write_history(run_dir, segments)
