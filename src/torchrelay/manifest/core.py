"""The manifest's records and its saved index: what a run keeps of its manifest, read when asked for."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from torchrelay.errors import ConfigError, DiskFull
from torchrelay.manifest import readers
from torchrelay.manifest.index import (
    _INDEX_UNREADABLE,
    INDEX_FORMAT,
    _header_fits,
    _lengths_match,
    _lines_match,
    _meta,
)
from torchrelay.manifest.scan import (
    _BLOCK,
    _PART,
    FINGERPRINT_VERSION,
    Scanned,
    _file_size,
    _map_strings,
    _root_prefix,
    _scan_here,
)
from torchrelay.paths.layout import INDEX_NAME
from torchrelay.util.hashing import sha256_file
from torchrelay.util.safepath import ensure_inside, open_regular

# A manifest this big or bigger is parsed by reader processes (one per core this process may use, at most
# readers._MAX_READERS), _PART bytes of lines at a time: below, starting them costs more than they save.
_PARALLEL_FROM = 32 << 20


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

    # os's functions bound here: at the interpreter's end this may run after the module's globals are torn down
    # (`os` None), where a lookup would add "Exception ignored in ... __del__" under a script's own traceback
    def __del__(self, _getpid: Any = os.getpid, _close: Any = os.close) -> None:
        if self._fd is not None and self._pid == _getpid():
            _close(self._fd)


class Manifest:
    """The samples of a run, in file order; index i is the sample's identity in the ledger."""

    __slots__ = (
        "path",
        "data_root",
        "raw_sha256",
        "records",
        "indexed",
        "index_current",
        "_fingerprint",
        "_lengths",
        "_bad_length",
        "_lengths_digest",
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
        self._lengths_digest: str | None = None
        self.indexed = False  # read from a saved index, not from the lines
        self.index_current = False  # the saved index describes these bytes: nothing to write again

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        data_root: str = "",
        *,
        index: str | os.PathLike[str] | None = None,
        sha256: str | None = None,
        readers: int | None = None,
        root: str | os.PathLike[str] | None = None,
        bound_sha256: str | None = None,
    ) -> Manifest:
        """Read a JSONL manifest; every line needs a unique string `id`.

        index: a saved index (see `save_index`) used instead of reading every line when it was made from the same
        bytes (SHA-256) and data root; sha256: the file's digest as another rank of this launch computed it, so
        that this one does not hash the file again; readers: the processes that read every line when that is
        needed (None: one per core this process may use, at most 16, for a file of 32 MB or more; 1: none);
        root: the run directory whose own copy (data/manifest.jsonl) this is. Its copy is opened as every file of a
        run is (`safepath.open_regular`): a link that leads out of the run, a pipe or a device is refused naming
        it (a link inside the run is followed). None for the user's own manifest, whose link is theirs.
        bound_sha256: the SHA-256 a run's contract binds (`data.sha256`, contract.contract_manifest): the index's
        fingerprint is believed only for those bytes, since whoever rewrites the manifest can rewrite its index
        to match; other bytes (a rebased copy, a replaced one) are read line by line. None: no contract is
        checked, and an index describing the bytes is used.
        """
        p = Path(path)
        if root is not None:
            _check_run_copy(p, Path(root), None if index is None else Path(index))
        if not p.is_file():
            if not os.path.lexists(p) or (p.is_symlink() and not p.exists()):
                raise ConfigError(
                    f"data manifest {p} does not exist", hint="check the config field 'manifest'"
                )
            # a folder, a pipe or a device: there, but no file of lines (it was said not to exist)
            kind = "a directory" if p.is_dir() else "not a regular file (a pipe or a device)"
            raise ConfigError(
                f"data manifest {p} is {kind}",
                hint="a manifest is a JSON Lines file; check the config field 'manifest'",
            )
        found = None if index is None else _read_index(Path(index), p, data_root, sha256)
        if found is not None and (bound_sha256 is None or found.raw_sha256 == bound_sha256):
            return found
        said = None if found is None else (found.raw_sha256, found._fingerprint)
        del found  # its arrays go before the lines' are built (10 M samples: 240 MB)
        read = scan(p, data_root, workers=readers)
        if said == (read.raw_sha256, read._fingerprint):
            read.index_current = True  # the index was right, only not vouched for: nothing to write again
        return read

    def save_index(self, path: str | os.PathLike[str]) -> None:
        """Keep what reading every line found, for the next `load` of the same bytes (atomically; a read-only
        place is no error: the next load reads the lines again)."""
        from torchrelay.util.durable import atomic_write_bytes

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

    def written_under(self, data_root: str) -> bool:
        """Whether this manifest was read under `data_root` (the same prefix, a trailing "/" aside)."""
        return _root_prefix(self.data_root) == _root_prefix(data_root)

    def rebase_into(
        self, dest: str | os.PathLike[str], new_root: str, *, index: str | os.PathLike[str] | None = None
    ) -> Manifest:
        """Write the manifest re-pointed at `new_root` to `dest` (a temporary, fsynced, renamed) and read it back,
        every line: its fingerprint must be this one's, else nothing replaces `dest` (ConfigError naming the field).
        A manifest read without a data root names no path to re-point: its bytes are kept, its fingerprint checked.
        index: where to save the new bytes' index, before they replace `dest` (so an index names the root of the
        bytes, or of the bytes about to be: a run finds the root of its copy by it after a kill in between)."""
        from torchrelay.util.durable import fsync_dir, open_temp, temp_prefix

        dest = Path(dest)
        tmp = dest.with_name(f"{temp_prefix(dest.name)}{os.getpid()}")
        try:
            with os.fdopen(open_temp(tmp), "wb") as out:
                if _root_prefix(self.data_root):
                    for line in self.rebased_lines(new_root):
                        out.write(line.encode() + b"\n")
                else:
                    with open(self.path, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            rebased = scan(tmp, new_root)
            if rebased.fingerprint() != self.fingerprint():
                raise ConfigError(
                    f"data_root: {self.path} re-pointed from {self.data_root!r} to {new_root!r} lists other "
                    f"samples (fingerprint {self.fingerprint()} -> {rebased.fingerprint()})",
                    hint="keep the run's data_root, or give one under which its manifest names the same files",
                )
            if index is not None:
                rebased.save_index(index)
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        moved = Manifest(
            str(dest),
            new_root,
            rebased.raw_sha256,
            rebased.records._starts,
            rebased.records._sizes,
            rebased._fingerprint,
            rebased._lengths,
            rebased._bad_length,
        )
        moved.index_current = index is not None
        return moved

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

    def lengths_sha256(self) -> str:
        """SHA-256 of the per-sample lengths as the sampler uses them (int64, little-endian; a bad `length`: of
        its message), recorded in the contract (`data.lengths_sha256`): a saved index's lengths are believed only
        when they give it (contract.contract_manifest), checked whole, not at a spread of positions (10 M samples:
        see docs/FORMATS.md for the cost)."""
        if self._lengths_digest is None:
            if self._bad_length is not None:
                digest = hashlib.sha256(f"bad_length:{self._bad_length}".encode()).hexdigest()
            else:
                digest = hashlib.sha256(np.ascontiguousarray(self.lengths(), dtype="<i8").data).hexdigest()
            self._lengths_digest = digest
        return self._lengths_digest

    def id_of(self, i: int) -> str:
        """The `id` of sample i (read from its line)."""
        return str(self.records[i]["id"])

    def paths(self, as_root: str | None = None) -> Iterator[str]:
        """Every string field that lies under the data root (the files the manifest names); with `as_root`, each
        re-pointed at that root (the files it names once `rebase_into` re-points it there)."""
        prefix = _root_prefix(self.data_root)
        if not prefix:
            return
        new = prefix if as_root is None else _root_prefix(as_root)
        for rec in self.records:
            for value in _iter_strings(rec):
                if value.startswith(prefix):
                    yield new + value[len(prefix) :]

    def rebased_lines(self, new_root: str) -> list[str]:
        """The manifest's lines with the data root replaced by `new_root`."""
        old, new = _root_prefix(self.data_root), _root_prefix(new_root)
        if not old:
            raise ConfigError("the manifest has no data root to rebase (config field 'data_root' is empty)")

        def swap(s: str) -> str:
            return new + s[len(old) :] if s.startswith(old) else s

        return [json.dumps(_map_strings(rec, swap), ensure_ascii=False) for rec in self.records]

    def check_files(self, as_root: str | None = None) -> list[str]:
        """Paths under the data root (re-pointed at `as_root`, if given) that do not exist."""
        return [p for p in self.paths(as_root) if not os.path.exists(p)]


def _check_run_copy(path: Path, root: Path, index: Path | None) -> None:
    """Refuse a run's copy of its manifest (and its saved index) that leads out of the run, or that is a pipe or a
    device, before a byte is read: a plain open followed a link planted at data/manifest.jsonl to wherever it led.
    A missing file or a folder is left to `Manifest.load` to word."""
    hint = "a run directory holds its files, never links out of it; replace the link with the file itself"
    files = [(path, "the run's copy of the data manifest")]
    if index is not None and os.path.lexists(index):  # no index: the lines are read
        files.append((index, "the run's index of its manifest"))
    for p, what in files:
        ensure_inside(root, p, source=what, hint=hint)
        try:
            fd, _ = open_regular(os.path.realpath(p) if os.path.islink(p) else p, what=what, root=root)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        os.close(fd)


def _iter_strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _iter_strings(v)


def _read_index(index: Path, path: Path, data_root: str, sha256: str | None) -> Manifest | None:
    """The saved index when it describes these bytes under this data root, else None (then the lines are read).

    The index is a cache: it can never decide which sample an index names. Its meta must match the file (SHA-256,
    size, data root), its entries must be the file's own lines in order (`_lines_match`, checked against the
    bytes) and the `length`s of a spread of them must be their lines' (`_lengths_match`); anything else, a damaged
    or foreign file included, reads the lines again."""
    if not index.is_file():  # absent, or no regular file (a pipe would block the read)
        return None
    try:
        with np.load(index, allow_pickle=False) as z:
            # Each array's header is read before the array: a zip inflates 1000 to 1, so a few MB of index could
            # ask for more memory than the host has. The meta is a line of text; each array holds one int64 per
            # sample, and a sample is a line of the manifest, so there are no more of them than its bytes.
            if not _header_fits(z, "meta", None):
                return None
            meta = _meta(str(z["meta"]), index)
            if meta is None:
                return None
            file_size = path.stat().st_size
            if meta.get("root") != _root_prefix(data_root) or meta.get("file_size") != file_size:
                return None
            n = meta.get("samples")
            if type(n) is not int or not 0 <= n <= file_size:
                return None
            arrays = [name for name in ("starts", "sizes", "lengths") if name in z.files]
            if not all(_header_fits(z, name, n) for name in arrays):
                return None
            starts, sizes = np.asarray(z["starts"]), np.asarray(z["sizes"])
            lengths = np.asarray(z["lengths"]) if "lengths" in z.files else None
    except _INDEX_UNREADABLE:
        return None
    n, fingerprint, bad = meta.get("samples"), meta.get("fingerprint"), meta.get("bad_length")
    if (
        type(n) is not int
        or not isinstance(fingerprint, str)
        or not fingerprint.startswith(FINGERPRINT_VERSION + ":")
        or not (bad is None or isinstance(bad, str))
        or starts.dtype != np.int64
        or sizes.dtype != np.int64
        or starts.shape != (n,)
        or sizes.shape != (n,)
        or (lengths is not None and (lengths.dtype != np.int64 or lengths.shape != (n,)))
    ):
        return None
    digest = sha256 if sha256 is not None else sha256_file(path)[0]
    if digest != meta.get("sha256") or not _lines_match(path, starts, sizes):
        return None
    m = Manifest(str(path), data_root, digest, starts, sizes, fingerprint, lengths, bad)
    if not _lengths_match(m, lengths, bad):
        return None
    m.indexed = m.index_current = True
    return m


def scan(path: Path, data_root: str, *, workers: int | None = None, part: int = _PART) -> Manifest:
    """Read and check every line: UTF-8, one object with a string id each, ids unique; the fingerprint.

    A big file is parsed by reader processes, `part` bytes of whole lines each (see `_scan_parallel`); a small
    one, or where no process can be started, here."""
    if workers is None:
        workers = readers.reader_count() if _file_size(path) >= _PARALLEL_FROM else 1
    if workers > 1:
        found = readers.scan_parallel(path, data_root, workers, part)
        if found is not None:
            return _from_scanned(found)
    return _from_scanned(_scan_here(path, data_root))


def _from_scanned(found: Scanned) -> Manifest:
    m = Manifest(
        str(found.path),
        found.data_root,
        found.raw_sha256,
        found.starts,
        found.sizes,
        found.fingerprint,
        found.lengths,
        found.bad_length,
    )
    _check_unique(m, found.id_hashes)
    return m


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
