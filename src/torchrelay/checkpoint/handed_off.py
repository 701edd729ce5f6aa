"""HANDED_OFF.json: the fork guard `pack` leaves in the source run's checkpoint, and its two states.

`pack` writes it in state "packing" once the bundle is in place but before the bundle's SHA256SUMS exists (so the
bundle is not usable yet), and rewrites it as "handed-off" after SHA256SUMS has landed. Either state stops the
trainer and a second pack: whatever moment a pack is killed at, a usable bundle never exists without the record.
A "packing" record whose bundle still lacks SHA256SUMS is an interrupted pack, which the next `pack` rolls back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchrelay.config import envvars
from torchrelay.errors import RelayError
from torchrelay.paths.layout import CHECKPOINT_GLOB, parse_checkpoint_name
from torchrelay.util.durable import fsync_dir, open_temp
from torchrelay.util.kill_points import kill_point
from torchrelay.util.records import read_bounded

HANDED_OFF = "HANDED_OFF.json"
PACKING = "packing"
HANDED = "handed-off"
TMP_PREFIX = f".{HANDED_OFF}.tmp-"
RECLAIM_ENV = envvars.RECLAIM.name  # =1: continue (or pack) a handed-off checkpoint on purpose
# A reclaimed checkpoint keeps its record under this prefix (TORCHRELAY_RECLAIM=1 renames it, see run.py).
RECLAIMED_PREFIX = "HANDED_OFF.reclaimed-"


def guarding_record(ckpt: Path) -> dict[str, Any] | None:
    """The record that forbids continuing or packing `ckpt` again; None when there is none, or when
    TORCHRELAY_RECLAIM=1 reclaims the checkpoint on purpose. The one fork guard of the trainer and `pack`."""
    record = read_marker(ckpt)
    return None if record is None or envvars.RECLAIM.get() else record


def read_marker(ckpt: Path) -> dict[str, Any] | None:
    """The record, None without one; a record that cannot be read is {} (it still guards: its presence counts)."""
    path = ckpt / HANDED_OFF
    try:
        data = json.loads(read_bounded(path, 1 << 20, what="the hand-off record"))
    except FileNotFoundError:
        return None if not path.is_symlink() else {}
    except (OSError, ValueError, RecursionError, RelayError):
        return {}
    return data if isinstance(data, dict) else {}


def write_marker(ckpt: Path, record: dict[str, Any], *, step: str) -> None:
    """Replace the record atomically; `step` names the moment just before the rename for crash tests."""
    tmp = ckpt / f"{TMP_PREFIX}{os.getpid()}"
    with os.fdopen(open_temp(tmp), "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    kill_point(step)
    os.replace(tmp, ckpt / HANDED_OFF)
    fsync_dir(ckpt)


def clean_temporaries(root: Path) -> list[str]:
    """Remove the temporaries of a record write that was killed; they are ours, and a leftover is no refusal."""
    removed = []
    for ckpt in root.glob(CHECKPOINT_GLOB):
        if parse_checkpoint_name(ckpt.name) is None or not ckpt.is_dir() or ckpt.is_symlink():
            continue
        for child in ckpt.iterdir():
            if child.name.startswith(TMP_PREFIX) and child.is_file() and not child.is_symlink():
                child.unlink()
                removed.append(f"{ckpt.name}/{child.name}")
    return removed
