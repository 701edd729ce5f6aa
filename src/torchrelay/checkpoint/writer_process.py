"""A writer process per rank: the persist's DCP files written by a process of their own, so that the training
process's interpreter runs nothing of the write while a checkpoint persists.

A persist thread shares the training thread's GIL: torch.save's pickling of every item, its ~40 small writes per
tensor and DCP's writer loop each hold it for a slice, and the loop's next kernel launch waits for the slice to end
(updates during a persist were measurably slower, with garbage collections already out of the way).
torch_checkpointing and DCP's process-based async save move the
write to another process for the same reason.

How it works: the host buffers a save copies into live in memfd mappings (host_stage.py, `HostStage(shared=True)`),
which the writer maps too (their descriptors are passed over a unix socket). For each job the persist thread
resolves every item of the rank's final DCP plan to where its bytes are (mapping, offset, dtype, shape, stride) or,
for a non-tensor item, to the bytes DCP's planner made of it; the writer rebuilds the same tensors over its
mappings and runs the same `HashingWriter` on the same plan, so the files and their digests are those the thread
would have written (tests/test_writer_process.py compares them). It answers with DCP's write results and the
digests; the commit protocol (the coordinator's .metadata, the inventory, the rename) stays with the parent.

The writer is started once per Saver, from the training thread (the parent-death signal fires when the thread that
started a child ends), and dies with its parent: PR_SET_PDEATHSIG, and EOF on its socket. A writer that dies during
a job makes the job raise one `CheckpointError` (carried to every rank by the failure protocol); the checkpoint
being written is never committed, so the last complete one stays the newest.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.hashing_writer import file_count, kick_bytes, persist_streams
from torchrelay.checkpoint.host_stage import HostStage, SharedMap
from torchrelay.checkpoint.persist import beat_seconds, stall_seconds
from torchrelay.config import envvars
from torchrelay.errors import CheckpointError, ConfigError

CHILD_MODULE = "torchrelay.checkpoint.writer_child"
_HEADER = struct.Struct("<Q")
_FDS_PER_MESSAGE = 200  # SCM_RIGHTS carries at most 253 descriptors a message (Linux's SCM_MAX_FD)
PROCESS, THREAD, AUTO = "process", "thread", "auto"


# `auto` gives a rank a writer process only with this many cores per local rank: the writer's start-up (an import
# of torch: seconds of CPU) and its writers then run beside the loop without taking its core; with fewer, two ranks
# and their two writers starting at once made a budget stop late (tests/test_controller.py).
PROCESS_MIN_CORES = 4


def writer_mode() -> str:
    """How a background persist writes its files: TORCHRELAY_PERSIST_WRITER (`process`, `thread`, or `auto`, the
    default: the process where each local rank has PROCESS_MIN_CORES cores)."""
    mode = envvars.PERSIST_WRITER.get()
    if mode not in (PROCESS, THREAD, AUTO):
        name = envvars.PERSIST_WRITER.name
        raise ConfigError(
            f"{name}={mode!r} is not {PROCESS}, {THREAD} or {AUTO}",
            hint=f"{name}: {envvars.PERSIST_WRITER.doc}",
        )
    if mode == AUTO:
        return PROCESS if _cores_per_local_rank() >= PROCESS_MIN_CORES else THREAD
    return str(mode)


def _cores_per_local_rank() -> float:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return cores / (int(local) if local.isdigit() and int(local) > 0 else 1)


def can_share() -> bool:
    """Whether this system gives shared host buffers (Linux's memfd_create)."""
    return hasattr(os, "memfd_create")


# --- messages: a length, then a pickle (between a process and the child it started, never read from disk) ------


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    """The next message, or None once the other end has closed (or died)."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    data = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)  # noqa: S301 - our own child's (or parent's) message


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    for i in range(0, len(fds), _FDS_PER_MESSAGE):
        chunk = fds[i : i + _FDS_PER_MESSAGE]
        socket.send_fds(sock, [b"F"], chunk)


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    fds: list[int] = []
    while len(fds) < count:
        _, got, _, _ = socket.recv_fds(sock, 1, min(_FDS_PER_MESSAGE, count - len(fds)))
        if not got:
            raise EOFError("the parent closed the socket while sending descriptors")
        fds.extend(got)
    return fds


# --- the parent's side -------------------------------------------------------------------------------------


def describe(data: Any, maps: list[SharedMap]) -> tuple[Any, ...]:
    """Where one resolved DCP item's bytes are, for the writer: a view of a shared mapping, else the item itself
    (a non-tensor item's bytes; a tensor outside the mappings, pickled whole: storage and view as they are)."""
    if isinstance(data, io.BytesIO):
        return ("bytes", data.getvalue())
    t = data.detach()
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if t.device.type == "cpu" and nbytes:
        for m in maps:
            if m.base <= ptr and ptr + nbytes <= m.base + m.size:
                return ("view", m.key, ptr - m.base, nbytes, t.dtype, t.storage_offset(), t.shape, t.stride())
    return ("tensor", t.cpu())


class WriterProcess:
    """One rank's writer process (see the module's docstring); `write` runs one DCP write job in it."""

    def __init__(self, stage: HostStage) -> None:
        self._stage = stage
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the directory torchrelay is imported from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        env["CUDA_VISIBLE_DEVICES"] = ""  # it writes host memory only: no CUDA context, no device memory
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(child.fileno()), str(os.getpid())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._mapped: set[int] = set()  # keys of the mappings the writer holds
        self._ready = False  # the writer said it has imported what it writes with (its first message)
        self.hold: Path | None = None  # tests only: the writer waits for this file before it writes a byte
        # crash tests only (kill_points.WRITER): the next job's writer SIGKILLs itself once its files are written
        self.die = False
        # crash tests only (kill_points.STALL): the next job's writer SIGSTOPs itself once its first piece is written
        self.stall = False
        self.finished = False  # the last job's writer wrote the save's `.metadata` (see `write`)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def ready(self, *, wait: bool = False) -> bool:
        """Whether the writer has started (its imports done: seconds of CPU on a small host), without waiting
        unless `wait` (crash tests). A save before that writes from the persist thread instead (the same bytes): it
        must not wait for the writer's start-up, which a budget or a stop request did not plan for. Called on the
        training thread, and only until it is true: no job has used the socket before."""
        if not self._ready and select.select([self._sock], [], [], None if wait else 0)[0]:
            self._ready = recv_msg(self._sock) == ("ready",)
        return self._ready

    def _sync_maps(self) -> None:
        maps = self._stage.shared_maps()
        new = [m for m in maps if m.key not in self._mapped]
        send_msg(self._sock, ("maps", [m.key for m in maps], [(m.key, m.size) for m in new]))
        send_fds(self._sock, [m.fd for m in new])
        self._mapped = {m.key for m in maps}

    def prepare(
        self, planner: Any, plan: Any, *, rank: int, coordinator: bool, metadata: Any = None
    ) -> bytes | None:
        """The job of `plan` as the writer will read it (every item resolved to where its bytes are), pickled: made
        on the training thread during the save's stall, while the copies into the buffers are in flight (it reads
        the buffers' addresses, never their bytes), so that the persist thread only sends it: made there, its
        interpreter time held the GIL the loop's next update needed. None when an item lies outside the shared mappings: its
        bytes are read at the write, once the copies have landed. `metadata`: the save's DCP metadata when this
        rank's results are all it needs (one rank): the writer then writes `.metadata` itself (see `write`)."""
        return self._job(planner, plan, rank=rank, coordinator=coordinator, outside=False, metadata=metadata)

    def _job(
        self, planner: Any, plan: Any, *, rank: int, coordinator: bool, outside: bool, metadata: Any = None
    ) -> bytes | None:
        """The pickled job; None if an item lies outside the mappings and `outside` is false."""
        maps = self._stage.shared_maps()
        items = [(item.index, describe(planner.resolve_data(item), maps)) for item in plan.items]
        if not outside and any(spec[0] == "tensor" for _, spec in items):
            return None
        job = {
            "plan": plan,
            "files": file_count(plan, self._stage.tuning),
            "streams": persist_streams(self._stage.tuning),
            "kick": kick_bytes(self._stage.tuning),
            "items": items,
            "rank": rank,
            "coordinator": coordinator,
            "metadata": metadata,
        }
        return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)

    def write(
        self, directory: Path, planner: Any, plan: Any, digests: dict[str, tuple[str, int]], *, rank: int,
        coordinator: bool, prepared: bytes | None = None, metadata: Any = None, spare: Path | None = None,
    ) -> list[Any]:  # fmt: skip
        """Write this rank's DCP files of `plan` into `directory` in the writer; DCP's write results, and each
        file's digest added to `digests`. `prepared`: this plan's job from `prepare`. A job that carries the
        save's metadata (`prepare`'s, or `metadata` here) has the writer write `.metadata` too, from its own
        results (`finished` is then true): the metadata's pickle and fsync are then not the persist thread's,
        whose GIL the loop shares. `spare`: a folder of spare files to write over (recycle.py). Raises CheckpointError (one line)
        if the writer fails or dies."""
        self.finished = False
        if (
            prepared is None
        ):  # items outside the mappings are sent whole, read now that the copies have landed
            prepared = self._job(
                planner, plan, rank=rank, coordinator=coordinator, outside=True, metadata=metadata
            )
        stall = stall_seconds()
        job = {
            "directory": str(directory),
            "spare": None if spare is None else str(spare),
            "hold": str(self.hold) if self.hold else None,
            "die": self.die,
            "stall": self.stall,
            "beat": beat_seconds(stall),
            "payload": prepared,
        }
        # Every step with the writer, the job's sending included, waits at most `stall` seconds for the next sign of
        # progress (its heartbeat: writer_child.py); past it the writer is stuck and is killed.
        self._sock.settimeout(stall)
        try:
            if not self._ready:  # a job sent before the writer said it started: its word comes first
                self._ready = recv_msg(self._sock) == ("ready",)
            self._sync_maps()
            send_msg(self._sock, ("job", job))
            reply = recv_msg(self._sock) if self._ready else None
            while reply is not None and reply[0] == "progress":
                reply = recv_msg(self._sock)
        except TimeoutError:
            raise CheckpointError(self._stalled(directory, stall)) from None
        except OSError:
            reply = None
        finally:
            with contextlib.suppress(OSError):
                self._sock.settimeout(None)
        if reply is None:
            raise CheckpointError(
                f"{self._death()} while writing {directory}; the last complete checkpoint stays"
            )
        if reply[0] != "done":
            raise CheckpointError(f"the checkpoint writer process failed writing {directory}: {reply[1]}")
        digests.update(reply[2])
        self.finished = bool(reply[3])
        return list(reply[1])

    def _stalled(self, directory: Path, stall: float) -> str:
        """Kill a writer that made no progress for `stall` seconds (SIGKILL ends a stopped process too); the line."""
        self._proc.kill()
        self._proc.wait()
        return (
            f"the checkpoint writer process (pid {self._proc.pid}) made no progress for {stall:g} s while writing "
            f"{directory} and was killed ({envvars.PERSIST_STALL_S.name} sets the wait); the last complete "
            "checkpoint stays"
        )

    def _death(self) -> str:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return f"the checkpoint writer process (pid {self._proc.pid}) died ({how})"

    def close(self) -> None:
        """End the writer (EOF on its socket) and reap it; it finishes no job, since none is in flight then. A
        writer still starting is killed at once: it holds nothing yet, and it reads its socket only once its
        imports are done (a signal stop on a loaded host would wait for them here)."""
        try:
            started = self.ready()
        except (OSError, ValueError):  # closed already
            started = True
        with contextlib.suppress(OSError):
            self._sock.close()
        if not started:
            self._proc.kill()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


__all__ = ["PROCESS", "THREAD", "WriterProcess", "can_share", "describe", "writer_mode"]
