"""The data manifest: one JSON object per sample, and a fingerprint that does not change when the data moves.

A manifest may hold ten million samples, so it is never kept as Python objects: `Manifest` keeps where each record's
line lies in the file (and each sample's `length`) in numpy arrays and reads a record when it is asked for. Reading
every line (to check it and compute the fingerprint) costs a few microseconds a line, so a manifest of 32 MB or
more is read by one reader process per core this process may use (at most 16); the run keeps what that pass found
beside its copy of the manifest (`data/manifest.index.npz`, written by the trainer), so a relaunch, every rank but
rank 0, `ledger` and `status` read no line at all, only the file's SHA-256 or not even that.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import queue
import re
import secrets
import signal
import struct
import subprocess
import sys
import threading
import traceback
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from torchrelay.errors import ConfigError, DiskFull
from torchrelay.util.hashing import canonical_json, default_jobs

ROOT_TOKEN = "${DATA_ROOT}"
FINGERPRINT_VERSION = "fingerprint_v1"
INDEX_FORMAT = 1
INDEX_NAME = "manifest.index.npz"  # beside the run's copy, data/manifest.jsonl
_BLOCK = 1 << 22
# A manifest this big or bigger is parsed by reader processes (one per core this process may use, at most
# _MAX_READERS), _PART bytes of lines at a time: below, starting them costs more than they save.
_PARALLEL_FROM = 32 << 20
_PART = 1 << 20  # a reader holds about 20 times its part while it works on it
_MAX_READERS = 16
# str.splitlines() (what manifests were always split with) also breaks lines at these; a line holding one is
# split the same way so that every manifest keeps its records, and their indices.
_OTHER_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


_canonical = canonical_json


def _root_prefix(data_root: str) -> str:
    return data_root.rstrip("/") + "/" if data_root else ""


def _map_strings(obj: Any, fn: Any) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strings(v, fn) for v in obj]
    return obj


def index_path(manifest_path: str | os.PathLike[str]) -> Path:
    """Where the index of a run's manifest copy lies (data/manifest.index.npz)."""
    return Path(manifest_path).with_name(INDEX_NAME)


class Records(Sequence[dict[str, Any]]):
    """The manifest's records, each parsed from its line when asked for (picklable for DataLoader workers)."""

    def __init__(self, path: str, starts: np.ndarray, sizes: np.ndarray) -> None:
        self._path, self._starts, self._sizes = path, starts, sizes
        self._fd: int | None = None
        self._pid = 0

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._starts)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"manifest index {i} out of range ({n} samples)")
        rec: dict[str, Any] = json.loads(self.line(j))
        return rec

    def line(self, i: int) -> str:
        """The text of record i's line."""
        if self._fd is None or self._pid != os.getpid():  # a forked worker opens its own descriptor
            self._fd, self._pid = os.open(self._path, os.O_RDONLY), os.getpid()
        size = int(self._sizes[i])
        raw = os.pread(self._fd, size, int(self._starts[i]))
        if len(raw) != size:
            raise ConfigError(f"{self._path} changed while the run read it (record {i} is cut short)")
        return raw.decode("utf-8")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path, "starts": self._starts, "sizes": self._sizes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["starts"], state["sizes"])  # type: ignore[misc]

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


class Manifest:
    """The samples of a run, in file order; index i is the sample's identity in the ledger."""

    __slots__ = (
        "path",
        "data_root",
        "raw_sha256",
        "records",
        "indexed",
        "_fingerprint",
        "_lengths",
        "_bad_length",
    )

    def __init__(
        self,
        path: str,
        data_root: str,
        raw_sha256: str,
        starts: np.ndarray,
        sizes: np.ndarray,
        fingerprint: str,
        lengths: np.ndarray | None,
        bad_length: str | None,
    ) -> None:
        self.path, self.data_root, self.raw_sha256 = path, data_root, raw_sha256
        self.records = Records(path, starts, sizes)
        self._fingerprint, self._lengths, self._bad_length = fingerprint, lengths, bad_length
        self.indexed = False  # read from a saved index, not from the lines

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        data_root: str = "",
        *,
        index: str | os.PathLike[str] | None = None,
        sha256: str | None = None,
        readers: int | None = None,
    ) -> Manifest:
        """Read a JSONL manifest; every line needs a unique string `id`.

        index: a saved index (see `save_index`) used instead of reading every line when it was made from the same
        bytes (SHA-256) and data root; sha256: the file's digest as another rank of this launch computed it, so
        that this one does not hash the file again; readers: the processes that read every line when that is
        needed (None: one per core this process may use, at most 16, for a file of 32 MB or more; 1: none).
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data manifest {p} does not exist", hint="check the config field 'manifest'")
        if index is not None:
            found = _read_index(Path(index), p, data_root, sha256)
            if found is not None:
                return found
        return _scan(p, data_root, workers=readers)

    def save_index(self, path: str | os.PathLike[str]) -> None:
        """Keep what reading every line found, for the next `load` of the same bytes (atomically; a read-only
        place is no error: the next load reads the lines again)."""
        from torchrelay.fsutil import atomic_write_bytes

        meta = {
            "format": INDEX_FORMAT,
            "sha256": self.raw_sha256,
            "file_size": os.path.getsize(self.path),
            "root": _root_prefix(self.data_root),
            "fingerprint": self._fingerprint,
            "samples": len(self),
            "bad_length": self._bad_length,
        }
        arrays: dict[str, Any] = {"starts": self.records._starts, "sizes": self.records._sizes}
        if self._lengths is not None:
            arrays["lengths"] = self._lengths
        buf = io.BytesIO()
        np.savez(buf, meta=np.array(json.dumps(meta)), **arrays)
        with contextlib.suppress(OSError, DiskFull):
            atomic_write_bytes(path, buf.getbuffer())  # (no copy: 240 MB at 10 M samples)

    def __len__(self) -> int:
        return len(self.records)

    def sha256(self) -> str:
        """SHA-256 of the file's bytes (changes when the data root is rewritten)."""
        return self.raw_sha256

    def fingerprint(self) -> str:
        """Path-independent identity: the content with the data root replaced by a token."""
        return self._fingerprint

    def lengths(self) -> np.ndarray:
        """Per-sample lengths for the length-bucketed sampler (`length` field, default 1)."""
        if self._bad_length is not None:
            raise ConfigError(
                f"{self.path}: {self._bad_length}", hint="a sample's 'length' must be an integer"
            )
        if self._lengths is None:
            return np.ones(len(self), dtype=np.int64)
        return self._lengths

    def id_of(self, i: int) -> str:
        """The `id` of sample i (read from its line)."""
        return str(self.records[i]["id"])

    def paths(self) -> Iterator[str]:
        """Every string field that lies under the data root (the files the manifest names)."""
        prefix = _root_prefix(self.data_root)
        if not prefix:
            return
        for rec in self.records:
            for value in _iter_strings(rec):
                if value.startswith(prefix):
                    yield value

    def rebased_lines(self, new_root: str) -> list[str]:
        """The manifest's lines with the data root replaced by `new_root`."""
        old, new = _root_prefix(self.data_root), _root_prefix(new_root)
        if not old:
            raise ConfigError("the manifest has no data root to rebase (config field 'data_root' is empty)")

        def swap(s: str) -> str:
            return new + s[len(old) :] if s.startswith(old) else s

        return [json.dumps(_map_strings(rec, swap), ensure_ascii=False) for rec in self.records]

    def check_files(self) -> list[str]:
        """Paths under the data root that do not exist."""
        return [p for p in self.paths() if not os.path.exists(p)]


def _iter_strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _iter_strings(v)


def _file_sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _read_index(index: Path, path: Path, data_root: str, sha256: str | None) -> Manifest | None:
    """The saved index when it describes these bytes under this data root, else None (then the lines are read)."""
    if not index.is_file():  # absent, or no regular file (a pipe would block the read)
        return None
    try:
        with np.load(index, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT:
                return None
            if meta.get("root") != _root_prefix(data_root) or meta.get("file_size") != path.stat().st_size:
                return None
            starts, sizes = np.asarray(z["starts"]), np.asarray(z["sizes"])
            lengths = np.asarray(z["lengths"]) if "lengths" in z.files else None
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None  # no index, or not one this version reads: read the lines
    n = meta.get("samples")
    if (
        starts.dtype != np.int64
        or sizes.dtype != np.int64
        or starts.shape != (n,)
        or sizes.shape != (n,)
        or (lengths is not None and (lengths.dtype != np.int64 or lengths.shape != (n,)))
    ):
        return None
    digest = sha256 if sha256 is not None else _file_sha256(path)[0]
    if digest != meta.get("sha256"):
        return None
    bad = meta.get("bad_length")
    m = Manifest(
        str(path),
        data_root,
        digest,
        starts,
        sizes,
        str(meta["fingerprint"]),
        lengths,
        bad if isinstance(bad, str) else None,
    )
    m.indexed = True
    return m


class _LineError(Exception):
    """A line the manifest cannot have; its number counts from the first line of the part that was read."""

    def __init__(self, lineno: int, message: str, hint: str | None = None) -> None:
        super().__init__(lineno, message, hint)
        self.lineno, self.message, self.hint = lineno, message, hint


class _Scan:
    """What one pass over the lines (or one part of them, in a reader process) collects."""

    def __init__(self, data_root: str, sink: Any = None) -> None:
        self.prefix = _root_prefix(data_root)
        self.starts: array[int] = array("q")
        self.sizes: array[int] = array("q")
        self.lengths: array[int] = array("q")
        self.has_length = False
        self.bad_length: tuple[int, str] | None = None  # the first: its line, what is wrong
        self.id_hashes: array[int] = array("q")
        self.fp: Any = hashlib.sha256() if sink is None else sink  # takes the canonical bytes, in order
        self.encode = _encoder()
        # The root can be swapped for the token in the canonical text itself when it needs no escaping there:
        # a value string opens with `"` after `:` or `[`, and nothing else in compact JSON reads `:"` or `["`.
        p = self.prefix
        self.textual = bool(p) and p[0] not in ",:}]" and not any(c in p for c in '"\\') and p.isprintable()

    def strip(self, s: str) -> str:
        return ROOT_TOKEN + "/" + s[len(self.prefix) :] if s.startswith(self.prefix) else s

    def block(self, first_line: int, start: int, data: bytes) -> None:
        """Whole lines: parsed in one call when each is one object on its own line, else line by line."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        body = text[:-1]  # the last newline
        if not body or body[0] != "{" or body[-1] != "}" or body.count("}\n{") != body.count("\n"):
            return self.slow(first_line, start, data)
        lines = body.split("\n")
        try:
            # ",\n" keeps a raw newline between lines: a string cannot run from one line into the next.
            recs = json.loads("[" + ",\n".join(lines) + "]")
            ids = [r["id"] for r in recs]
        except (ValueError, RecursionError, TypeError, KeyError):
            return self.slow(first_line, start, data)
        if len(recs) != len(lines) or not all(type(r) is dict for r in recs):
            return self.slow(first_line, start, data)
        if not all(type(i) is str for i in ids):
            return self.slow(first_line, start, data)
        if data.isascii():
            sizes = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
        else:
            sizes = np.fromiter((len(x.encode()) for x in lines), dtype=np.int64, count=len(lines))
        offsets = np.cumsum(sizes + 1) - (sizes + 1) + start
        self.starts.frombytes(offsets.tobytes())
        self.sizes.frombytes(sizes.tobytes())
        self.id_hashes.extend(map(hash, ids))
        try:
            self.lengths.extend(map(int, [r.get("length", 1) for r in recs]))
        except (TypeError, ValueError, OverflowError):
            del self.lengths[len(self.sizes) - len(lines) :]
            for k, r in enumerate(recs):
                self.length(first_line + k, r)
        else:
            self.has_length = self.has_length or any("length" in r for r in recs)
        canon = "\n".join(map(self.encode, recs)) + "\n"
        if self.prefix:
            p, token = '"' + self.prefix, '"' + ROOT_TOKEN + "/"
            if self.textual and "{" + p not in canon and "," + p not in canon:
                canon = canon.replace(":" + p, ":" + token).replace("[" + p, "[" + token)
            else:
                canon = "\n".join(self.encode(_map_strings(r, self.strip)) for r in recs) + "\n"
        self.fp.update(canon.encode())

    def length(self, lineno: int, rec: dict[str, Any]) -> None:
        if "length" not in rec:
            self.lengths.append(1)
            return
        self.has_length = True
        try:
            self.lengths.append(int(rec["length"]))
        except (TypeError, ValueError, OverflowError):
            self.lengths.append(1)
            if self.bad_length is None:
                self.bad_length = (lineno, f"'length' {rec['length']!r} is not an integer")

    def slow(self, lineno: int, start: int, data: bytes) -> None:
        """Line by line, with the error of the first bad line."""
        for line in data[:-1].split(b"\n"):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _LineError(
                    lineno,
                    f"the data manifest is not UTF-8 text ({exc.reason} at byte {start + exc.start})",
                    "a manifest is JSON Lines in UTF-8; regenerate it or fix that line",
                ) from None
            if _OTHER_BREAKS.search(text) is None:
                self.record(lineno, start, text)
            else:
                at = start
                for part in text.splitlines(keepends=True):
                    self.record(lineno, at, (part.splitlines() or [""])[0])
                    at += len(part.encode())
            start += len(line) + 1
            lineno += 1

    def record(self, lineno: int, start: int, text: str) -> None:
        if not text.strip():
            return
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _LineError(lineno, f"not a JSON object ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # digits past int conversion, nesting past the parser
            raise _LineError(lineno, f"not a JSON object ({exc})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise _LineError(lineno, "each manifest line must be an object with a string 'id'")
        self.starts.append(start)
        self.sizes.append(len(text.encode()))
        self.id_hashes.append(hash(rec["id"]))
        self.length(lineno, rec)
        self.fp.update((self.encode(_map_strings(rec, self.strip) if self.prefix else rec) + "\n").encode())


def _encoder() -> Any:
    """The canonical encoder (sorted keys, no spaces, UTF-8), made once: one record is encoded per call."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode
    enc = make(None, None, json.encoder.encode_basestring, None, ":", ",", True, False, True)
    return lambda obj: "".join(enc(obj, 0))


def _scan(path: Path, data_root: str, *, workers: int | None = None, part: int = _PART) -> Manifest:
    """Read and check every line: UTF-8, one object with a string id each, ids unique; the fingerprint.

    A big file is parsed by reader processes, `part` bytes of whole lines each (see `_scan_parallel`); a small
    one, or where no process can be started, here."""
    if workers is None:
        workers = _reader_count() if _file_size(path) >= _PARALLEL_FROM else 1
    if workers > 1:
        found = _scan_parallel(path, data_root, workers, part)
        if found is not None:
            return found
    return _scan_here(path, data_root)


def _scan_here(path: Path, data_root: str) -> Manifest:
    s = _Scan(data_root)
    raw = hashlib.sha256()
    lineno = 1
    try:
        for start, data in _parts(path, _BLOCK, raw):
            s.block(lineno, start, data)
            lineno += data.count(b"\n")
    except _LineError as exc:
        raise _refusal(path, exc.lineno, exc) from None
    return _manifest(
        path,
        data_root,
        raw.hexdigest(),
        np.frombuffer(s.starts, dtype=np.int64),
        np.frombuffer(s.sizes, dtype=np.int64),
        s.fp.hexdigest(),
        np.frombuffer(s.lengths, dtype=np.int64) if s.has_length else None,
        s.bad_length,
        np.frombuffer(s.id_hashes, dtype=np.int64),
    )


def _refusal(path: Path, lineno: int, exc: _LineError) -> ConfigError:
    return ConfigError(f"{path}:{lineno}: {exc.message}", hint=exc.hint)


def _manifest(
    path: Path,
    data_root: str,
    raw_sha256: str,
    starts: np.ndarray,
    sizes: np.ndarray,
    fp_hex: str,
    lengths: np.ndarray | None,
    bad_length: tuple[int, str] | None,
    id_hashes: np.ndarray,
) -> Manifest:
    if not len(starts):
        raise ConfigError(f"data manifest {path} lists no samples")
    bad = f"line {bad_length[0]}: {bad_length[1]}" if bad_length is not None else None
    m = Manifest(
        str(path), data_root, raw_sha256, starts, sizes, f"{FINGERPRINT_VERSION}:{fp_hex}", lengths, bad
    )
    _check_unique(m, id_hashes)
    return m


def _parts(path: Path, size: int, raw: Any) -> Iterator[tuple[int, bytes]]:
    """The file as (offset, bytes) parts of about `size` bytes cut after a newline, each ending with one (the
    last line is given one when it has none); every byte read goes through `raw` (the file's SHA-256)."""
    pos, tail = 0, b""
    for block in _blocks(path, size):
        raw.update(block)
        data = tail + block
        cut = data.rfind(b"\n") + 1 if block else len(data)
        if not block and data and not data.endswith(b"\n"):
            data, cut = data + b"\n", len(data) + 1  # the last line, without its newline
        if cut:
            yield pos, data[:cut]
            pos += cut
        tail = data[cut:]


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


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # read here, which names the error


def _reader_count() -> int:
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
_READER = "import json, sys; sys.path[:0] = json.loads(sys.argv[3]); from torchrelay.manifest import _serve; _serve()"
_FRAME = struct.Struct("<qq")  # a part: its offset in the file, its size (-1: no more parts)


class _ReaderFailed(Exception):
    """A reader process could not be started or ended early: the file is read in this process instead."""


class _Changed(Exception):
    """The file changed while it was read."""


def _scan_parallel(path: Path, data_root: str, workers: int, part: int) -> Manifest | None:
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
) -> Manifest:
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
) -> Manifest:
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
    return _manifest(
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


def _blocks(path: Path, size: int = _BLOCK, f: io.BufferedReader | None = None) -> Iterator[bytes]:
    """The file in blocks, then one empty block."""
    try:
        with open(path, "rb") if f is None else contextlib.nullcontext(f) as src:
            while block := src.read(size):
                yield block
    except OSError as exc:
        raise ConfigError(
            f"data manifest {path} cannot be read ({exc.strerror or exc})", hint="check its permissions"
        ) from exc
    yield b""


def _check_unique(m: Manifest, hashes: np.ndarray) -> None:
    """Ids are unique: equal hashes are the only candidates, and their ids are compared for real."""
    ranked = np.sort(hashes)  # a plain sort: half the time of an argsort, and almost always the end
    same = ranked[1:][ranked[1:] == ranked[:-1]]
    if not len(same):
        return
    candidates = np.flatnonzero(np.isin(hashes, same))
    first: dict[str, int] = {}
    repeated: list[int] = []
    for i in candidates.tolist():  # ascending: the first of each id is met first
        rid = m.id_of(i)
        if rid in first:
            repeated.append(i)
        else:
            first[rid] = i
    if repeated:
        i = min(repeated)
        lineno, left = 1, int(m.records._starts[i])
        with open(m.path, "rb") as f:
            while left > 0 and (block := f.read(min(left, _BLOCK))):
                lineno += block.count(b"\n")
                left -= len(block)
        raise ConfigError(f"{m.path}:{lineno}: duplicate sample id {m.id_of(i)!r}")
