"""The data manifest: one JSON object per sample, and a fingerprint that does not change when the data moves."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError

ROOT_TOKEN = "${DATA_ROOT}"
FINGERPRINT_VERSION = "fingerprint_v1"


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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


@dataclass(frozen=True, slots=True)
class Manifest:
    """The samples of a run, in file order; index i is the sample's identity in the ledger."""

    path: str
    data_root: str
    records: tuple[dict[str, Any], ...]
    raw_sha256: str

    @classmethod
    def load(cls, path: str | os.PathLike[str], data_root: str = "") -> Manifest:
        """Read a JSONL manifest; every line needs a unique string `id`."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data manifest {p} does not exist", hint="check the config field 'manifest'")
        try:
            raw = p.read_bytes()
            text = raw.decode("utf-8")
        except OSError as exc:
            raise ConfigError(
                f"data manifest {p} cannot be read ({exc.strerror or exc})", hint="check its permissions"
            ) from exc
        except UnicodeDecodeError as exc:
            at_line = raw[: exc.start].count(b"\n") + 1
            raise ConfigError(
                f"{p}:{at_line}: the data manifest is not UTF-8 text ({exc.reason} at byte {exc.start})",
                hint="a manifest is JSON Lines in UTF-8; regenerate it or fix that line",
            ) from exc
        records: list[dict[str, Any]] = []
        seen: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}:{lineno}: not a JSON object ({exc.msg})") from exc
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise ConfigError(f"{p}:{lineno}: each manifest line must be an object with a string 'id'")
            if rec["id"] in seen:
                raise ConfigError(f"{p}:{lineno}: duplicate sample id {rec['id']!r}")
            seen.add(rec["id"])
            records.append(rec)
        if not records:
            raise ConfigError(f"data manifest {p} lists no samples")
        return cls(str(p), data_root, tuple(records), hashlib.sha256(raw).hexdigest())

    def __len__(self) -> int:
        return len(self.records)

    def sha256(self) -> str:
        """SHA-256 of the file's bytes (changes when the data root is rewritten)."""
        return self.raw_sha256

    def fingerprint(self) -> str:
        """Path-independent identity: the content with the data root replaced by a token."""
        prefix = _root_prefix(self.data_root)

        def strip(s: str) -> str:
            return ROOT_TOKEN + "/" + s[len(prefix) :] if prefix and s.startswith(prefix) else s

        h = hashlib.sha256()
        for rec in self.records:
            h.update(_canonical(_map_strings(rec, strip)).encode())
            h.update(b"\n")
        return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"

    def lengths(self) -> list[int]:
        """Per-sample lengths for the length-bucketed sampler (`length` field, default 1)."""
        return [int(rec.get("length", 1)) for rec in self.records]

    def paths(self) -> Iterator[str]:
        """Every string field that lies under the data root (the files the manifest names)."""
        prefix = _root_prefix(self.data_root)
        for rec in self.records:
            for value in _iter_strings(rec):
                if prefix and value.startswith(prefix):
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
