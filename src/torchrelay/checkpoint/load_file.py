"""One file of a verified load: its inventory entry checked before memory is sized by it, which of its parts are
read, and the state of its bytes as they arrive and are hashed."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from torchrelay.checkpoint.inventory import safe_relpath
from torchrelay.checkpoint.load_memory import _ALIGN, _Slab
from torchrelay.checkpoint.torch_compat import StorageInfo
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.util import sha256_parts

_DAMAGED = "the file is damaged; restore it, or remove the checkpoint to resume from an older one"


class _File:
    """One file of the load: its bytes in memory, how much of them has arrived and been hashed (each change of
    that state under `lock`, by the reading and hash threads of `verified_read._Load`)."""

    def __init__(
        self,
        rel: str,
        path: Path,
        size: int,
        digest: str | None,
        items: list[ReadItem],
        parts: tuple[int, list[str]] | None = None,
        chunk: int = 16 << 20,
    ) -> None:
        self.rel, self.path, self.size, self.digest, self.items = rel, path, size, digest, items
        self.chunk = chunk  # bytes a read asks for (a part's, where the file is read in part)
        self.chunks = -(-size // self.chunk)
        # the chunks to read, in order (fewer where the file is read in part)
        self.todo = list(range(self.chunks))
        self.issued = 0  # chunks of todo handed to a reading thread
        self.served = -1  # when a chunk of it was last handed out (see _Load._next)
        self.arrived = [False] * self.chunks
        self.hashed = 0  # chunks hashed, in order
        self.hashing = False  # a thread is hashing the arrived chunks: the others leave it to it
        self.sha = hashlib.sha256()
        self.lock = threading.Lock()
        self.fd = -1
        self.slab: _Slab | None = None
        self.view = memoryview(b"")  # the file's bytes in its slab
        # items not yet in their targets, and one more for the file's verification: its room goes back at 0
        self.left = len(items) + 1
        # verified in parts (util/sha256_parts.py): the part size and states, which parts are hashed and matched
        self.part, self.states = parts if parts is not None else (0, [])
        self.nparts = sha256_parts.part_count(size, self.part) if self.part else 0
        self.part_started = [False] * self.nparts
        self.part_ok = [False] * self.nparts
        self.prefix = 0  # parts matched from the start: the items within them can be used
        # read in part (`partial_reads`): the parts holding its items, the only ones read
        self.needed: list[int] = []
        # items waiting for their parts, by where their bytes end (`describe` sorts them)
        self.pending: list[ReadItem] = []

    def chunk_arrived(self, k: int) -> bool:
        """Chunk k is in: True where the caller is to hash the arrived prefix (no thread is hashing it)."""
        with self.lock:
            self.arrived[k] = True
            if self.hashing:
                return False
            self.hashing = True
            return True

    def hash_arrived(self) -> None:
        """Hash the arrived prefix, in order (the caller set `hashing`)."""
        while True:  # a chunk that arrives meanwhile is left to this thread
            with self.lock:
                n = self.hashed
                if n == self.chunks or not self.arrived[n]:
                    self.hashing = False
                    break
            self.sha.update(
                self.view[n * self.chunk : min((n + 1) * self.chunk, self.size)]
            )  # releases the GIL
            with self.lock:
                self.hashed = n + 1

    def hashed_all(self) -> bool:
        """Every byte is hashed: True once, for the one thread that is then to verify the file."""
        with self.lock:
            complete = self.hashed == self.chunks and not self.hashing
            if complete:
                self.hashing = True  # once: no other thread verifies it again
        return complete

    def parts_arrived(self, k: int) -> list[int]:
        """Chunk k is in: the parts it completes, each returned once (read in part: only the needed ones)."""
        first = k * self.chunk // self.part
        last = (min((k + 1) * self.chunk, self.size) - 1) // self.part
        ready = []
        with self.lock:
            self.arrived[k] = True
            for p in range(first, last + 1):
                lo = p * self.part // self.chunk
                hi = -(-min((p + 1) * self.part, self.size) // self.chunk)
                if self.needed and p not in self.needed:
                    continue  # read in part: a part the chunk holds beside the needed ones is not checked
                if not self.part_started[p] and all(self.arrived[lo:hi]):
                    self.part_started[p] = True
                    ready.append(p)
        return ready

    def part_matched(self, p: int, storage: dict[MetadataIndex, StorageInfo]) -> tuple[list[ReadItem], bool]:
        """Part p matched its states: the items that now lie in matched parts (each returned once), and whether
        the file is complete (True once)."""
        with self.lock:
            self.part_ok[p] = True
            if self.needed:  # read in part: an item is ready once every part holding its bytes matched
                if not self.pending:
                    return [], False  # every item was handed out: the file is done
                ready = [req for req in self.pending if self._parts_ok(storage[req.storage_index])]
                self.pending = [req for req in self.pending if req not in ready]
                return ready, not self.pending and all(self.part_ok[q] for q in self.needed)
            before = self.prefix
            while self.prefix < self.nparts and self.part_ok[self.prefix]:
                self.prefix += 1
            complete = before < self.nparts == self.prefix
            upto = self.size if complete else self.prefix * self.part
            n = 0
            while n < len(self.pending) and item_end(storage, self.pending[n]) <= upto:
                n += 1
            ready, self.pending = self.pending[:n], self.pending[n:]
            return ready, complete

    def _parts_ok(self, info: StorageInfo) -> bool:
        """Every part holding the item's bytes (`info`) matched (under lock)."""
        start, length = int(info.offset), int(info.length)
        if length <= 0:
            return True  # no byte of the file: nothing to wait for
        return all(self.part_ok[start // self.part : (start + length - 1) // self.part + 1])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def describe(
    root: Path,
    rel: str,
    items: list[ReadItem],
    expected: dict[str, tuple[str, int]] | None,
    storage: dict[MetadataIndex, StorageInfo],
    tuning: LoadTuning,
) -> _File:
    """The file `rel` of the DCP directory `root` to load `items` from, checked against its `expected` entry
    (refused where it is not listed or has fewer bytes than listed), read in part where `tuning` allows."""
    path = safe_relpath(root, rel, root / ".metadata")
    parts: tuple[int, list[str]] | None = None
    more: list[Any] = []
    if expected is None:
        digest, size = None, os.stat(path).st_size
    elif rel in expected:
        digest, size, *more = expected[rel]
        if more and tuning.use_parts and sha256_parts.available():
            parts = more[0]
        # before any memory is sized by it: a size larger than the file's (a damaged or forged inventory)
        # would have the slabs sized for it (a terabyte claimed: ENOMEM in a traceback). The reads check the
        # size again, both ways, as they arrive.
        try:
            found = os.stat(path).st_size
        except OSError:
            found = size  # a file that is not there: its open says so, as before
        if found < size:
            raise IntegrityError(f"{path} has {found} bytes, the inventory says {size}", hint=_DAMAGED)
    else:
        raise UnsafeInput(f"{path}: not listed in the checkpoint's inventory; refusing to read it")
    f = _File(rel, path, size, digest, items, parts, tuning.chunk_bytes)
    if f.nparts:  # each item waits for the parts that hold its bytes, the earliest to end first
        f.pending = sorted(items, key=lambda req: item_end(storage, req))
        if tuning.partial_reads:
            _read_in_part(f, storage, tuning)
    return f


def _read_in_part(f: _File, storage: dict[MetadataIndex, StorageInfo], tuning: LoadTuning) -> None:
    """Where the file's items lie in at most a third of its parts' bytes: read only those parts (f.needed,
    and the chunks that hold them in f.todo)."""
    needed: set[int] = set()
    for req in f.items:
        info = storage[req.storage_index]
        start, length = int(info.offset), int(info.length)
        if length > 0:
            needed.update(range(start // f.part, (start + length - 1) // f.part + 1))
    needed = {p for p in needed if p < f.nparts}  # an item past the end: its parse refuses it, as before
    held = sum(min((p + 1) * f.part, f.size) - p * f.part for p in needed)
    if not needed or 3 * held > f.size:
        return
    if (
        f.part <= tuning.chunk_bytes and f.part % _ALIGN == 0
    ):  # parts smaller than a read: a read a part, no more
        f.chunk, f.chunks = f.part, f.nparts
        f.arrived = [False] * f.chunks
    chunks: set[int] = set()
    for p in needed:
        lo, hi = p * f.part, min((p + 1) * f.part, f.size)
        chunks.update(range(lo // f.chunk, (hi - 1) // f.chunk + 1))
    f.needed, f.todo = sorted(needed), sorted(chunks)


def item_end(storage: dict[MetadataIndex, StorageInfo], req: ReadItem) -> int:
    """Where the item's bytes end in its file."""
    info = storage[req.storage_index]
    return int(info.offset) + int(info.length)
