"""The pass over every line of a manifest: each line checked, ids unique, the path-independent fingerprint.

Small manifests are read here, big ones by reader processes (readers.py) that run the same pass on parts.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchrelay.errors import ConfigError

ROOT_TOKEN = "${DATA_ROOT}"
FINGERPRINT_VERSION = "fingerprint_v1"
# A UTF-8 byte order mark opening the file (Windows tools write one): read past, no part of the first record. The
# file's SHA-256 covers it (the bytes); the fingerprint, the records and the index's offsets do not.
BOM = b"\xef\xbb\xbf"


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


_BLOCK = 1 << 22
_PART = 1 << 20  # a reader holds about 20 times its part while it works on it
# str.splitlines() (what manifests were always split with) also breaks lines at these; a line holding one is
# split the same way so that every manifest keeps its records, and their indices.
_OTHER_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


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
        if start == 0 and data.startswith(BOM):  # (Windows tools write one) no part of the first record
            start, data = len(BOM), data[len(BOM) :]
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


def _scan_here(path: Path, data_root: str) -> Scanned:
    s = _Scan(data_root)
    raw = hashlib.sha256()
    lineno = 1
    try:
        for start, data in _parts(path, _BLOCK, raw):
            s.block(lineno, start, data)
            lineno += data.count(b"\n")
    except _LineError as exc:
        raise _refusal(path, exc.lineno, exc) from None
    return _scanned(
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


@dataclass(frozen=True, slots=True)
class Scanned:
    """What one pass over a manifest's lines found; `core` makes it a Manifest once its ids are proven unique."""

    path: Path
    data_root: str
    raw_sha256: str
    starts: np.ndarray
    sizes: np.ndarray
    fingerprint: str
    lengths: np.ndarray | None
    bad_length: str | None
    id_hashes: np.ndarray


def _scanned(
    path: Path,
    data_root: str,
    raw_sha256: str,
    starts: np.ndarray,
    sizes: np.ndarray,
    fp_hex: str,
    lengths: np.ndarray | None,
    bad_length: tuple[int, str] | None,
    id_hashes: np.ndarray,
) -> Scanned:
    if not len(starts):
        raise ConfigError(f"data manifest {path} lists no samples")
    bad = f"line {bad_length[0]}: {bad_length[1]}" if bad_length is not None else None
    return Scanned(
        path, data_root, raw_sha256, starts, sizes, f"{FINGERPRINT_VERSION}:{fp_hex}", lengths, bad, id_hashes
    )


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


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # read here, which names the error


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
