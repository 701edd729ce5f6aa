"""Verify a bundle: every file against SHA256SUMS, and every checkpoint's inventory against its files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.handoff.hashing import ByteCallback, sha256_file
from torchrelay.handoff.safepath import check_relative, ensure_inside, walk_files
from torchrelay.handoff.sums import SUMS_NAME, SumsReport, check_sums, listed_size, read_sums

INVENTORY_NAME = "COMPLETE.json"
# Files that live beside a checkpoint's inventory without being part of it (written after the marker).
NOT_INVENTORIED = frozenset({INVENTORY_NAME, "HANDED_OFF.json", "REBASE_RECORD.json"})


@dataclass(slots=True)
class VerifyReport:
    """The outcome of `verify`: the SHA256SUMS check and one line per inventory problem."""

    sums: SumsReport
    inventory_problems: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.sums.ok and not self.inventory_problems

    def problems(self) -> list[str]:
        return self.sums.problems() + self.inventory_problems


def bundle_bytes(bundle: Path) -> int:
    """Bytes `verify_bundle` will hash (for a progress bar); refuses an unreadable SHA256SUMS early."""
    return listed_size(bundle, read_sums(Path(bundle) / SUMS_NAME))


def verify_bundle(
    bundle: Path, *, jobs: int | None = None, on_bytes: ByteCallback | None = None
) -> VerifyReport:
    """Check every file of `bundle` against its SHA256SUMS and every checkpoint inventory; raise on unsafe paths."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise IntegrityError(
            f"{bundle}: not a directory", hint="pass the bundle directory that holds SHA256SUMS"
        )
    entries = read_sums(bundle / SUMS_NAME)
    sums = check_sums(bundle, entries, jobs=jobs, on_bytes=on_bytes)
    report = VerifyReport(sums=sums)
    known = sums.digests()
    for inventory in find_inventories(bundle):
        rel_dir = inventory.parent.relative_to(bundle).as_posix()
        report.checkpoints.append(rel_dir)
        report.inventory_problems.extend(check_inventory(bundle, inventory.parent, known))
    return report


def find_inventories(root: Path) -> list[Path]:
    """Every COMPLETE.json under `root` (symlinks are not followed)."""
    return [root / rel for rel in walk_files(root) if rel.rsplit("/", 1)[-1] == INVENTORY_NAME]


def load_inventory(ckpt_dir: Path) -> dict[str, tuple[int, str]]:
    """Inventory of a checkpoint as {relative path: (size, sha256)}; refuses malformed or unsafe entries."""
    path = ckpt_dir / INVENTORY_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(
            f"{path}: unreadable inventory ({exc})", hint="the checkpoint is damaged"
        ) from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        raise IntegrityError(f"{path}: no 'files' list", hint="the checkpoint is damaged")
    result: dict[str, tuple[int, str]] = {}
    for i, item in enumerate(files):
        if not isinstance(item, dict):
            raise IntegrityError(f"{path}: files[{i}] is not an object", hint="the checkpoint is damaged")
        rel = check_relative(item.get("path"), source=f"{path} files[{i}]").as_posix()  # type: ignore[arg-type]
        size, digest = item.get("size"), item.get("sha256")
        if not isinstance(size, int) or not isinstance(digest, str):
            raise IntegrityError(
                f"{path}: files[{i}] ({rel}) lacks size or sha256", hint="the checkpoint is damaged"
            )
        ensure_inside(ckpt_dir, ckpt_dir / rel, source=str(path), shown=rel)
        result[rel] = (size, digest.lower())
    return result


def check_inventory(root: Path, ckpt_dir: Path, known: dict[str, tuple[str, int]] | None = None) -> list[str]:
    """Problems between a checkpoint's inventory and its files; `known` holds digests already computed."""
    known = known or {}
    problems: list[str] = []
    try:
        inventory = load_inventory(ckpt_dir)
    except UnsafeInput:
        raise
    except IntegrityError as exc:
        return [exc.message]
    prefix = ckpt_dir.relative_to(root).as_posix()
    present = set(walk_files(ckpt_dir))
    for rel, (size, digest) in sorted(inventory.items()):
        shown = f"{prefix}/{rel}"
        if rel not in present:
            problems.append(f"{shown}: MISSING (listed in {prefix}/{INVENTORY_NAME})")
            continue
        actual = known.get(shown)
        if actual is None:
            actual = sha256_file(ckpt_dir / rel)
        if actual[1] != size:
            problems.append(f"{shown}: size {actual[1]} != {size} in {prefix}/{INVENTORY_NAME}")
        elif actual[0] != digest:
            problems.append(f"{shown}: sha256 differs from {prefix}/{INVENTORY_NAME}")
    for rel in sorted(present - set(inventory) - NOT_INVENTORIED):
        if rel.endswith(".orig"):
            continue
        problems.append(f"{prefix}/{rel}: UNEXPECTED (not in {prefix}/{INVENTORY_NAME})")
    return problems
