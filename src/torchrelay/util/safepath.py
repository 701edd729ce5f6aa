"""Paths read from a bundle are untrusted: refuse absolute paths, `..`, `.git`, and symlinks that lead out of the bundle."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from torchrelay.errors import UnsafeInput

# Characters that `sha256sum` would escape and that no file torchrelay writes ever contains.
_FORBIDDEN_CHARS = ("\x00", "\n", "\r", "\\")


def check_relative(rel: str, *, source: str) -> PurePosixPath:
    """Return `rel` as a normalised relative POSIX path, or raise UnsafeInput naming `source`."""
    if not isinstance(rel, str) or not rel:
        raise UnsafeInput(f"{source}: empty or non-text path {rel!r}", hint="the bundle is damaged or forged")
    for ch in _FORBIDDEN_CHARS:
        if ch in rel:
            raise UnsafeInput(
                f"{source}: path {rel!r} contains a control character or backslash",
                hint="torchrelay never writes such names; the bundle is damaged or forged",
            )
    posix = PurePosixPath(rel)
    if posix.is_absolute() or (len(rel) >= 2 and rel[1] == ":"):
        raise UnsafeInput(
            f"{source}: absolute path {rel!r} refused",
            hint="every path in a bundle must be relative to the bundle; the bundle is damaged or forged",
        )
    parts = [p for p in posix.parts if p != "."]
    if any(p == ".." for p in parts):
        raise UnsafeInput(
            f"{source}: path {rel!r} climbs out with '..'",
            hint="every path in a bundle must stay inside it; the bundle is damaged or forged",
        )
    if not parts:
        raise UnsafeInput(f"{source}: path {rel!r} names the directory itself", hint="the bundle is damaged")
    if any(p.lower() == ".git" for p in parts):
        # a bundle never carries a git repository: one in reach of a git command runs its config's programs
        raise UnsafeInput(
            f"{source}: path {rel!r} is inside a .git folder",
            hint="a bundle carries its source as an archive and a git bundle, never a .git folder; it is forged",
        )
    return PurePosixPath(*parts)


def resolve_inside(root: Path, rel: str, *, source: str) -> Path:
    """Join a checked relative path to `root`; refuse it if a symlink on the way leads outside `root`."""
    safe = check_relative(rel, source=source)
    path = Path(root, *safe.parts)
    ensure_inside(root, path, source=source, shown=rel)
    return path


def ensure_inside(root: Path, path: Path, *, source: str, shown: str | None = None) -> None:
    """Raise UnsafeInput if `path` (which may not exist yet) resolves outside `root`."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if real != real_root and not real.is_relative_to(real_root):
        raise UnsafeInput(
            f"{source}: {shown or path} leads through a symlink to {real}, outside {root}",
            hint="a bundle must not contain symlinks that point outside it; the bundle is damaged or forged",
        )


def walk_files(root: Path) -> list[str]:
    """Every regular file and symlink under `root`, as sorted relative POSIX paths (symlinks are not followed)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            found.append((rel_dir / name).as_posix())
        # a symlink to a directory appears in dirnames; report it as an entry rather than descending
        for name in list(dirnames):
            if os.path.islink(os.path.join(dirpath, name)):
                found.append((rel_dir / name).as_posix())
    return sorted(found)
