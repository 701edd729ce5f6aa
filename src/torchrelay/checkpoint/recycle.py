"""Spare files: the tensor files of the newest checkpoint retention retired, written over by the next save.

A checkpoint's tensor files have the same names and nearly the same sizes from save to save (DCP's `__R_i.distcp`,
a function of the tensors alone). Rather than deleting a retired checkpoint and allocating as many new blocks for
the next one, retention keeps its folder as the run's one spare (`.spare-checkpoint`), and each rank's writer moves
the spare file of the name it is about to create into the new checkpoint and writes over its blocks, then cuts it
to the bytes written. Writing over existing blocks is faster than new ones (new blocks cost the file system's
allocation and the host's backing, and a deletion sends discards on a disk mounted with `discard`); PostgreSQL
recycles its WAL segments for the same reason.

What is written is the same: every byte of the file is written and hashed as a new file's is, and the file is cut
to its length before its fsync. A spare is taken only if it is a regular file with one link, in real folders of
the run (never through a link, never a file another name shares: a pack's hard links); anything else is left to
be deleted and the file created new. The spare is removed when the segment ends (`Saver.close`) and at the next
start (`commit.clean_stale`), so a run at rest holds only what retention keeps. `TORCHRELAY_RECYCLE=0` deletes
retired checkpoints instead.

One consequence: a reader that opened a retired checkpoint's file before retention retired it reads new bytes
once the next save writes over it (with deletion it read the old ones). torchrelay's own readers verify what they
read against the inventory's SHA-256, so such a read fails instead of passing (and `pack` holds the run's lock);
a program outside torchrelay must copy a checkpoint retention may retire, or keep it (docs/CHECKPOINTS.md).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from torchrelay.config import envvars
from torchrelay.paths.layout import SPARE_CHECKPOINT, TMP_CHECKPOINT_PREFIX
from torchrelay.util.durable import remove_entry


def enabled() -> bool:
    """Whether retired checkpoints are kept as spare files for the next save (TORCHRELAY_RECYCLE, default on)."""
    return bool(envvars.RECYCLE.get())


def spare_of(directory: Path, sub: str) -> Path | None:
    """The spare folder whose `sub` files a save into `directory` (a checkpoint's temporary folder) may take, or
    None: recycling off, `directory` not a save's temporary folder, or no spare there as real folders."""
    if not enabled() or not directory.name.startswith(TMP_CHECKPOINT_PREFIX):
        return None
    spare = spare_path(directory.parent)
    for folder in (spare, spare / sub):
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a link, a file: not the run's spare
                return None
        except OSError:
            return None
    return spare / sub


def take(spare: Path, dest: Path) -> BinaryIO | None:
    """Move the spare file `spare` to `dest` (which must not exist) and open it to be written over from its start,
    or None: no such spare, or not one to write over (left for deletion, or removed if it was moved)."""
    try:
        if not _plain(os.lstat(spare)):
            return None
        os.rename(spare, dest)
    except OSError:
        return None
    try:
        fd = os.open(dest, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # replaced between the look and the move (a folder, a link): not ours to write through
        remove_entry(dest)
        return None
    if not _plain(os.fstat(fd)):
        os.close(fd)
        remove_entry(dest)
        return None
    # no O_TRUNC: the blocks stay allocated; the writer cuts the file at its length
    return os.fdopen(fd, "wb")


def _plain(st: os.stat_result) -> bool:
    """A regular file no other name shares (a hard link's other name would see the bytes written over)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def keep_as_spare(root: Path, retired: Path, doomed_name: str) -> bool:
    """Make `retired` (a checkpoint folder retention just renamed out of readers' sight) the run's spare; the
    spare it replaces is renamed to `doomed_name`, for the caller's deletion (rank 0, after the commit's rename).
    Best effort: False, and `retired` left where it is for deletion, when a rename fails (the checkpoint just
    committed is complete whatever happens here)."""
    spare = spare_path(root)
    try:
        if os.path.lexists(spare):
            os.rename(spare, root / doomed_name)
        os.rename(retired, spare)
    except OSError:
        return False
    return True


def spare_path(root: Path) -> Path:
    """Where a run's spare lives (it may not exist)."""
    return root / SPARE_CHECKPOINT
