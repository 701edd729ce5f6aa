"""DCP's FileSystemWriter whose files are hashed from the very bytes written to them (no read back), spread over
several files per rank so that writing and SHA-256 run on as many cores as files; and the progress a persist's
training thread reads of such a write (its deadline: persist.py)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from torchrelay.checkpoint import recycle
from torchrelay.checkpoint.host_buffers import lower_priority
from torchrelay.config import envvars
from torchrelay.config.tuning import SaveTuning
from torchrelay.util.sha256_parts import PartHasher

# Per-rank DCP files: about one per `SaveTuning.file_bytes` of tensors, at most 16 (a core each), one per tensor at
# most. Dropping a file's pages after its fsync was tried: no faster, and a resume after a crash reads the cache.
MAX_FILES = 16
STREAMS_ENV = envvars.PERSIST_STREAMS.name
# Writes smaller than this are gathered (torch.save's zip headers, pickles, padding) and hashed and written together.
_SMALL = 256 << 10
_BATCH = 1 << 20
# A large write (torch.save hands over a tensor's storage whole) goes to the kernel in pieces of this size, each
# counted as progress as it lands (HashingFileSystem.progress): a slow disk is then seen to progress every piece,
# not once per tensor. The digest and the bytes are the same.
_PIECE = 16 << 20

# absolute path -> (hex SHA-256, size), or (hex SHA-256, size, (part size, states)) for a file of several parts
# hashed as it was written where libcrypto's SHA-256 state can be recorded (util/sha256_parts.py: a reader
# verifies such a file in parts)
Digests = dict[str, tuple[Any, ...]]


# --- hashing while writing ---------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write-only file that feeds every byte to SHA-256 on its way to disk; files are written front to back.
    Small writes are gathered and passed on together: fewer trips through the GIL per tensor.
    The SHA-256's state is recorded every PART_BYTES (util/sha256_parts.py), so that a reader can verify the file in
    parts at once; `on_close(digest, size, (part size, states))`, the last None for a file of one part or where
    the states cannot be recorded.
    `on_written`: called once every byte is written, when the writer asks for the descriptor to fsync it;
    `on_bytes`: called with each piece's size once the kernel has it."""

    def __init__(
        self,
        f: Any,
        on_close: Callable[[str, int, tuple[int, tuple[str, ...]] | None], None],
        on_written: Callable[[], None] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        cut: bool = False,
        kick: int = 64 << 20,
    ) -> None:
        super().__init__()
        self._cut = cut  # a spare file written over (recycle.py): cut to the bytes written before its fsync
        self._h = PartHasher()
        self._f, self._n, self._on_close = f, 0, on_close
        self._on_written, self._on_bytes = on_written, on_bytes
        self._pending = bytearray()
        self._kicked = 0  # bytes handed to the kernel's writeback so far (`kick`)
        self._kick_every = kick  # 0: no kick
        self.synced = False  # the writer asked for the descriptor (to fsync it): every byte is written

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n < _SMALL:
            self._pending += view
            if len(self._pending) >= _BATCH:
                self._drain()
        else:
            self._drain()
            self._pass_on(view)
        self._n += n
        return n

    def _pass_on(self, data: memoryview | bytearray) -> None:
        view, done = memoryview(data), 0
        while done < len(view):
            piece = view[done : done + _PIECE]
            self._h.update(piece)  # releases the GIL for large buffers, as the write below does
            self._f.write(piece)
            done += len(piece)
            if self._kick_every and self._n + done - self._kicked >= self._kick_every:
                self._kick(self._n + done)
            if self._on_bytes is not None:
                self._on_bytes(len(piece))

    def _kick(self, upto: int) -> None:
        """Start writing back what this file holds so far (Linux: DONTNEED begins the writeback of dirty pages
        and drops them once clean), so that the disk works while the writers fill the page cache and the final
        fsync has little left; best effort."""
        self._f.flush()
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(self._f.fileno(), self._kicked, upto - self._kicked, os.POSIX_FADV_DONTNEED)
        self._kicked = upto

    def _drain(self) -> None:
        if self._pending:
            self._pass_on(self._pending)
            self._pending = bytearray()

    def tell(self) -> int:
        return self._n

    def fileno(self) -> int:
        self.flush()  # a caller that fsyncs the descriptor means every byte written so far
        self._cut_to_length()
        self.synced = True
        if self._on_written is not None:
            self._on_written()
        return int(self._f.fileno())

    def flush(self) -> None:
        self._drain()
        self._f.flush()

    def _cut_to_length(self) -> None:
        if self._cut:
            os.ftruncate(self._f.fileno(), self._n)  # a longer spare's tail is not this file's
            self._cut = False

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self._cut_to_length()
            states = (
                self._h.states
            )  # only for a file of several parts: one part is verified as a whole file is
            self._on_close(self._h.hexdigest(), self._n, (self._h.part, tuple(states)) if states else None)
        super().close()


def persist_streams(tuning: SaveTuning) -> int:
    """How many files a rank writes at once in the background (TORCHRELAY_PERSIST_STREAMS, else the tuning's)."""
    streams = envvars.PERSIST_STREAMS.get()
    return tuning.persist_streams if streams is None else max(1, streams)


def kick_bytes(tuning: SaveTuning) -> int:
    """Every how many bytes a file's writeback is started (TORCHRELAY_PERSIST_KICK_BYTES, else the tuning's)."""
    kick = envvars.PERSIST_KICK_BYTES.get()
    return tuning.kick_bytes if kick is None else max(0, kick)


class HashingFileSystem(FileSystem):
    def __init__(self, sink: Digests, background: bool, spare: Path | None, tuning: SaveTuning) -> None:
        super().__init__()
        self.sink = sink
        self.spare = spare  # a folder of spare files to write over (recycle.py), or None
        self._kick = kick_bytes(tuning)  # once per write, in the process that writes (the writer too)
        self._lock = threading.Lock()
        self._slots = (
            threading.BoundedSemaphore(persist_streams(tuning)) if background else None
        )  # None: inline
        # What a watcher reads to tell a write that progresses from one that is stuck (the writer process's
        # heartbeat, writer_child.py): bytes handed to the kernel plus files fsynced, and the fsyncs in flight.
        self.progress = 0
        self.syncing = 0
        # when `progress` last grew: the persist thread's deadline (Persister.wait)
        self.moved_at = time.monotonic()
        # Tests only (kill_points.STALL, a slow disk): called on the writing thread after each piece lands.
        self.on_piece: Callable[[], None] | None = None

    def _moved(self, n: int) -> None:
        with self._lock:
            self.progress += n
            self.moved_at = time.monotonic()
        if self.on_piece is not None:
            self.on_piece()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        key = str(path)

        def done(digest: str, size: int, parts: tuple[int, tuple[str, ...]] | None) -> None:
            with self._lock:
                self.sink[key] = (digest, size) if parts is None else (digest, size, parts)

        slot = self._slots
        if slot is not None:
            lower_priority()  # a writer thread of this persist (DCP's or the persist's own): it ends with the save
            slot.acquire()

        def free() -> None:
            # Once the file's bytes are all written its fsync needs no slot (it holds no GIL), and the next file
            # fills the page cache while the disk flushes this one. Frees the slot once.
            nonlocal slot
            held, slot = slot, None
            if held is not None:
                held.release()

        syncing = False

        def written() -> None:  # every byte written: the writer fsyncs the file next
            nonlocal syncing
            free()
            if not syncing:
                syncing = True
                with self._lock:
                    self.syncing += 1

        try:
            reused = None if self.spare is None else recycle.take(self.spare / Path(path).name, Path(path))
            with reused if reused is not None else open(path, "wb") as f:
                stream = _HashingStream(
                    f, done, written, self._moved, cut=reused is not None, kick=self._kick
                )
                try:
                    yield stream
                finally:
                    stream.close()
                    if syncing:
                        with self._lock:
                            self.syncing -= 1
                            self.progress += 1
                            self.moved_at = time.monotonic()
        finally:
            free()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if str(path) in self.sink:
                self.sink[str(new_path)] = self.sink.pop(str(path))


class HashingWriter(dcp.FileSystemWriter):
    """FileSystemWriter (fsynced files) that records each file's SHA-256 and size in `digests` as it writes it,
    and splits a rank's tensors over several files (a function of the tensors alone, never of the machine).
    `background`: it runs beside the training loop (lower priority, at most `persist_streams` files at once);
    never set it for a write on the training thread, whose priority it would lower for good. `spare`: a folder
    whose files of the same names are written over instead of new ones (recycle.py)."""

    def __init__(
        self,
        path: Path,
        digests: Digests,
        *,
        background: bool = False,
        spare: Path | None = None,
        tuning: SaveTuning | None = None,
    ) -> None:
        super().__init__(str(path), sync_files=True)
        self.tuning = tuning or SaveTuning()
        self._hashing = HashingFileSystem(digests, background, spare, self.tuning)
        self.fs = self._hashing
        self.files: int | None = None  # set: this many files (the writer process is told the parent's count)

    def progress(self) -> tuple[int, bool]:
        """How far the write is (bytes handed to the kernel plus files fsynced: it only grows), and whether an
        fsync is in flight now; for a watcher telling a slow write from a stuck one (writer_child.py)."""
        fs = self._hashing
        return fs.progress, fs.syncing > 0

    def on_piece(self, hook: Callable[[], None]) -> None:
        """Tests only (kill_points.STALL, a slow disk): run `hook` on the writing thread each time a piece of this
        write has reached the kernel (to stop or slow the write there)."""
        self._hashing.on_piece = hook

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.thread_count = self.files or file_count(plan, self.tuning)
        watch: Watch | None = getattr(PERSISTING, "watch", None)  # on a Persister's thread: its deadline
        if watch is None or self._hashing._slots is None:
            return super().write_data(plan, planner)
        if watch.on_piece is not None:  # tests only (Persister.on_piece)
            self.on_piece(watch.on_piece)
        watch.writing = (self._hashing, Path(self.path))
        try:
            return super().write_data(plan, planner)
        finally:
            watch.writing = None


def file_count(plan: Any, tuning: SaveTuning) -> int:
    """How many files a rank's final plan (once DCP has given each replicated tensor to one rank) is split into."""
    sizes = [_item_bytes(item) for item in plan.items if item.tensor_data is not None]
    return min(MAX_FILES, max(1, math.ceil(sum(sizes) / tuning.file_bytes)), max(1, len(sizes)))


def _item_bytes(item: Any) -> int:
    size = item.tensor_data.properties.dtype.itemsize
    for n in item.tensor_data.size:
        size *= n
    return int(size)


def canonical_safetensors(data: bytes) -> bytes:
    """safetensors bytes with their JSON header's keys sorted: the library writes its metadata in hash order, so
    the same tensors gave different bytes from save to save. Offsets count from the end of the header, so the
    tensor bytes stay as they are; any safetensors reader reads the result."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the header is padded with spaces to keep the tensors 8-byte aligned
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def write_bytes(path: Path, data: bytes | memoryview, digests: Digests) -> None:
    """Write a small file whole, fsync it, and record the SHA-256 of the bytes written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    digests[str(path)] = (hashlib.sha256(data).hexdigest(), len(data))


PERSISTING = threading.local()  # on a Persister's thread: `watch`, what its training thread reads


class Watch:
    """What the training thread reads of its persist thread's DCP write (the persist's bulk) while it waits for
    it: the write in flight (its file system's progress counters) or None; and the tests' hook on its pieces."""

    def __init__(self, on_piece: Callable[[], None] | None) -> None:
        self.writing: tuple[HashingFileSystem, Path] | None = None
        self.on_piece = on_piece
