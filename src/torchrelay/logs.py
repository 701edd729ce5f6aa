"""Per-rank JSONL logs under train/: metrics and exposures, appended in the loop and trimmed on resume."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import IO, Any

TIMING_KEYS = ("update_time", "time", "samples_per_s")
_RANK_LOG = re.compile(r"^(metrics|exposures)-rank(\d+)\.jsonl$")


def metrics_path(train_dir: Path, rank: int) -> Path:
    return train_dir / f"metrics-rank{rank}.jsonl"


def exposures_path(train_dir: Path, rank: int) -> Path:
    return train_dir / f"exposures-rank{rank}.jsonl"


class RankLog:
    """An append-only JSONL file; one write per line, flushed so a reader sees whole lines."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self, durable: bool = False) -> None:
        self._f.flush()
        if durable:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


def _update_of(line: str) -> int | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    value = rec.get("update", rec.get("u"))
    return int(value) if isinstance(value, int) else None


def trim_after(train_dir: Path, update: int) -> Path | None:
    """Move lines past `update` into train/recovery-history/<when>/ so the live logs read as one run."""
    if not train_dir.is_dir():
        return None
    archive = train_dir / "recovery-history" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved_any = False
    for path in sorted(train_dir.iterdir()):
        if not _RANK_LOG.match(path.name):
            continue
        keep: list[str] = []
        moved: list[str] = []
        with open(path) as f:
            for line in f:
                u = _update_of(line) if line.endswith("\n") else None
                (keep if u is not None and u <= update else moved).append(line)
        if not moved:
            continue
        archive.mkdir(parents=True, exist_ok=True)
        with open(archive / path.name, "a") as f:
            f.writelines(moved)
        tmp = path.with_name(path.name + ".trim")
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        moved_any = True
    return archive if moved_any else None


def trim_copy(src: Path, dst: Path, update: int) -> None:
    """Copy a rank log keeping only lines up to `update` (for bundles)."""
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            u = _update_of(line) if line.endswith("\n") else None
            if u is not None and u <= update:
                fout.write(line)


def rank_logs(train_dir: Path, kind: str) -> dict[int, Path]:
    """{rank: path} of one kind of log ('metrics' or 'exposures')."""
    out = {}
    if train_dir.is_dir():
        for path in train_dir.iterdir():
            m = _RANK_LOG.match(path.name)
            if m and m.group(1) == kind:
                out[int(m.group(2))] = path
    return dict(sorted(out.items()))
