"""Which checkpoints a run has, and the newest complete one (the only one a resume may choose)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchrelay.checkpoint.handed_off import HANDED_OFF
from torchrelay.checkpoint.inventory import INVENTORY, read_inventory
from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.paths.layout import parse_checkpoint_name
from torchrelay.paths.rundir import RunDir


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    update: int
    path: Path
    complete: bool
    reason: str  # why it is not complete, or "" when it is
    size: int = 0
    handed_off: bool = False
    # Its inventory is there but unreadable, of another update or not what write_inventory writes: tampering or
    # corruption, never an interrupted save (which writes COMPLETE.json last, or not at all).
    damaged: bool = False
    saved_now: str = ""  # why step.save_now asked for it (its inventory's `saved_now`): retention keeps it


def list_checkpoints(run_dir: str | os.PathLike[str] | RunDir) -> list[CheckpointInfo]:
    """Every `checkpoint-N/`, oldest first, with whether its inventory is present and readable."""
    root = RunDir.of(run_dir).path
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
            asked = doc.get("saved_now") if ok else None
            saved_now = asked[:200] if isinstance(asked, str) else ""
        except (IntegrityError, UnsafeInput) as exc:  # damaged, or no regular file: never chosen
            ok, reason, size, saved_now = False, exc.message, 0, ""
        except OSError as exc:  # a folder or an unreadable file where COMPLETE.json belongs
            ok, reason, size, saved_now = False, f"{child / INVENTORY}: {exc.strerror or exc}", 0, ""
        damaged = not ok and os.path.lexists(child / INVENTORY)
        handed_off = (child / HANDED_OFF).exists()
        out.append(CheckpointInfo(update, child, ok, reason, size, handed_off, damaged, saved_now))
    return sorted(out, key=lambda c: c.update)


def latest_complete(run_dir: str | os.PathLike[str] | RunDir) -> Path | None:
    """The newest checkpoint with a valid inventory; one without is never chosen. A newer one whose inventory is
    there but damaged is refused (IntegrityError naming the file): resuming from an older one would replace it at
    its update, so the user decides (restore the file, or remove that checkpoint)."""
    ckpts = list_checkpoints(run_dir)
    complete = [c for c in ckpts if c.complete]
    chosen = complete[-1] if complete else None
    damaged = [c for c in ckpts if c.damaged and (chosen is None or c.update > chosen.update)]
    if damaged:
        bad = damaged[-1]
        older = f"{chosen.path.name}" if chosen is not None else "the start"
        raise IntegrityError(
            f"{bad.path / INVENTORY} is damaged ({_short(bad.reason, bad.path / INVENTORY)}); refusing to resume",
            hint=f"restore {INVENTORY} from a copy, or remove {bad.path.name} to resume from {older}",
        )
    return chosen.path if chosen is not None else None


def _short(reason: str, path: Path) -> str:
    """The reason without the path it opens with (the message names it once)."""
    for lead in (f"{path} (checkpoint inventory): ", f"{path}: ", f"{path} "):
        if reason.startswith(lead):
            return reason[len(lead) :]
    return reason
