"""The data manifest: one JSON object per sample, and a fingerprint that does not change when the data moves.

A manifest may hold ten million samples, so it is never kept as Python objects: `Manifest` keeps where each record's
line lies in the file (and each sample's `length`) in numpy arrays and reads a record when it is asked for. Reading
every line (to check it and compute the fingerprint) costs a few microseconds a line; the run keeps what that pass
found beside its copy of the manifest (`data/manifest.index.npz`, written by the trainer), so a relaunch, every
rank but rank 0, `ledger` and `status` read no line at all, only the file's SHA-256 or not even that.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from torchrelay.errors import ConfigError, DiskFull
from torchrelay.util.hashing import canonical_json

ROOT_TOKEN = "${DATA_ROOT}"
FINGERPRINT_VERSION = "fingerprint_v1"
INDEX_FORMAT = 1
INDEX_NAME = "manifest.index.npz"  # beside the run's copy, data/manifest.jsonl
_BLOCK = 1 << 22
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
    ) -> Manifest:
        """Read a JSONL manifest; every line needs a unique string `id`.

        index: a saved index (see `save_index`) used instead of reading every line when it was made from the same
        bytes (SHA-256) and data root; sha256: the file's digest as another rank of this launch computed it, so
        that this one does not hash the file again.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data manifest {p} does not exist", hint="check the config field 'manifest'")
        if index is not None:
            found = _read_index(Path(index), p, data_root, sha256)
            if found is not None:
                return found
        return _scan(p, data_root)

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
            atomic_write_bytes(path, buf.getvalue())

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


class _Scan:
    """What one pass over the lines collects."""

    def __init__(self, path: Path, data_root: str) -> None:
        self.path = path
        self.prefix = _root_prefix(data_root)
        self.starts: array[int] = array("q")
        self.sizes: array[int] = array("q")
        self.lengths: array[int] = array("q")
        self.has_length = False
        self.bad_length: str | None = None
        self.id_hashes: array[int] = array("q")
        self.fp = hashlib.sha256()
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
                self.bad_length = f"line {lineno}: 'length' {rec['length']!r} is not an integer"

    def slow(self, lineno: int, start: int, data: bytes) -> None:
        """Line by line, with the error of the first bad line."""
        for line in data[:-1].split(b"\n"):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{self.path}:{lineno}: the data manifest is not UTF-8 text ({exc.reason} at byte "
                    f"{start + exc.start})",
                    hint="a manifest is JSON Lines in UTF-8; regenerate it or fix that line",
                ) from exc
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
            raise ConfigError(f"{self.path}:{lineno}: not a JSON object ({exc.msg})") from exc
        except (ValueError, RecursionError) as exc:  # digits past int conversion, nesting past the parser
            raise ConfigError(f"{self.path}:{lineno}: not a JSON object ({exc})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ConfigError(
                f"{self.path}:{lineno}: each manifest line must be an object with a string 'id'"
            )
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


def _scan(path: Path, data_root: str) -> Manifest:
    """Read and check every line: UTF-8, one object with a string id each, ids unique; the fingerprint."""
    s = _Scan(path, data_root)
    raw = hashlib.sha256()
    pos, lineno, tail = 0, 1, b""
    for block in _blocks(path):
        raw.update(block)
        data = tail + block
        cut = data.rfind(b"\n") + 1 if block else len(data)
        if not block and data and not data.endswith(b"\n"):
            data, cut = data + b"\n", len(data) + 1  # the last line, without its newline
        if cut:
            s.block(lineno, pos, data[:cut])
            lineno += data.count(b"\n", 0, cut)
            pos += cut
        tail = data[cut:]
    n = len(s.starts)
    if not n:
        raise ConfigError(f"data manifest {path} lists no samples")
    m = Manifest(
        str(path),
        data_root,
        raw.hexdigest(),
        np.frombuffer(s.starts, dtype=np.int64),
        np.frombuffer(s.sizes, dtype=np.int64),
        f"{FINGERPRINT_VERSION}:{s.fp.hexdigest()}",
        np.frombuffer(s.lengths, dtype=np.int64) if s.has_length else None,
        s.bad_length,
    )
    _check_unique(m, np.frombuffer(s.id_hashes, dtype=np.int64))
    return m


def _blocks(path: Path) -> Iterator[bytes]:
    """The file in blocks, then one empty block."""
    try:
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                yield block
    except OSError as exc:
        raise ConfigError(
            f"data manifest {path} cannot be read ({exc.strerror or exc})", hint="check its permissions"
        ) from exc
    yield b""


def _check_unique(m: Manifest, hashes: np.ndarray) -> None:
    """Ids are unique: equal hashes are the only candidates, and their ids are compared for real."""
    order = np.argsort(hashes, kind="stable")
    ranked = hashes[order]
    same = np.flatnonzero(ranked[1:] == ranked[:-1])
    if not len(same):
        return
    candidates = np.unique(np.concatenate([order[same], order[same + 1]]))
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
