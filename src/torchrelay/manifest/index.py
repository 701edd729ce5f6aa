"""A manifest's saved index (data/manifest.index.npz) read with care: its meta and array headers checked before
they are loaded, its entries and a spread of its lengths checked against the manifest's own bytes."""

from __future__ import annotations

import json
import mmap
import os
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from torchrelay.errors import ConfigError, RecordError
from torchrelay.manifest.scan import BOM
from torchrelay.util.records import Field, Schema, check, parse_json

if TYPE_CHECKING:
    from torchrelay.manifest.core import Manifest

INDEX_FORMAT = 1
# What reading a saved index can raise where the file is cut, bit-flipped or foreign (zip's CRC, an unknown
# compression) or not one this version reads: each reader then treats the index as absent.
_INDEX_UNREADABLE = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
)


def index_root(index: str | os.PathLike[str]) -> str | None:
    """The data-root prefix a saved index was made under (its meta's "root"), or None where none can be read: a
    hint only (a run uses it to find the root its copy was last re-pointed at; the fingerprint decides)."""
    try:
        if not Path(index).is_file():
            return None
        with np.load(index, allow_pickle=False) as z:
            if not _header_fits(z, "meta", None):
                return None
            meta = _meta(str(z["meta"]), index)
    except _INDEX_UNREADABLE:
        return None
    root = meta.get("root") if isinstance(meta, dict) else None
    return root if isinstance(root, str) else None


_NONE = type(None)
# The index's meta (save_index): a cache's, so one out of its schema only means the lines are read again.
INDEX_META_SCHEMA = Schema(
    {
        "format": Field(int, low=INDEX_FORMAT, high=INDEX_FORMAT),
        "sha256": Field(str, length=128),
        "file_size": Field(int, low=0, high=1 << 50),
        "root": Field(str),
        "fingerprint": Field(str, length=200),
        "samples": Field(int, low=0, high=1 << 40),
        "bad_length": Field((str, _NONE), length=1 << 16),
    }
)


def _meta(text: str, index: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The index's meta checked against INDEX_META_SCHEMA, or None (nesting past the parser's bound included:
    a RecursionError was a traceback in `ledger`, `status --ledger` and the resume)."""
    try:
        return check(parse_json(text, source=f"{index} meta"), INDEX_META_SCHEMA, source=f"{index} meta")
    except RecordError:
        return None


_META_LIMIT = 1 << 20  # characters of the index's meta (a JSON line of a few hundred)


def _header_fits(z: Any, name: str, samples: int | None) -> bool:
    """Whether the npz member `name` is, by its .npy header alone, what `save_index` writes: the meta a text
    scalar of at most _META_LIMIT characters (`samples` None), an array a 1-D int64 of `samples` entries."""
    with z.zip.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            return False
    if samples is None:
        return shape == () and dtype.kind == "U" and dtype.itemsize <= 4 * _META_LIMIT
    return shape == (samples,) and dtype == np.dtype("<i8") and not fortran


_CHUNK = 4 << 20
# Blank lines, or lines not opening with "{", are looked at one by one: past this many, the lines are read.
_ODD_LINES = 4096


def _lines_match(path: Path, starts: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether the entries are the file's non-blank lines, each whole, in file order (what `scan` finds): the
    newlines' positions against the offsets, in numpy (45 MB: about 0.05 s)."""
    n = len(starts)
    ends = starts + sizes
    if not n or int(starts[0]) < 0 or (sizes < 1).any() or (starts[1:] <= ends[:-1]).any():
        return False
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if int(ends[-1]) > size:
                return False
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                data = np.frombuffer(mapped, dtype=np.uint8)
                try:
                    lines = _lines(data, mapped)
                    return lines is not None and _entries_match(data, *lines, starts, ends)
                finally:
                    del data  # the mapping closes only once no array points into it
    except (OSError, ValueError):
        return False


def _lines(data: np.ndarray, mapped: mmap.mmap) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Where each line of the file starts and ends (newline to newline), and its first byte; None where `scan`
    would split lines at other characters too (str.splitlines' "\\r", "\\x0b", "\\x0c", "\\x1c"-"\\x1e", U+0085,
    U+2028, U+2029) or refuse a control character: the lines are read then. One pass over the bytes below 0x20
    or from 0x80 on, a chunk at a time, each chunk's pages let go after it (as `sha256_file` does): a rank's
    memory does not grow by the file."""
    size = len(data)
    drop = hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED")
    head = len(BOM) if mapped[: len(BOM)] == BOM else 0  # the first line starts past a byte order mark
    found, firsts = [], [data[head : head + 1]]
    for at in range(0, size, _CHUNK):
        chunk = data[at : at + _CHUNK]
        odd = np.flatnonzero((chunk - np.uint8(32)) >= 96) + at  # < 0x20 or >= 0x80, in two operations
        values = data[odd]
        low = values < 32
        controls = values[low]
        if ((controls != 10) & (controls != 9)).any():
            return None
        nel = odd[values == 0x85]  # U+0085: C2 85
        if (data[np.maximum(nel - 1, 0)] == 0xC2).any():
            return None
        sep = odd[(values == 0xA8) | (values == 0xA9)]  # U+2028, U+2029: E2 80 A8, E2 80 A9
        if ((data[np.maximum(sep - 1, 0)] == 0x80) & (data[np.maximum(sep - 2, 0)] == 0xE2)).any():
            return None
        newlines = odd[low & (values == 10)]
        found.append(newlines)
        firsts.append(data[np.minimum(newlines + 1, size - 1)])
        if drop:
            mapped.madvise(mmap.MADV_DONTNEED, at, len(chunk))
    newlines = np.concatenate(found)
    line_starts = np.concatenate([[head], newlines + 1])
    line_ends = np.concatenate([newlines, [size]])
    first = np.concatenate(firsts)
    if line_starts[-1] == size:  # the file ends with a newline: no line after it
        line_starts, line_ends, first = line_starts[:-1], line_ends[:-1], first[:-1]
    return line_starts, line_ends, first


def _entries_match(
    data: np.ndarray,
    line_starts: np.ndarray,
    line_ends: np.ndarray,
    first: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> bool:
    """Each entry a whole line, in order (checked by the caller), and every line left out blank."""
    k = np.searchsorted(line_starts, starts)
    if (k >= len(line_starts)).any():
        return False
    if (line_starts[k] != starts).any() or (line_ends[k] != ends).any():
        return False  # an entry that is no whole line
    # Lines left out must be blank, lines taken must not be (a "{" first is not; the others are looked at).
    left = np.ones(len(line_starts), dtype=bool)
    left[k] = False
    left &= line_ends > line_starts
    odd = k[first[k] != ord("{")]
    if int(left.sum()) + len(odd) > _ODD_LINES:
        return False
    blank = [_text(data, a, b) == "" for a, b in zip(line_starts[left].tolist(), line_ends[left].tolist())]
    taken = [_text(data, a, b) == "" for a, b in zip(line_starts[odd].tolist(), line_ends[odd].tolist())]
    return all(blank) and not any(taken)


def _text(data: np.ndarray, a: int, b: int) -> str:
    """A line's text without the white space around it (what `scan` skips a line for having no more of)."""
    return data[a:b].tobytes().decode("utf-8", errors="replace").strip()


_LENGTH_CHECKS = 1024


def _lengths_match(m: Manifest, lengths: np.ndarray | None, bad: str | None) -> bool:
    """Whether the `length`s of a spread of records (evenly placed, and others drawn from the manifest's digest)
    are the index's: the index cannot reorder a length-bucketed sampler's data by its lengths without reading the
    lines again. The draw is the same on every rank: ranks that judged the same index differently would train on
    different lengths."""
    n = len(m)
    picks = np.unique(
        np.concatenate(
            [
                np.linspace(0, n - 1, min(n, _LENGTH_CHECKS // 2)).astype(np.int64),
                np.random.default_rng(int(m.raw_sha256[:16], 16)).integers(0, n, min(n, _LENGTH_CHECKS // 2)),
            ]
        )
    )
    for i in picks.tolist():
        try:
            rec = json.loads(m.records.line(i))
        except (ValueError, RecursionError, UnicodeDecodeError, ConfigError):
            return False
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            return False
        value = rec.get("length", 1)
        try:
            length = int(value)
        except (TypeError, ValueError, OverflowError):
            if bad is None:
                return False
            continue
        if (1 if lengths is None else int(lengths[i])) != length:
            return False
    return True
