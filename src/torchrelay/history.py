"""history.jsonl: one record per launch (segment) — who ran which updates, where, and how it ended."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from torchrelay.errors import IntegrityError
from torchrelay.fsutil import atomic_write_text

HISTORY_FILE = "history.jsonl"


def read_history(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / HISTORY_FILE
    if not path.exists():
        return []
    out = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise IntegrityError(
            f"{path} is not UTF-8 text ({exc})", hint="restore history.jsonl from a copy"
        ) from exc
    for line in text.splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line cannot be a finished record
            if isinstance(record, dict):
                out.append(record)
    return out


def write_history(run_dir: Path, segments: list[dict[str, Any]]) -> None:
    """Rewrite the whole (small) file atomically."""
    atomic_write_text(run_dir / HISTORY_FILE, "".join(json.dumps(s, sort_keys=True) + "\n" for s in segments))


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def close_crashed(segments: list[dict[str, Any]], last_update: int | None) -> list[dict[str, Any]]:
    """A segment still 'running' when the next one starts ended in a crash."""
    for seg in segments:
        if seg.get("ended") == "running":
            seg["ended"] = "crash"
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
