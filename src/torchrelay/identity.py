"""Who trained what: the code's identity (git commit, tree hash, dirty flag) and the versions in use."""

from __future__ import annotations

import hashlib
import os
import platform
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.errors import ConfigError

_SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def _git(code_dir: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_tree_of_dir(root: Path) -> str:
    """The tree hash git would give these files: a `git archive` extracted elsewhere hashes the same."""

    def tree(d: Path) -> bytes:
        entries: list[tuple[str, bytes]] = []
        for child in d.iterdir():
            if child.name in _SKIP_DIRS:
                continue
            st = child.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(child).encode()
                entries.append((child.name, b"120000 " + child.name.encode() + b"\0" + _blob(data)))
            elif stat.S_ISDIR(st.st_mode):
                if (child / "resume_contract.json").exists():
                    continue  # a run directory inside a plain source tree is output, not code
                sub = tree(child)
                if sub:  # git does not record empty directories
                    entries.append((child.name + "/", b"40000 " + child.name.encode() + b"\0" + sub))
            elif stat.S_ISREG(st.st_mode):
                mode = b"100755" if st.st_mode & 0o111 else b"100644"
                entries.append(
                    (child.name, mode + b" " + child.name.encode() + b"\0" + _blob(child.read_bytes()))
                )
        if not entries:
            return b""
        body = b"".join(e for _, e in sorted(entries))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    digest = tree(root)
    return digest.hex() if digest else ""


def _blob(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def code_identity(code_dir: str | os.PathLike[str] | None, *, use_git: bool = True) -> dict[str, Any]:
    """{commit, tree, dirty, dirty_sha256}; commit is None for a plain source tree (e.g. an extracted archive).

    use_git=False hashes the files as git would without running git: for a tree that came from a bundle,
    where a planted `.git/` (core.fsmonitor, hooks) or one in a parent folder would make git run its commands.
    """
    if code_dir is None:
        return {"commit": None, "tree": None, "dirty": None, "dirty_sha256": None}
    root = Path(code_dir).resolve()
    top = _git(root, "rev-parse", "--show-toplevel") if use_git else None
    if top is not None and Path(top).resolve() == root:
        commit = _git(root, "rev-parse", "HEAD")
        tree = _git(root, "rev-parse", "HEAD^{tree}")
        status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
        dirty = bool(status)
        diff = _git(root, "diff", "HEAD", "--binary") if dirty else None
        return {
            "commit": commit,
            "tree": tree,
            "dirty": dirty,
            "dirty_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        }
    return {"commit": None, "tree": _git_tree_of_dir(root), "dirty": False, "dirty_sha256": None}


def find_code_dir(script: str | None = None) -> Path | None:
    """The git top level holding the running script, or the script's own folder."""
    path = Path(script or sys.argv[0] or ".").resolve()
    folder = path if path.is_dir() else path.parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    return Path(top) if top else folder


def versions(pins: list[str]) -> dict[str, str]:
    """python, torch, torchrelay, and each pinned package's installed version; a pin not met is refused."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrelay": __version__,
    }
    for pin in pins:
        if "==" not in pin:
            raise ConfigError(f"pin {pin!r} must have the form name==version")
        name, wanted = (s.strip() for s in pin.split("==", 1))
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have != wanted:
            raise ConfigError(
                f"pinned package {name} must be {wanted}, but {have} is installed",
                hint=f"install it with `pip install {name}=={wanted}` or change the run's pins",
            )
        out[name] = have
    return out
