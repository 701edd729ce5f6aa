"""COMPLETE.json: each file's relative path, size and SHA-256, written last; the proof a checkpoint is whole."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.handed_off import HANDED_OFF, RECLAIMED_PREFIX
from torchrelay.checkpoint.handed_off import TMP_PREFIX as MARKER_TMP_PREFIX
from torchrelay.errors import IntegrityError, RecordError, UnsafeInput
from torchrelay.paths.layout import LEDGER_PROOF, PREPARE_RECORD  # tolerated in a checkpoint
from torchrelay.util import sha256_parts
from torchrelay.util.durable import temp_prefix
from torchrelay.util.hashing import default_jobs, sha256_many
from torchrelay.util.records import Field, Optional, Schema, check, read_json, shown
from torchrelay.util.safepath import check_relative, is_inside
from torchrelay.util.sha256_parts import MIN_PART_BYTES, part_count

INVENTORY = "COMPLETE.json"
INVENTORY_FORMAT = 1
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def list_files(root: Path) -> list[str]:
    """Relative paths of every regular file under root, sorted; symlinks are refused."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = Path(dirpath) / name
            if full.is_symlink():
                raise UnsafeInput(f"{full} is a symbolic link; checkpoints hold regular files only")
            out.append(str(full.relative_to(root)))
    return sorted(out)


def inventory_entries(root: Path, rels: Iterable[str]) -> list[dict[str, Any]]:
    """Inventory entries (path, size, SHA-256) of files under root, hashed in parallel."""
    rels = list(rels)
    digests = sha256_many([root / rel for rel in rels])
    return [{"path": rel, "size": digests[root / rel][1], "sha256": digests[root / rel][0]} for rel in rels]


def inventory_entry(
    rel: str, sha256: str, size: int, parts: tuple[int, tuple[str, ...]] | None = None
) -> dict[str, Any]:
    """One file's inventory entry; `parts`: (part size, its SHA-256 state at every part boundary), listed as
    {"parts": {"bytes": part size, "states": [...]}} so that a reader can verify the file in parts at once
    (util/sha256_parts.py)."""
    entry: dict[str, Any] = {"path": rel, "sha256": sha256, "size": size}
    if parts is not None:
        entry["parts"] = {"bytes": parts[0], "states": list(parts[1])}
    return entry


def part_states(entry: dict[str, Any]) -> tuple[int, list[str]] | None:
    """(part size, states) of an entry read by read_inventory, None where it lists none."""
    parts = entry.get("parts")
    return None if parts is None else (parts["bytes"], parts["states"])


def write_inventory(root: Path, entries: Iterable[dict[str, Any]], **info: Any) -> Path:
    """Write COMPLETE.json (fsynced) listing `entries`; call only after every listed file is fsynced."""
    doc = {"format": INVENTORY_FORMAT, **info, "files": sorted(entries, key=lambda e: e["path"])}
    path = root / INVENTORY
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return path


def safe_relpath(root: Path, rel: object, source: Path) -> Path:
    """Resolve an inventory path, refusing absolute paths, '..' and symlinks that leave root."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        raise UnsafeInput(f"{source}: path {rel!r} is absolute or malformed; refusing it")
    check_relative(rel, source=str(source))  # the rule every untrusted path meets (control characters, .git)
    if any(part in ("..", "") for part in rel.split("/")):
        raise UnsafeInput(f"{source}: path {rel!r} contains '..' or an empty part; refusing it")
    full = root / rel
    cur = root
    for part in rel.split("/"):
        cur = cur / part
        try:
            if stat.S_ISLNK(cur.lstat().st_mode):
                raise UnsafeInput(f"{source}: path {rel!r} goes through the symbolic link {cur}; refusing it")
        except FileNotFoundError:
            break
    if not is_inside(root, full) or Path(os.path.realpath(full)) == Path(os.path.realpath(root)):
        raise UnsafeInput(f"{source}: path {rel!r} leaves {root}; refusing it")
    return full


def read_inventory(ckpt_dir: Path) -> dict[str, Any]:
    """COMPLETE.json, checked to be what write_inventory writes: format, update, and a list of {path, size,
    sha256} with the types they must have; anything else is an IntegrityError naming the file and entry."""
    path = ckpt_dir / INVENTORY
    try:
        doc = read_json(path, what="checkpoint inventory")
    except FileNotFoundError as exc:
        raise IntegrityError(f"{path} is missing: the checkpoint is incomplete") from exc
    return check_inventory(doc, path)


# A memory tier's part and replica (checkpoint/replica.py): the fields a resume reads to choose and to assemble,
# from a node's memory or received from its peer, each within its type and bounds (util/records.check).
_NODE = Field(int, low=0, high=1 << 20)
PART_SCHEMA = Schema({
    "node": _NODE, "nodes": Field(int, low=1, high=1 << 20),
    "checkpoint_sha256": Field(str, length=64), "files": Field(int, low=0, high=1 << 32),
})  # fmt: skip
REPLICA_SCHEMA = Schema({"held_on": Field(str, length=255), "node": _NODE})
_TIER_FIELDS = Schema(
    {
        "part": Optional(Field(dict, fields=PART_SCHEMA)),
        "replica": Optional(Field(dict, fields=REPLICA_SCHEMA)),
    }
)


def check_inventory(doc: Any, path: Path | str) -> dict[str, Any]:
    """An inventory document (read from `path`: a file, an object's URL, or a peer's part named by `path`) as
    write_inventory writes it; anything else is one IntegrityError naming `path` and the entry or field."""
    if (
        not isinstance(doc, dict)
        or doc.get("format") != INVENTORY_FORMAT
        or not isinstance(doc.get("files"), list)
    ):
        raise IntegrityError(f"{path}: not a torchrelay inventory of format {INVENTORY_FORMAT}")
    update = doc.get("update")
    if update is not None and (not isinstance(update, int) or isinstance(update, bool) or update < 0):
        raise IntegrityError(f"{path}: update {str(update)[:40]!r} is not an update number")
    for i, item in enumerate(doc["files"]):
        if not isinstance(item, dict):
            raise IntegrityError(f"{path}: files[{i}] is not an object", hint="the checkpoint is damaged")
        size, digest = item.get("size"), item.get("sha256")
        if (
            not isinstance(item.get("path"), str)
            or not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not _HEX64.match(digest)
        ):
            raise IntegrityError(
                f"{path}: files[{i}] needs a path, a size >= 0 and a SHA-256, got {str(item)[:120]}",
                hint="the checkpoint is damaged",
            )
        if "parts" in item:
            _check_parts(path, i, item["parts"], size)
    check(doc, _TIER_FIELDS, source=str(path))
    digest = (doc.get("part") or {}).get("checkpoint_sha256")
    if digest is not None and not _HEX64.match(digest):
        raise RecordError(
            str(path), f"{shown(digest)}, not a 64-digit hex SHA-256", field="part.checkpoint_sha256"
        )
    return doc


def _check_parts(path: Path | str, i: int, parts: object, size: int) -> None:
    """An entry's part states as inventory_entry writes them: a part size (a multiple of 64 bytes, at least
    MIN_PART_BYTES) and one 64-digit hex state per boundary inside the file."""
    step = parts.get("bytes") if isinstance(parts, dict) else None
    states = parts.get("states") if isinstance(parts, dict) else None
    if (
        not isinstance(step, int)
        or isinstance(step, bool)
        or step < MIN_PART_BYTES
        or step % 64
        or not isinstance(states, list)
        or len(states) != part_count(size, step) - 1
        or not all(isinstance(h, str) and _HEX64.match(h) for h in states)
    ):
        raise IntegrityError(
            f"{path}: files[{i}].parts needs a part size (a multiple of 64 bytes, at least {MIN_PART_BYTES}) and "
            f"one 64-digit hex state per part boundary, got {str(parts)[:120]}",
            hint="the checkpoint is damaged",
        )


@dataclass(frozen=True, slots=True)
class FileProblem:
    """One way a checkpoint's files differ from its inventory; `rel` is relative to the checkpoint."""

    rel: str
    kind: str  # MISSING, SIZE, SHA256 or UNEXPECTED
    size: int = 0  # the file's size (SIZE)
    listed_size: int = 0  # the size the inventory lists (SIZE)


MISSING, SIZE, SHA256, UNEXPECTED = "MISSING", "SIZE", "SHA256", "UNEXPECTED"


def beside_inventory(rel: str) -> bool:
    """Whether `rel` may stand in a checkpoint without being listed: the inventory itself and what tools write
    after the commit (the fork guard, its reclaimed copies and a killed write's temporary, prepare's record,
    the ledger's proof and a killed prover's temporary, kept originals `*.orig`). The one rule the trainer's resume
    and a bundle's verify both apply."""
    if rel.endswith(".orig"):
        return True
    if "/" in rel:
        return False
    return (
        rel in (INVENTORY, HANDED_OFF, PREPARE_RECORD, LEDGER_PROOF)
        or rel.startswith(temp_prefix(LEDGER_PROOF))
        or (rel.startswith(RECLAIMED_PREFIX) and rel.endswith(".json"))
        or rel.startswith(MARKER_TMP_PREFIX)  # a killed pack's half-written record: removed at the next open
    )


def check_files(
    ckpt_dir: str | os.PathLike[str],
    doc: dict[str, Any],
    *,
    hashes: bool = True,
    known: Mapping[str, tuple[str, int]] | None = None,
) -> list[FileProblem]:
    """Every difference between a checkpoint's files and its inventory `doc` (from read_inventory): listed files
    missing or of another size or SHA-256 (unless hashes=False), then files present but neither listed nor
    `beside_inventory`. `known` maps checkpoint-relative paths to (SHA-256, size) already computed. An unsafe
    path (absolute, '..', a symlink) raises UnsafeInput."""
    root = Path(ckpt_dir)
    known = known or {}
    problems: list[FileProblem] = []
    listed: set[str] = set()
    to_hash: list[tuple[Path, dict[str, Any]]] = []
    for item in sorted(doc["files"], key=lambda e: e["path"]):
        full = safe_relpath(root, item["path"], root / INVENTORY)
        rel = full.relative_to(root).as_posix()
        listed.add(rel)
        if not full.is_file():
            problems.append(FileProblem(rel, MISSING))
            continue
        size = known[rel][1] if rel in known else full.stat().st_size
        if size != item["size"]:
            problems.append(FileProblem(rel, SIZE, size, item["size"]))
        elif hashes:
            to_hash.append((full, item))
    # A file whose entry lists its SHA-256 states is checked in parts, many at once (the same proof: the parts'
    # chain ends in its SHA-256); a forged state then fails here as it would fail the resume.
    in_parts = (
        [
            (full, item)
            for full, item in to_hash
            if "parts" in item and full.relative_to(root).as_posix() not in known
        ]
        if sha256_parts.available()
        else []
    )
    by_parts = sha256_parts.check_files(
        [(f, e["size"], e["parts"]["bytes"], e["parts"]["states"], e["sha256"]) for f, e in in_parts],
        default_jobs(),
    )
    digests = sha256_many(
        full for full, _ in to_hash if full.relative_to(root).as_posix() not in known and full not in by_parts
    )
    for full, item in to_hash:
        rel = full.relative_to(root).as_posix()
        if full in by_parts:
            if not by_parts[full]:
                problems.append(FileProblem(rel, SHA256))
            continue
        digest = known[rel][0] if rel in known else digests[full][0]
        if digest.lower() != item["sha256"].lower():
            problems.append(FileProblem(rel, SHA256))
    problems.extend(
        FileProblem(rel, UNEXPECTED)
        for rel in list_files(root)
        if rel not in listed and not beside_inventory(rel)
    )
    return problems


def validate_complete(ckpt_dir: str | os.PathLike[str], *, hashes: bool = True) -> dict[str, Any]:
    """Check every file against the inventory (size, and SHA-256 unless hashes=False); name the first bad file."""
    root = Path(ckpt_dir)
    doc = read_inventory(root)
    damaged = f"the file is damaged; restore it, or remove {root.name} to resume from an older checkpoint"
    for problem in check_files(root, doc, hashes=hashes):
        full = root / problem.rel
        if problem.kind == MISSING:
            raise IntegrityError(
                f"{full} is listed in {INVENTORY} but missing", hint="restore it from a copy"
            )
        if problem.kind == SIZE:
            raise IntegrityError(
                f"{full} has {problem.size} bytes, the inventory says {problem.listed_size}", hint=damaged
            )
        if problem.kind == SHA256:
            raise IntegrityError(f"{full} does not match its SHA-256 in {INVENTORY}", hint=damaged)
        raise IntegrityError(f"{full} is not listed in {INVENTORY}: unexpected file in a checkpoint")
    return doc
