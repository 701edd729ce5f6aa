"""history.jsonl: one record per launch (segment) — who ran which updates, where, and how it ended."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from torchrelay.ended import Ended
from torchrelay.fsutil import atomic_write_text
from torchrelay.layout import HISTORY_FILE
from torchrelay.util.jsonl import read_records


def read_history(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The segment records of history.jsonl; none when it does not exist (see util.jsonl for a torn line)."""
    return read_records(Path(run_dir) / HISTORY_FILE)


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
