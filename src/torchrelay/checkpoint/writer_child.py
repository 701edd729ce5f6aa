"""The writer process (writer_process.py): `python -m torchrelay.checkpoint.writer_child <socket fd> <parent pid>`.

It maps the parent's shared host buffers, runs the DCP write jobs the parent sends on them with the same writer
as the persist thread's (`HashingWriter`), answers each with DCP's write results and the files' digests, and ends
when its parent does: the parent-death signal, or EOF on the socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

# A stop by signal (SIGTERM from Slurm or torchrun, which signals each rank's whole process group; SIGINT from a
# terminal) reaches the writer too: the parent saves once more on its way out, and its writer must live to write
# that checkpoint. It ends with its parent instead (the parent-death signal, EOF). Ignored before the imports
# below (torch's: seconds of CPU on a small host): a stop during them killed a writer just started, and the stop's
# save waited for another's start-up, past torchrun's grace on a loaded host (a writer ended by the SIGTERM of a
# signal stop failed that stop's save).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
if __name__ == "__main__":
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)

import torch  # noqa: E402 - after the signals are ignored (above)

from torchrelay.checkpoint.dcp_save import set_up_writer  # noqa: E402
from torchrelay.checkpoint.hashing_writer import HashingWriter  # noqa: E402
from torchrelay.checkpoint.host_buffers import BACKGROUND_NICE  # noqa: E402
from torchrelay.checkpoint.persist import writeback_kib  # noqa: E402
from torchrelay.checkpoint.writer_process import recv_fds, recv_msg, send_msg  # noqa: E402
from torchrelay.config.tuning import SaveTuning  # noqa: E402

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent ends (Linux), and end now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        sys.exit(0)


class _Resolved:
    """The planner the writer's DCP code asks for each item's data: the items the parent resolved."""

    def __init__(self, items: list[tuple[Any, tuple[Any, ...]]], maps: dict[int, mmap.mmap]) -> None:
        self._data = {index: _rebuild(spec, maps) for index, spec in items}

    def resolve_data(self, item: Any) -> Any:
        return self._data[item.index]


def _rebuild(spec: tuple[Any, ...], maps: dict[int, mmap.mmap]) -> Any:
    """The parent's tensor (its storage of the same bytes, the same view of it) or BytesIO, over our mappings."""
    kind = spec[0]
    if kind == "bytes":
        return io.BytesIO(spec[1])
    if kind == "tensor":
        return spec[1]
    _, key, offset, nbytes, dtype, storage_offset, shape, stride = spec
    flat = torch.frombuffer(maps[key], dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).as_strided(shape, stride, storage_offset)


def _update_maps(sock: socket.socket, maps: dict[int, mmap.mmap], keep: list[int], new: list[Any]) -> None:
    for key in set(maps) - set(keep):
        del maps[key]  # closed once nothing views it
    fds = recv_fds(sock, len(new))
    for (key, size), fd in zip(new, fds, strict=True):
        maps[key] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        os.close(fd)


def _heartbeat(sock: socket.socket, writer: HashingWriter, every: float, done: threading.Event) -> None:
    """Tell the parent, every `every` seconds, whether the write moved since it was last told: bytes handed to the
    kernel, files fsynced, or, while an fsync is in flight, the kernel's writeback (a slow disk's one fsync can
    take longer than the parent's deadline). Silent while nothing moves: the parent's deadline then runs."""
    told: tuple[int, int | None] = (writer.progress()[0], None)
    while not done.wait(every):
        written, syncing = writer.progress()
        now = (written, writeback_kib() if syncing else None)
        if now != told:
            send_msg(sock, ("progress",))
            told = now


def _write(
    sock: socket.socket, job: dict[str, Any], maps: dict[int, mmap.mmap]
) -> tuple[list[Any], dict[str, tuple[str, int]], bool]:
    digests: dict[str, tuple[str, int]] = {}
    job = {**job, **pickle.loads(job["payload"])}  # noqa: S301 - the parent's own job (WriterProcess.prepare)
    finishes = job.get("metadata") is not None
    spare = None if job["spare"] is None else Path(job["spare"])
    tuning = SaveTuning(
        persist_streams=job["streams"], kick_bytes=job["kick"]
    )  # the parent's (WriterProcess._job)
    writer = HashingWriter(Path(job["directory"]), digests, background=True, spare=spare, tuning=tuning)
    set_up_writer(writer, job["coordinator"], job["rank"])
    writer.files = job["files"]
    # crash tests only (kill_points.STALL): stopped inside a write, left to the parent's deadline
    if job["stall"]:
        writer.on_piece(lambda: os.kill(os.getpid(), signal.SIGSTOP))
    done = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(sock, writer, job["beat"], done), daemon=True)
    beat.start()
    try:
        writer.fs.mkdir(writer.path)
        hold = job["hold"]
        while hold and not os.path.exists(hold):  # tests only (WriterProcess.hold)
            time.sleep(0.01)
        writes = writer.write_data(job["plan"], _Resolved(job["items"], maps))
        writes.wait()
        if finishes:  # one rank: its results are the save's, and `.metadata` is written here
            writer.finish(metadata=job["metadata"], results=[list(writes.value())])
    finally:
        done.set()
        beat.join()  # its last word is sent before the answer: one sender on the socket at a time
    if job["die"]:  # crash tests only (kill_points.WRITER): dead with its files written, before it answers
        os.kill(os.getpid(), signal.SIGKILL)
    return list(writes.value()), digests, finishes


def main(argv: list[str]) -> int:
    """Serve the parent's jobs until it closes the socket or ends."""
    fd, parent = int(argv[0]), int(argv[1])
    _die_with(parent)
    for sig in STOP_SIGNALS:  # ignored already when run as the writer (above); main() alone ignores them too
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # the writer threads DCP starts inherit it
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), BACKGROUND_NICE))
    sock = socket.socket(fileno=fd)
    try:
        send_msg(sock, ("ready",))  # its imports are done: the parent may send it jobs (WriterProcess.ready)
    except OSError:  # the parent closed the socket while it started: it has ended, or is ending
        return 0
    maps: dict[int, mmap.mmap] = {}
    while True:
        try:
            msg = recv_msg(sock)
        except ConnectionResetError:
            # The parent ended with a message of ours unread (its `ready`, when no save used this writer): the
            # kernel resets the socket instead of closing it. The parent's end all the same, said by the parent.
            return 0
        if msg is None:
            return 0
        if msg[0] == "maps":
            _update_maps(sock, maps, msg[1], msg[2])
            continue
        try:
            results, digests, finished = _write(sock, msg[1], maps)
        except Exception as exc:  # noqa: BLE001 - one line to the parent, which raises it as a CheckpointError
            send_msg(sock, ("error", f"{type(exc).__name__}: {exc}"))
        else:
            send_msg(sock, ("done", results, digests, finished))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
