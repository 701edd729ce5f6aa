"""Reader processes: a big manifest's pass over its lines (scan.py) split into parts read by fresh interpreters."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import queue
import secrets
import signal
import struct
import subprocess
import sys
import threading
import traceback
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchrelay.errors import ConfigError
from torchrelay.manifest.scan import Scanned, _blocks, _LineError, _refusal, _Scan, _scanned
from torchrelay.util.hashing import default_jobs

_MAX_READERS = 16


def _cuts(path: Path, f: io.BufferedReader, size: int, raw: Any) -> Iterator[tuple[int, int]]:
    """`_parts` without their bytes: (offset, size) of each, every byte read going through `raw`."""
    pos = start = 0
    for block in _blocks(path, size, f):
        raw.update(block)
        if not block:
            end = pos  # the last line, without its newline
        elif (nl := block.rfind(b"\n")) >= 0:
            end = pos + nl + 1
        else:
            end = start  # a line longer than a part goes on
        pos += len(block)
        if end > start:
            yield start, end - start
            start = end


def reader_count() -> int:
    """The cores this process may use (its affinity: a Slurm or taskset binding), at most `_MAX_READERS`."""
    return min(default_jobs(), _MAX_READERS)


# ------------------------------------------------------------------------------------------ reader processes
# The pass costs about 2 µs a line in CPython's JSON parse and canonical encode (10 M lines: 20-40 s on one core),
# so a big manifest is parsed by `workers` processes, each given `part` bytes of whole lines at a time. They read
# their parts from the file this process opened (its descriptor is passed on: a file renamed over the path
# meanwhile is not read), this process reads it once for its SHA-256 and for where the parts are cut, deals the
# parts out in turn and takes the results back in file order: the canonical bytes go into the fingerprint's
# SHA-256 (which cannot be split) and the line numbers of a refusal, counted from its part's first line, become
# the file's. The readers are fresh interpreters that import only this module and numpy: `fork` is unsafe once
# torch's threads exist, and multiprocessing's `spawn` and `forkserver` would import the training script
# (`__main__`), torch with it, in every reader. They share one PYTHONHASHSEED so that their 64-bit id hashes can
# be compared.
_READER = "import json, sys; sys.path[:0] = json.loads(sys.argv[3]); from torchrelay.manifest.readers import _serve; _serve()"
_FRAME = struct.Struct("<qq")  # a part: its offset in the file, its size (-1: no more parts)


class _ReaderFailed(Exception):
    """A reader process could not be started or ended early: the file is read in this process instead."""


class _Changed(Exception):
    """The file changed while it was read."""


def scan_parallel(path: Path, data_root: str, workers: int, part: int) -> Scanned | None:
    """The pass over `path` by `workers` reader processes; None when they could not do it (then the caller
    reads it here: the result is the same, only slower)."""
    if not sys.executable:  # an embedded interpreter: no Python to start
        return None
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the readers that share it
    except OSError:
        return None  # read here, which names the error
    env = {**os.environ, "PYTHONHASHSEED": str(secrets.randbelow(2**32)), "OMP_NUM_THREADS": "1"}
    search = json.dumps([p for p in sys.path if p])  # where this process found torchrelay and numpy
    procs: list[subprocess.Popen[bytes]] = []
    try:
        before = os.fstat(f.fileno())
        for _ in range(workers):
            proc = subprocess.Popen(
                # -P: the working directory is not searched (a json.py there would shadow the standard one)
                [sys.executable, "-P", "-c", _READER, data_root, str(f.fileno()), search],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(f.fileno(),),
                env=env,
                start_new_session=True,  # a Ctrl-C or a job's signal is this process's to handle
            )
            procs.append(proc)
            with contextlib.suppress(AttributeError, OSError):  # fewer wake-ups to take a result in
                fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)  # type: ignore[union-attr]
        m = _deal(path, f, data_root, procs, part)
        after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise _Changed
        return m
    except (_ReaderFailed, OSError):
        return None
    except _Changed:
        raise ConfigError(
            f"data manifest {path} changed while it was read", hint="open the run again once it is written"
        ) from None
    finally:
        for proc in procs:
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=30)  # no more parts, or a broken pipe: each ends within one part
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        f.close()


class _HashThread:
    """SHA-256 on its own thread (hashlib lets go of the GIL), fed bytes in order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        # Bounded: where the hash falls behind (cores busy elsewhere), the reading waits instead of piling up.
        self._todo: queue.Queue[bytes | None] = queue.Queue(maxsize=32)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._todo.get()) is not None:
            self._h.update(data)

    def update(self, data: bytes) -> None:
        self._todo.put(data)

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()


def _deal(
    path: Path, f: io.BufferedReader, data_root: str, procs: list[subprocess.Popen[bytes]], part: int
) -> Scanned:
    raw, fp = _HashThread(), _HashThread()
    try:
        return _deal_hashed(path, f, data_root, procs, part, raw, fp)
    finally:
        raw.close()
        fp.close()


def _deal_hashed(
    path: Path,
    f: io.BufferedReader,
    data_root: str,
    procs: list[subprocess.Popen[bytes]],
    part: int,
    raw: _HashThread,
    fp: _HashThread,
) -> Scanned:
    # Grown in place as the results come (as in one process): a list of parts' arrays joined at the end would
    # leave their memory to the allocator, not the system (+190 MB at 10 M lines, measured).
    starts, sizes, lengths, hashes = array("q"), array("q"), array("q"), array("q")
    has_length, bad_length, lineno = False, None, 1
    todo = _cuts(path, f, part, raw)
    sent = taken = 0
    more = True
    while True:
        # Two parts in flight per reader: each has the next while this process takes the last from it.
        while more and sent - taken < 2 * len(procs):
            nxt = next(todo, None)
            if nxt is None:
                more = False
                break
            _send(procs[sent % len(procs)], *nxt)
            sent += 1
        if taken == sent:
            break
        got = _receive(procs[taken % len(procs)])
        taken += 1
        if got["error"] is not None:
            rel, message, hint = got["error"]
            raise _refusal(path, lineno + rel - 1, _LineError(rel, message, hint))
        if bad_length is None and got["bad_length"] is not None:
            rel, text = got["bad_length"]
            bad_length = (lineno + rel - 1, text)
        lineno += got["lines"]
        fp.update(got["canonical"])
        starts.frombytes(got["starts"])
        sizes.frombytes(got["sizes"])
        lengths.frombytes(got["lengths"])
        hashes.frombytes(got["hashes"])
        has_length = has_length or got["has_length"]
    for proc in procs:
        _send(proc, -1, -1)
    return _scanned(
        path,
        data_root,
        raw.hexdigest(),
        np.frombuffer(starts, dtype=np.int64),
        np.frombuffer(sizes, dtype=np.int64),
        fp.hexdigest(),
        np.frombuffer(lengths, dtype=np.int64) if has_length else None,
        bad_length,
        np.frombuffer(hashes, dtype=np.int64),
    )


def _send(proc: subprocess.Popen[bytes], start: int, size: int) -> None:
    try:
        proc.stdin.write(_FRAME.pack(start, size))  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    except (OSError, ValueError) as exc:
        raise _ReaderFailed from exc


def _receive(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out = proc.stdout
    assert out is not None
    try:
        head = out.read(8)
        size = struct.unpack("<q", head)[0] if len(head) == 8 else -1
        body = out.read(size) if size >= 0 else b""
        if size < 0 or len(body) != size:
            raise _ReaderFailed(f"reader {proc.pid} ended ({proc.poll()})")
        got: dict[str, Any] = pickle.loads(body)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise _ReaderFailed from exc
    if "crash" in got:  # a defect in the reader itself, not in the file: read it here, which shows it
        raise _ReaderFailed(got["crash"])
    if "changed" in got:
        raise _Changed
    return got


def _serve() -> None:
    """A reader process: parts to read named on stdin, results out on stdout, until no more or a pipe closes."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, getattr(signal, "SIGUSR1", None)):
        if signum is not None:
            signal.signal(signum, signal.SIG_IGN)  # it ends when its parent stops feeding it
    data_root, fd = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints cannot mix into the results
    inp = sys.stdin.buffer
    while len(head := inp.read(_FRAME.size)) == _FRAME.size:
        start, size = _FRAME.unpack(head)
        if size < 0:
            return
        try:
            data = os.pread(fd, size, start)
            got = _scan_part(data_root, start, data) if len(data) == size else {"changed": True}
        except Exception:  # noqa: BLE001 - reported to the parent, which then reads the file itself
            got = {"crash": traceback.format_exc()}
        body = pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            out.write(struct.pack("<q", len(body)))
            out.write(body)
            out.flush()
        except OSError:
            return  # the parent is gone, or stopped reading (a refusal)


def _scan_part(data_root: str, start: int, data: bytes) -> dict[str, Any]:
    """One part's share of the pass, its line numbers counted from its first line."""
    canonical: list[bytes] = []
    s = _Scan(data_root, _Sink(canonical))
    lines = data.count(b"\n")
    if not data.endswith(b"\n"):
        data += b"\n"  # the file's last line, without its newline
    got: dict[str, Any] = {"lines": lines, "error": None, "bad_length": None}
    try:
        s.block(1, start, data)
    except _LineError as exc:
        got["error"] = (exc.lineno, exc.message, exc.hint)
        return got
    got.update(
        canonical=b"".join(canonical),
        starts=s.starts.tobytes(),
        sizes=s.sizes.tobytes(),
        lengths=s.lengths.tobytes(),
        hashes=s.id_hashes.tobytes(),
        has_length=s.has_length,
        bad_length=s.bad_length,
    )
    return got


class _Sink:
    """Collects the canonical bytes where the pass in one process hashes them."""

    def __init__(self, into: list[bytes]) -> None:
        self.update = into.append
