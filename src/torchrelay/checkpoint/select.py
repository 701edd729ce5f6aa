"""Which checkpoints a run has, and the newest complete one (the only one a resume may choose)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchrelay.checkpoint.handed_off import HANDED_OFF
from torchrelay.checkpoint.inventory import INVENTORY, read_inventory
from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.layout import parse_checkpoint_name


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    update: int
    path: Path
    complete: bool
    reason: str  # why it is not complete, or "" when it is
    size: int = 0
    handed_off: bool = False


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every `checkpoint-N/`, oldest first, with whether its inventory is present and readable."""
    root = Path(run_dir)
    out: list[CheckpointInfo] = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        update = parse_checkpoint_name(child.name)
        if update is None or not child.is_dir():
            continue
        try:
            doc = read_inventory(child)
            ok = doc.get("update") == update
            reason = "" if ok else f"{INVENTORY} names update {doc.get('update')}"
            size = sum(int(f.get("size", 0)) for f in doc["files"]) if ok else 0
        except (IntegrityError, UnsafeInput) as exc:  # damaged, or no regular file: never chosen
            ok, reason, size = False, exc.message, 0
        except OSError as exc:  # a folder or an unreadable file where COMPLETE.json belongs
            ok, reason, size = False, f"{child / INVENTORY}: {exc.strerror or exc}", 0
        out.append(CheckpointInfo(update, child, ok, reason, size, (child / HANDED_OFF).exists()))
    return sorted(out, key=lambda c: c.update)


def latest_complete(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint with a valid inventory; one without is never chosen."""
    complete = [c for c in list_checkpoints(run_dir) if c.complete]
    return complete[-1].path if complete else None
