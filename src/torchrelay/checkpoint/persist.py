"""Saving without stalling the loop: the state is copied into host buffers kept from save to save, then written,
hashed, fsynced and committed on a thread of its own while training goes on.

- `HostStage` (host_stage.py): one host buffer per tensor, allocated once and reused by every save, obtained on a
  background thread ahead of the first save without stalling the loop.
- `HashingWriter` (hashing_writer.py): DCP's FileSystemWriter whose files are hashed from the very bytes written to them (no read
  back), and spread over several files per rank, so that writing and SHA-256 run on as many cores as files
  (one SHA-256 stream runs at about disk speed: one file per rank would halve the rate).
- `Persister`: one background job at a time. A save asked for while one persists waits for it (the buffers are
  reused, so two saves never overlap); its error reaches the training thread at the next save, stop or close.

The loop shares the interpreter with the persist: every Python-level step of the writer (torch.save's pickling,
its ~40 small writes per tensor) holds the GIL the training thread needs to launch its next kernel. So DCP's plan
is made during the stall (dcp_save.py), the background threads run at a lower CPU priority, write small pieces in
batches, and at most `SaveTuning.persist_streams` of them write at once (the file count stays a function of the
tensors alone; only the concurrency varies). A file's fsync needs no slot, and its writeback starts as it is written
(`kick_bytes`): the disk works while the writers fill the page cache. The process's GIL switch interval is left as
it is: with the plan off the persist thread, a shorter one did no better.

The bytes written are the same whether the job runs on the background thread or inline (`async_save: false`):
both go through the same staging and the same writer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchrelay.checkpoint.hashing_writer import PERSISTING, HashingFileSystem, Watch
from torchrelay.checkpoint.host_buffers import lower_priority
from torchrelay.config import envvars
from torchrelay.errors import CheckpointError, ConfigError
from torchrelay.util import kill_points
from torchrelay.util.meminfo import meminfo_kib

# --- the deadline of a write that makes no progress ------------------------------------------------------


def stall_seconds() -> float:
    """How long a write may go without progress before it counts as stuck (TORCHRELAY_PERSIST_STALL_S)."""
    stall = float(envvars.PERSIST_STALL_S.get())
    if not (stall > 0 and stall < float("inf")):
        name = envvars.PERSIST_STALL_S.name
        raise ConfigError(
            f"{name}={stall:g} is not a positive number of seconds",
            hint=f"{name}: {envvars.PERSIST_STALL_S.doc}",
        )
    return stall


def writeback_kib() -> int | None:
    """The kernel's dirty and under-writeback memory, in KiB (Linux), or None: it moves while an fsync progresses."""
    got = meminfo_kib("Dirty", "Writeback")
    return None if got is None else got["Dirty"] + got["Writeback"]


def _block() -> None:
    """Crash tests only (kill_points.STALL): the writing thread stops here for good, as one in a write to a dead
    network file system; only the end of its process ends it."""
    threading.Event().wait()


# --- the background job ----------------------------------------------------------------------------------


class Persister:
    """Runs one persist job at a time on a thread of its own (or inline when `background` is false)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.update: int | None = None
        self.persisting = threading.Event()  # set while a job runs (tests observe it)
        self._watch: Watch | None = None  # the job in flight's write, as its thread shows it
        # The job's thread made no progress past the deadline: it is left behind (a thread cannot be killed) and
        # holds what it wrote from (the host buffers must outlive it); the process is to end.
        self.stuck = False
        # Tests only: a background job waits until this file exists before it writes anything, so that a test can
        # observe the loop going on, or a stop arriving, while a checkpoint is in flight (without timing).
        self.hold: Path | None = None
        # Tests only: called on the writing thread after each piece of a background job's DCP write lands (a slow
        # disk); the crash tests' kill point STALL blocks there for good instead.
        self.on_piece: Callable[[], None] | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, update: int, job: Callable[[], None], *, rank: int = 0) -> None:
        """Run `job` (write and commit checkpoint-<update> of `rank`); the previous job must have been waited for."""
        assert not self.in_flight, "wait() before the next submit()"
        self.update, self.started_at = update, time.perf_counter()
        if not self.background:
            try:
                job()
            finally:
                self.update = self.started_at = None
            return

        hold = self.hold
        stall = kill_points.write_fault(update, rank) == kill_points.STALL
        watch = self._watch = Watch(_block if stall else self.on_piece)

        def run() -> None:
            lower_priority()
            PERSISTING.watch = watch
            self.persisting.set()
            try:
                while hold and not os.path.exists(hold):
                    time.sleep(0.01)
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = exc
            finally:
                self.persisting.clear()

        self._thread = threading.Thread(target=run, name=f"torchrelay-persist-{update}", daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        """Seconds the job in flight has run (0 when none)."""
        return time.perf_counter() - self.started_at if self.in_flight and self.started_at else 0.0

    def wait(self) -> None:
        """Block until the job in flight has committed; raise what it raised (once). While its DCP write is in
        flight it waits at most TORCHRELAY_PERSIST_STALL_S past the write's last progress, as the writer process's
        parent does (writer_process.py): bytes handed to the kernel, files fsynced, and during an fsync the
        kernel's writeback. Past it, CheckpointError (its `stalled` attribute: the update), once; the thread is
        left behind (`stuck`) and later waits return at once."""
        if self.stuck:
            return
        if self._thread is not None:
            self._join(self._thread)
            self._thread = None
            self.update = self.started_at = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _join(self, thread: threading.Thread) -> None:
        stall: float | None = None
        # an fsync's writeback as last seen, and when it last moved
        seen: tuple[HashingFileSystem, int | None, float] | None = None
        while thread.is_alive():
            writing = self._watch.writing if self._watch is not None else None
            if writing is None:  # committing, or in an exchange with the peers (the group's own timeout)
                thread.join(1.0)
                continue
            fs, directory = writing
            stall = stall or stall_seconds()
            now = time.monotonic()
            last = fs.moved_at
            if fs.syncing:  # an fsync in flight progresses as the kernel's writeback moves
                kib = writeback_kib()
                if seen is None or seen[0] is not fs or seen[1] != kib:
                    seen = (fs, kib, now)  # first seen now: it counts from here (what came before is unknown)
                last = max(last, seen[2])
            if now - last >= stall:
                self.stuck = True
                err = CheckpointError(
                    f"the checkpoint persist thread made no progress for {stall:g} s while writing {directory} "
                    f"({envvars.PERSIST_STALL_S.name} sets the wait); a thread cannot be killed, so this process "
                    "ends; the last complete checkpoint stays"
                )
                err.stalled = self.update  # type: ignore[attr-defined]
                raise err
            thread.join(min(beat_seconds(stall), stall - (now - last)))


def beat_seconds(stall: float) -> float:
    """How often a deadline's watcher looks: often enough that it ends within a fraction of the deadline past
    it, rarely enough to cost nothing (once a second at most)."""
    return min(1.0, stall / 8)


__all__ = ["Persister", "beat_seconds", "stall_seconds", "writeback_kib"]
