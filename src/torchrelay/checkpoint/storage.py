"""Where checkpoints live: the storage seam under the commit protocol (docs/CHECKPOINTS.md, "Storage").

The commit protocol (commit.py) decides *what* a checkpoint is and *when* it counts; a backend only says *how*
bytes reach a place and how a checkpoint becomes visible there. The seam is two Protocols:

- `CheckpointStore`, what every backend can do: publish a checkpoint with its marker (COMPLETE.json) as the last
  act, list the checkpoints it holds (only one whose marker is there counts as complete), read a byte range of a
  published file, delete published checkpoints.
- `CheckpointStorage`, a store that is also a file system the save writes into: stage a temporary, write a part,
  finish a file. Only a file-system backend has these, because the save's writers (dcp_io, the writer process, a
  DeepSpeed engine) write files at paths, and only a file system has the atomic rename that makes a whole
  temporary folder visible at once; an object store has neither, so it publishes a folder that is already
  complete on a local disk, its objects first and the marker object last, by conditional put.

Three backends: the run directory (`LocalStorage`, the durable tier), the node-local memory tier (a
`LocalStorage` over /dev/shm, checkpoint/tiers.py), and an S3-compatible object store
(storage/checkpoints.py's `ObjectStorage`, a run's durable tier in a store, storage/durable.py). Readers above
the seam never see a checkpoint that was not published.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from torchrelay.checkpoint import recycle
from torchrelay.checkpoint.select import CheckpointInfo, list_checkpoints
from torchrelay.errors import CheckpointError, RelayError
from torchrelay.paths.layout import DELETING_CHECKPOINT_PREFIX, TMP_CHECKPOINT_PREFIX, checkpoint_name
from torchrelay.util.durable import fsync_dir, remove_entry


@runtime_checkable
class CheckpointStore(Protocol):
    """What every backend can do with published checkpoints (a file system's or an object store's)."""

    def publish(self, staged: Path, update: int, write_marker: Callable[[Path], None]) -> Path | str:
        """The last act of a save: `write_marker` writes the inventory into the local folder `staged`, then the
        checkpoint becomes visible as `checkpoint-<update>` (its marker last); returns where it is now."""
        ...

    def list_complete(self) -> list[CheckpointInfo]:
        """Every checkpoint it holds, oldest first, each saying whether it is complete (its marker is there)."""
        ...

    def read_range(self, update: int, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of one file of a published checkpoint."""
        ...

    def delete(self, updates: Sequence[int]) -> None:
        """Retire these checkpoints: invisible at once (the marker goes first), their space freed later."""
        ...


@runtime_checkable
class CheckpointStorage(CheckpointStore, Protocol):
    """A store that is also the file system a save writes into: the operations the commit protocol needs."""

    @property
    def root(self) -> Path:
        """The directory its checkpoints are named in."""
        ...

    def stage(self, update: int) -> Path:
        """A fresh temporary for the save of `update`; nothing in it is visible to readers until `publish`."""
        ...

    def write_part(self, staged: Path, rel: str, data: bytes | memoryview) -> None:
        """Write one file of a staged checkpoint."""
        ...

    def finish_file(self, path: Path) -> None:
        """Make a written file durable in this backend (fsync)."""
        ...

    def publish(self, staged: Path, update: int, write_marker: Callable[[Path], None]) -> Path:
        """`CheckpointStore.publish` by an atomic rename of `staged` (a complete one of the same update is
        replaced); returns the published folder."""
        ...


class LocalStorage(CheckpointStorage):  # named, so that the type checker holds it to the seam
    """Checkpoints as folders of a local (or shared POSIX) file system: temporary folder, fsynced files,
    inventory last, rename, fsync of the parent. `spare`: retired tensor files are kept as the spare the next save
    writes over (recycle.py), the run directory's own economy; a memory tier has none."""

    def __init__(self, root: Path, *, spare: bool = True) -> None:
        self._root = Path(root)
        self._spare = spare

    @property
    def root(self) -> Path:
        return self._root

    def stage(self, update: int) -> Path:
        tmp = self._root / f"{TMP_CHECKPOINT_PREFIX}{update}-{os.getpid()}-{int(time.time() * 1000)}"
        try:
            tmp.mkdir()
        except OSError as exc:
            raise CheckpointError(f"cannot create {tmp}: {exc.strerror}") from exc
        return tmp

    def write_part(self, staged: Path, rel: str, data: bytes | memoryview) -> None:
        path = staged / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self.finish_file(path)

    def finish_file(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self, staged: Path, update: int, write_marker: Callable[[Path], None]) -> Path:
        write_marker(staged)
        for sub in sorted({p.parent for p in staged.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
            fsync_dir(sub)
        final = self._root / checkpoint_name(update)
        if final.exists():  # a complete checkpoint of the same update from an earlier segment
            os.rename(final, self._root / f"{DELETING_CHECKPOINT_PREFIX}{update}-{os.getpid()}")
        os.rename(staged, final)
        fsync_dir(self._root)
        return final

    def list_complete(self) -> list[CheckpointInfo]:
        return list_checkpoints(self._root)

    def read_range(self, update: int, rel: str, offset: int, length: int) -> bytes:
        with open(self._root / checkpoint_name(update) / rel, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def delete(self, updates: Sequence[int]) -> None:
        # state/ imports torch: `status` lists checkpoints without it
        from torchrelay.checkpoint.state.records import MODEL_DIR

        newest = None
        for update in sorted(updates):
            newest = self._root / f"{DELETING_CHECKPOINT_PREFIX}{update}-{os.getpid()}"
            os.rename(self._root / checkpoint_name(update), newest)
        # The newest retired one's tensor files are written over by the next save (a DeepSpeed engine's, written by
        # the engine itself, are not: deleted). Best effort, after the rename that made this save complete: nothing
        # here may fail it (a bad TORCHRELAY_RECYCLE fails the next save that writes tensors, naming the variable);
        # what cannot become the spare stays a `.deleting-*`, deleted below.
        with contextlib.suppress(OSError, RelayError):
            if self._spare and newest is not None and recycle.enabled() and (newest / MODEL_DIR).is_dir():
                recycle.keep_as_spare(
                    self._root, newest, f"{DELETING_CHECKPOINT_PREFIX}spare-{os.getpid()}-{time.time_ns()}"
                )
        fsync_dir(self._root)  # from here no reader sees them: what is left is freeing the space
        doomed = [c for c in self._root.iterdir() if c.name.startswith(DELETING_CHECKPOINT_PREFIX)]
        if doomed:
            # Deleting gigabytes takes seconds: never on the training thread. A crash leaves `.deleting-*`
            # directories, which the next start removes (commit.clean_stale).
            thread = threading.Thread(
                target=_delete, args=(doomed,), name="torchrelay-retention", daemon=True
            )
            with _DELETERS_LOCK:
                _DELETERS.append(thread)
            thread.start()


def as_storage(where: Path | CheckpointStorage) -> CheckpointStorage:
    """A path is the run directory's own storage (the durable tier)."""
    return LocalStorage(Path(where)) if isinstance(where, str | os.PathLike) else where


_DELETERS: list[threading.Thread] = []
_DELETERS_LOCK = threading.Lock()


def _delete(paths: list[Path]) -> None:
    for path in paths:
        remove_entry(path)  # a link or a file planted under such a name: itself only


def wait_deletions() -> None:
    """Wait for the retention deletions started so far (a segment's end: no `.deleting-*` left behind)."""
    with _DELETERS_LOCK:
        threads, _DELETERS[:] = list(_DELETERS), []
    for thread in threads:
        thread.join()
