"""The commit protocol across ranks: temporary directory → files fsynced → inventory last → rename → fsync.

Rank 0 owns the directory operations; every rank writes its own files and hashes a share of them, so
the inventory costs one pass over the bytes spread over all ranks. A crash anywhere before the rename
leaves only a `.tmp-checkpoint-*` directory, which readers ignore and the next start removes.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchrelay.checkpoint import recycle
from torchrelay.checkpoint.handed_off import clean_temporaries
from torchrelay.checkpoint.inventory import inventory_entries, inventory_entry, list_files, write_inventory
from torchrelay.checkpoint.retention import AnyOf, PreservationPolicy, SavedNow, decide
from torchrelay.checkpoint.storage import CheckpointStorage, as_storage
from torchrelay.checkpoint.storage import wait_deletions as wait_deletions  # the segment's end waits for them
from torchrelay.errors import CheckpointError, DiskFull, RelayError, one_line
from torchrelay.paths.layout import (
    DELETING_CHECKPOINT_PREFIX,
    SPARE_CHECKPOINT,
    TMP_CHECKPOINT_PREFIX,
    checkpoint_name,
)
from torchrelay.util import collective, kill_points
from torchrelay.util.durable import remove_entry

TMP_PREFIX = TMP_CHECKPOINT_PREFIX
DELETING_PREFIX = DELETING_CHECKPOINT_PREFIX


def clean_stale(root: Path) -> list[str]:
    """Remove temporaries a crashed save, delete or pack left behind in `root` (a folder of checkpoints: a run
    directory, a memory tier's root or a replica's), rank 0, at start, before any check."""
    removed = clean_temporaries(root)  # of a hand-off record a killed pack was writing
    for child in root.iterdir():
        if _is_stale(child.name) and child.is_dir():
            remove_entry(child)  # a link of such a name goes itself, never what it points to
            removed.append(child.name)
    return removed


def _is_stale(name: str) -> bool:
    """A save's temporary, a deletion cut short, or the spare of a segment that ended without its close."""
    return name == SPARE_CHECKPOINT or name.startswith((TMP_PREFIX, DELETING_PREFIX))


Written = dict[str, tuple[str, int]]  # relative path -> (SHA-256, size) of the files a rank wrote


def commit_checkpoint(
    where: Path | CheckpointStorage,
    update: int,
    write: Callable[[Path, Callable[[str], None] | None], Written | None],
    *,
    rank: int,
    world_size: int,
    info: dict[str, Any],
    retention: PreservationPolicy,
    group: Any = None,
    started: float | None = None,
) -> tuple[Path, float]:
    """Write `checkpoint-<update>/` through the protocol into `where` (a run directory, or a storage backend:
    storage.py); returns its path and the seconds it took.

    `write` may return the SHA-256 and size of the files it wrote, hashed as they were written: the inventory
    takes them as they are and hashes only what no rank reported (DCP's `.metadata`). Collectives go through
    `group` (a background persist has a gloo group of its own). `started`: when the save began (its staging).
    """
    started = time.perf_counter() if started is None else started
    storage = as_storage(where)
    root = storage.root
    hook = kill_points.save_hook(
        update, rank
    )  # a crash test's, when one armed this save (util/kill_points.py)
    peers = collective.ranks(group)
    name = f"saving {checkpoint_name(update)}"
    tmp_box: list[Path] = []

    def translate(exc: BaseException) -> BaseException:
        """This rank's failure as the save's: a full disk said as such, anything else a CheckpointError."""
        if _is_disk_full(exc) or _nearly_full(root):
            return DiskFull(f"{name}: no space left on the device holding {root} (disk full)")
        return exc if isinstance(exc, RelayError) else CheckpointError(f"{name}: {one_line(exc)}"[:500])

    def settle(err: RelayError) -> None:
        """Every rank, once the ranks agreed the save failed: none renames; rank 0 removes the temporary."""
        gc.collect()  # a writer that failed mid-file may still hold it open, and its space with it
        if rank == 0 and tmp_box:
            shutil.rmtree(tmp_box[0], ignore_errors=True)

    # One phase of the failure protocol (util/collective.py): whatever fails on any rank, every rank raises the
    # same error before any rank renames, and none waits for a rank that failed.
    with peers.phase(name, hint=_HINT, translate=translate, settle=settle, end=False):
        tmp = root / peers.broadcast(name, lambda: storage.stage(update).name)
        tmp_box.append(tmp)
        written = peers.agree(name, lambda: write(tmp, hook))
        if hook:
            hook("inventory")
        if written is None:  # a writer that hashed nothing: each rank hashes a share of the files
            files = list_files(tmp)
            mine: Any = inventory_entries(tmp, (rel for i, rel in enumerate(files) if i % world_size == rank))
        else:
            mine = [inventory_entry(rel, *digest) for rel, digest in written.items()]
        gathered = peers.all_gather(name, lambda: mine)
        final = root / checkpoint_name(update)
        if rank == 0:
            entries = _complete_entries(tmp, [e for part in gathered for e in part])
            seconds = time.perf_counter() - started

            def marker(staged: Path) -> None:
                write_inventory(
                    staged,
                    entries,
                    update=update,
                    save_seconds=round(seconds, 4),
                    world_size=world_size,
                    **info,
                )
                if hook:
                    hook("rename")

            final = storage.publish(tmp, update, marker)
            tmp_box.clear()  # published: nothing to remove any more
            retain(storage, retention)
        elif hook:
            hook("rename")
        peers.exchange(name)  # every rank returns once the checkpoint is renamed
    return final, time.perf_counter() - started


_HINT = "the previous complete checkpoint is untouched; free space or fix the cause and resume"


def _complete_entries(tmp: Path, reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The inventory of `tmp`: what the ranks reported (each file's size checked against the disk), plus the
    files no rank reported, hashed now (small ones: DCP's `.metadata`)."""
    by_path = {e["path"]: e for e in reported}
    entries = []
    missing = []
    for rel in list_files(tmp):
        entry = by_path.get(rel)
        if entry is None:
            missing.append(rel)
            continue
        size = (tmp / rel).stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{tmp / rel}: {size} bytes on disk, {entry['size']} written")
        entries.append(entry)
    gone = sorted(set(by_path) - set(list_files(tmp)))
    if gone:
        raise CheckpointError(f"{tmp}: files written but gone before the inventory: {gone[:5]}")
    return entries + inventory_entries(tmp, missing)


def _is_disk_full(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _nearly_full(path: Path) -> bool:
    usage = shutil.disk_usage(path)
    return usage.free < min(1 << 20, usage.total // 100) or usage.free < 64 << 10


def retain(storage: CheckpointStorage, retention: PreservationPolicy) -> None:
    """Delete the complete checkpoints the policy does not preserve; never the newest, never an incomplete or
    handed-off one (the fork guard's marker must stay where `pack` put it)."""
    complete = {c.update: c for c in storage.list_complete() if c.complete and not c.handed_off}
    asked = SavedNow(frozenset(u for u, c in complete.items() if c.saved_now))  # step.save_now's, kept
    doomed = decide(AnyOf((retention, asked)), list(complete)).deleted
    if doomed:
        storage.delete(doomed)


def _delete(paths: list[Path]) -> None:
    for path in paths:
        remove_entry(path)  # a link or a file planted under such a name: itself only


def stale_bytes(root: Path) -> int:
    """Bytes held by what the next start removes (`clean_stale`): a killed segment's spare, a killed save's
    temporary, a deletion cut short; files only, never through a link."""
    total = 0
    if not root.is_dir():
        return 0
    for child in root.iterdir():
        if _is_stale(child.name) and child.is_dir() and not child.is_symlink():
            for folder, _dirs, files in os.walk(child):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(folder, name)).st_blocks * 512  # held, not apparent
    return total


def drop_spare(root: Path) -> None:
    """Delete the run's spare (rank 0, at a segment's end): a run at rest holds what retention keeps, no more."""
    spare = recycle.spare_path(root)
    # a folder, or whatever was planted under its name: itself, never through a link
    if os.path.lexists(spare):
        doomed = root / f"{DELETING_PREFIX}spare-{os.getpid()}-{time.time_ns()}"
        with contextlib.suppress(OSError):  # what is left is removed at the next start (clean_stale)
            os.rename(spare, doomed)
            _delete([doomed])
