"""A run directory and a bundle as typed objects: each names every file inside (from `layout`'s one table) and
reads them through the guarded readers (util/records.py, util/safepath.py); nothing else builds these paths."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchrelay.errors import IntegrityError
from torchrelay.paths.layout import (
    ATTEMPTS_DIR,
    BUNDLE_INFO,
    CONFIG_FILE,
    CONTRACT_FILE,
    DATA_DIR,
    HISTORY_FILE,
    INDEX_NAME,
    LINEAGE_FILE,
    LOCK_FILES,
    MANIFEST_INFO,
    MANIFEST_REL,
    PREPARE_RECORD,
    PROGRESS_FILE,
    README_FILE,
    REQUEST_STOP,
    SIG_FILE,
    SOURCE_DIR,
    SOURCE_MANIFEST,
    SUMS_FILE,
    TRAIN_DIR,
    VALIDATION_DIR,
    checkpoint_name,
    parse_checkpoint_name,
)
from torchrelay.util.durable import remove_temps, temp_prefix
from torchrelay.util.records import parse_json, read_json_or_none
from torchrelay.util.safepath import check_relative, is_inside, read_regular, resolve_inside

# Files only the run's writer (who holds its lock) replaces, each by an atomic write; a writer killed mid-write
# leaves its temporary behind, for the next writer to remove.
WRITER_FILES = (CONFIG_FILE, LINEAGE_FILE, CONTRACT_FILE, HISTORY_FILE)


# What a directory may hold before its run is created in it: a stop request written ahead (audits stop at chosen
# updates), a controller's attempts, the training lock.
BEFORE_RUN = (REQUEST_STOP, ATTEMPTS_DIR, *sorted(LOCK_FILES))


class RunDir:
    """Paths of a run directory; creates nothing by itself."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, where: str | os.PathLike[str] | RunDir) -> RunDir:
        """`where` as a RunDir: a caller's path becomes one once, where it enters; a RunDir passes through."""
        return where if isinstance(where, RunDir) else cls(where)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    config_path = property(lambda self: self.path / CONFIG_FILE)
    contract_path = property(lambda self: self.path / CONTRACT_FILE)
    lineage_path = property(lambda self: self.path / LINEAGE_FILE)
    history_path = property(lambda self: self.path / HISTORY_FILE)
    data_dir = property(lambda self: self.path / DATA_DIR)
    manifest_path = property(lambda self: self.path / MANIFEST_REL)
    manifest_index_path = property(lambda self: self.path / DATA_DIR / INDEX_NAME)
    train_dir = property(lambda self: self.path / TRAIN_DIR)
    validation_dir = property(lambda self: self.path / VALIDATION_DIR)
    attempts_dir = property(lambda self: self.path / ATTEMPTS_DIR)
    request_stop_path = property(lambda self: self.path / REQUEST_STOP)
    prepare_record_path = property(lambda self: self.path / PREPARE_RECORD)
    source_dir = property(lambda self: self.path / SOURCE_DIR)
    source_manifest_path = property(lambda self: self.path / SOURCE_MANIFEST)

    def checkpoint(self, update: int) -> Path:
        """Where the checkpoint of `update` lives (whether or not it exists or is complete)."""
        return self.path / checkpoint_name(update)

    def checkpoint_dirs(self) -> list[Path]:
        """Every directory named as a checkpoint (complete or not: `checkpoints()` says which), by update."""
        if not self.path.is_dir():
            return []
        found = [(parse_checkpoint_name(p.name), p) for p in self.path.iterdir()]
        return [p for u, p in sorted((u, p) for u, p in found if u is not None) if p.is_dir()]

    def validation_of(self, update: int) -> Path:
        """The folder of the validation record of the checkpoint of `update` (records/validation.py's format)."""
        return self.validation_dir / checkpoint_name(update)

    def exists(self) -> bool:
        # Creating a run writes the contract last: a creation killed before it leaves no run, only its debris.
        return self.contract_path.exists()

    def unexplained_entries(self) -> list[str]:
        """What a directory that holds no run contains beyond what may come before a run (BEFORE_RUN) and a killed
        creation's own files; none where the directory is not there."""
        if not self.path.exists():
            return []
        temps = tuple(temp_prefix(n) for n in WRITER_FILES)
        train = self.train_dir.is_dir() and not any(self.train_dir.iterdir())
        out = []
        for p in sorted(self.path.iterdir()):
            name = p.name
            if name in BEFORE_RUN or name.startswith(temps):
                continue
            if name == TRAIN_DIR and train:
                continue
            # data/ comes first, then train/, then the manifest's copy in data/: only a creation makes both.
            if (
                name == DATA_DIR
                and p.is_dir()
                and {
                    c.name
                    for c in p.iterdir()
                    if not c.name.startswith((temp_prefix(INDEX_NAME), temp_prefix(Path(MANIFEST_REL).name)))
                }
                <= ({Path(MANIFEST_REL).name, INDEX_NAME} if train else set())
            ):
                continue
            if name in (CONFIG_FILE, LINEAGE_FILE) and train and _is_json_object(p):
                continue
            out.append(name)
        return out

    def remove_stale_temps(self) -> list[str]:
        """Remove what a writer killed mid-write left: atomic-write temporaries, a log's trim (hold the lock)."""
        temps = tuple(temp_prefix(n) for n in WRITER_FILES)
        found = [self.path / n for n in os.listdir(self.path) if n.startswith(temps)]
        # (a folder linked out of the run is left alone: what it points to is not the run's to clean)
        if self.train_dir.is_dir() and is_inside(self.path, self.train_dir):
            found += [p for p in self.train_dir.iterdir() if p.name.endswith(".jsonl.trim")]
        data = self.data_dir
        if data.is_dir() and is_inside(self.path, data):
            # the index's, and a re-pointed copy of the manifest's (Manifest.rebase_into)
            mine = (temp_prefix(INDEX_NAME), temp_prefix(Path(MANIFEST_REL).name))
            found += [p for p in data.iterdir() if p.name.startswith(mine)]
        return [str(p.relative_to(self.path)) for p in remove_temps(found)]


def _is_json_object(path: Path) -> bool:
    return isinstance(read_json_or_none(path, what=path.name), dict)


_BUNDLE_RECORD_LIMIT = (
    1 << 26
)  # a bundle's JSON records; its lineage record at most 1 << 24 when only peeked at
Digests = Mapping[str, tuple[str, int]]  # SHA256SUMS as verified: {relative path: (sha256, size)}


class Bundle:
    """A bundle directory (docs/FORMATS.md): a run directory's files at its top beside the ones `pack` adds
    (bundle.json, SHA256SUMS, data/manifest_info.json, source/), and their readers. `pack` writes it
    (handoff/pack.py); every reader asks this object. A bundle's record is believed only once `verify` checked
    the bundle against SHA256SUMS: given the verified digests, a reader refuses bytes that are not the ones
    verified (a bundle written into between the verification and the read)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._config: tuple[dict[str, Any], bytes] | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r})"

    info_path = property(lambda self: self.path / BUNDLE_INFO)
    sums_path = property(lambda self: self.path / SUMS_FILE)
    sig_path = property(lambda self: self.path / SIG_FILE)
    manifest_info_path = property(lambda self: self.path / MANIFEST_INFO)
    progress_path = property(lambda self: self.path / PROGRESS_FILE)
    readme_path = property(lambda self: self.path / README_FILE)
    source_dir = property(lambda self: self.path / SOURCE_DIR)
    run = property(lambda self: RunDir(self.path))  # the run directory's own files, at the bundle's top

    def looks_like_one(self) -> bool:
        """Whether the directory has a bundle's two own files (whether they are sound is verify's question)."""
        return self.info_path.is_file() and self.sums_path.is_file()

    def file(self, rel: str, *, source: str | None = None) -> Path:
        """The path of `rel` inside the bundle, refused if it leads out of it (a name from a bundle's record)."""
        return resolve_inside(self.path, rel, source=source or str(self.path))

    def info(self, verified: Digests | None = None) -> dict[str, Any]:
        """bundle.json, checked to hold what `pack` writes in the fields `prepare` relies on, with their types."""
        path = self.info_path
        info, _ = _read_object(path, "the bundle's lineage record", _want(verified, BUNDLE_INFO))
        _require(path, info, "lineage", str, "a lineage id")
        _require(path, info, "parent_lineage", (str, type(None)), "a lineage id or null")
        _require(path, info, "checkpoint", str, "a checkpoint name")
        _require(path, info, "source", (dict, type(None)), "an object or null")
        for key in ("archive", "archive_prefix", "untracked"):
            _require(path, info.get("source") or {}, key, (str, type(None)), f"source.{key}: a path or null")
        return info

    def info_or_empty(self) -> dict[str, Any]:
        """bundle.json of a bundle directory of ours, or {} for anything else (a directory to recognise, not to
        trust)."""
        info = read_json_or_none(self.info_path, what="the bundle's lineage record")
        return info if isinstance(info, dict) else {}

    def manifest_info(self, verified: Digests | None = None) -> dict[str, Any]:
        """data/manifest_info.json: the manifest's identity at packing, {sha256, fingerprint, data_root, samples}."""
        path = self.manifest_info_path
        info, _ = _read_object(path, "the manifest's identity", _want(verified, MANIFEST_INFO))
        for key in ("sha256", "fingerprint", "data_root"):
            _require(path, info, key, str, "text")
        _require(path, info, "samples", int, "a count")
        if info["samples"] < 0:
            raise IntegrityError(
                f"{path}: samples is {info['samples']}, not a count", hint="the bundle is damaged"
            )
        return info

    def source_archives(self, info: dict[str, Any]) -> tuple[list[Path], str]:
        """The archives of the run's exact code that bundle.json `info` names (the commit's, then the files git did
        not track), each inside the bundle, and the prefix their members lie under; ([], "") without any."""
        source = info.get("source") or {}
        if not isinstance(source, dict):
            raise IntegrityError(f"{self.info_path}: 'source' is not an object", hint="the bundle is damaged")
        if not source.get("archive"):
            return [], ""
        named = [source["archive"]] + ([source["untracked"]] if source.get("untracked") else [])
        archives = [self.file(str(rel), source=str(self.info_path)) for rel in named]
        prefix = check_relative(
            str(source.get("archive_prefix")), source=f"{BUNDLE_INFO} source.archive_prefix"
        )
        return archives, prefix.as_posix()

    def config_record(self) -> tuple[dict[str, Any], bytes]:
        """config.json as packed, and its bytes, read once: later calls return the same (a caller may read it
        before the verification, to refuse early; `verified_config_bytes` holds the bytes against SHA256SUMS)."""
        if self._config is None:
            self._config = _read_object(self.path / CONFIG_FILE, "the run's configuration", None)
        return self._config

    def verified_config_bytes(self, verified: Digests) -> bytes:
        """The bytes `config_record` was read from, refused unless they are the verified ones."""
        data = self.config_record()[1]
        _check_verified(self.path / CONFIG_FILE, data, _want(verified, CONFIG_FILE))
        return data


def read_record(path: Path, what: str) -> dict[str, Any]:
    """A JSON object record of a bundle or a prepared run directory, or IntegrityError naming the file."""
    return _read_object(path, what, None)[0]


def _want(verified: Digests | None, rel: str) -> str | None:
    if verified is None:
        return None
    return verified.get(rel, ("not listed in SHA256SUMS", 0))[0]


def _read_object(path: Path, what: str, want: str | None) -> tuple[dict[str, Any], bytes]:
    """A JSON object record and its bytes, read the guarded way; with `want`, refused unless the bytes are the
    ones SHA256SUMS vouched for (a bundle written into between the verification and this read)."""
    try:
        data = read_regular(path, _BUNDLE_RECORD_LIMIT, what=what)
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing ({what})", hint="is this a torchrelay bundle?") from None
    if want is not None:
        _check_verified(path, data, want)
    doc = parse_json(data, source=f"{path} ({what})")
    if not isinstance(doc, dict):
        raise IntegrityError(f"{path} does not hold a JSON object ({what})", hint="re-download the bundle")
    return doc, data


def _check_verified(path: Path, data: bytes, want: str | None) -> None:
    """Refuse `data` read from `path` unless its SHA-256 is the one SHA256SUMS vouched for (`want`; None: not
    listed), so that a bundle written into between the verification and this read is never believed."""
    if hashlib.sha256(data).hexdigest() != want:
        raise IntegrityError(
            f"{path} changed between verification and reading",
            hint="something is writing into the bundle; re-download it and run prepare again",
        )


def _require(path: Path, doc: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> None:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, (int,)):
        raise IntegrityError(
            f"{path}: {key} is {str(value)[:60]!r}, not {what}", hint="the bundle is damaged or forged"
        )
