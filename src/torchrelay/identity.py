"""Who trained what: the code's identity (git commit, tree hash, dirty flag) and the versions in use."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.errors import ConfigError
from torchrelay.layout import CONTRACT_FILE
from torchrelay.util.hashing import sha256_or_none

_SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def _git(code_dir: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_tree_of_dir(root: Path, without: frozenset[str] = frozenset()) -> str:
    """The tree hash git would give these files: a `git archive` extracted elsewhere hashes the same.

    `without`: paths (relative, posix) left out, as git leaves out files it does not track.
    """

    def tree(d: Path, prefix: str) -> bytes:
        entries: list[tuple[str, bytes]] = []
        for child in d.iterdir():
            if child.name in _SKIP_DIRS or prefix + child.name in without:
                continue
            st = child.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(child).encode()
                entries.append((child.name, b"120000 " + child.name.encode() + b"\0" + _blob(data)))
            elif stat.S_ISDIR(st.st_mode):
                if (child / CONTRACT_FILE).exists():
                    continue  # a run directory inside a plain source tree is output, not code
                sub = tree(child, prefix + child.name + "/")
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

    digest = tree(root, "")
    return digest.hex() if digest else ""


def _blob(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def code_identity(
    code_dir: str | os.PathLike[str] | None,
    *,
    use_git: bool = True,
    files: Iterable[str | os.PathLike[str]] = (),
    known: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """{commit, tree, dirty, dirty_sha256, untracked, modified}; commit is None for a plain source tree (e.g. an
    extracted archive).

    `files` are the running program's own files (`running_files`): each that git does not track, or whose content
    differs from HEAD, is part of the identity by content, `untracked` or `modified` ({path: sha256}), and makes
    the tree `dirty`. `known`, a recorded contract's fields, adds the paths that run recorded there, so that a
    check made without the program (prepare, preflight) looks at the same files. A plain tree has no HEAD: the
    recorded untracked files are hashed apart from its tree, which is then the tree of the commit they lay beside.
    use_git=False hashes the files as git would without running git: for a tree that came from a bundle,
    where a planted `.git/` (core.fsmonitor, hooks) or one in a parent folder would make git run its commands.
    The private key `_tracked_dirty` is `dirty` in its sense before untracked files counted (build_contract).
    """
    if code_dir is None:
        return {
            "commit": None,
            "tree": None,
            "dirty": None,
            "dirty_sha256": None,
            "untracked": {},
            "modified": {},
            "_tracked_dirty": None,
        }
    root = Path(code_dir).resolve()
    was_untracked = _paths_of(known, "code.untracked")
    was_modified = _paths_of(known, "code.modified")
    top = _git(root, "rev-parse", "--show-toplevel") if use_git else None
    if top is not None and Path(top).resolve() == root:
        commit = _git(root, "rev-parse", "HEAD")
        tree = _git(root, "rev-parse", "HEAD^{tree}")
        status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
        tracked_dirty = bool(status)
        diff = _git(root, "diff", "HEAD", "--binary") if tracked_dirty else None
        wanted = sorted(set(_relative(root, files)) | set(was_untracked) | set(was_modified))
        untracked, modified = _against_head(root, wanted)
        return {
            "commit": commit,
            "tree": tree,
            "dirty": tracked_dirty or bool(untracked),
            "dirty_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
            "untracked": untracked,
            "modified": modified,
            "_tracked_dirty": tracked_dirty,
        }
    untracked = {rel: sha256_or_none(_inside(root, rel)) for rel in was_untracked}
    modified = {rel: sha256_or_none(_inside(root, rel)) for rel in was_modified}
    return {
        "commit": None,
        "tree": _git_tree_of_dir(root, frozenset(was_untracked)),
        "dirty": bool(untracked or modified),
        "dirty_sha256": None,
        "untracked": untracked,
        "modified": modified,
        "_tracked_dirty": False,
    }


def running_files(code_dir: str | os.PathLike[str] | None, script: str | None = None) -> list[str]:
    """The program's own files under code_dir, relative to it: the script (torchrun's, `sys.argv[0]`) and every
    module imported from code_dir so far, except those of a virtual environment that lies inside it."""
    if code_dir is None:
        return []
    root = Path(code_dir).resolve()
    main = script or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None)
    candidates = [main, getattr(sys.modules.get("__main__"), "__file__", None)]
    candidates += [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    # Most modules (torch's thousand) lie elsewhere: a prefix test first, symlinks resolved only for the rest.
    prefixes = (str(root) + os.sep, os.path.abspath(code_dir) + os.sep)
    near = [os.path.abspath(c) for c in candidates if isinstance(c, str) and c]
    return sorted(set(_relative(root, [c for c in near if c.startswith(prefixes)])))


def _relative(root: Path, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Paths (absolute, or relative to root) of files under root, relative to it; others are left out."""
    out = []
    prefix = str(root) + os.sep
    for path in paths:
        resolved = os.path.realpath(os.path.join(root, path))
        if not resolved.startswith(prefix) or not os.path.isfile(resolved):
            continue
        rel = Path(resolved).relative_to(root)
        if any(p in _SKIP_DIRS or p.endswith(("site-packages", "dist-packages")) for p in rel.parts[:-1]):
            continue  # a virtual environment (or a cache) inside the code directory is not the code
        if "\n" not in rel.as_posix():
            out.append(rel.as_posix())
    return out


def _paths_of(known: Mapping[str, Any] | None, key: str) -> list[str]:
    value = (known or {}).get(key)
    return sorted(str(k) for k in value) if isinstance(value, dict) else []


def _inside(root: Path, rel: str) -> Path:
    """root/rel, or a path that never reads (root/..) when rel is absolute or leads out of root."""
    joined = root / rel
    if Path(rel).is_absolute() or not os.path.realpath(joined).startswith(str(root) + os.sep):
        return root / ".."
    return joined


def _against_head(root: Path, rels: list[str]) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """({path: sha256} of those git does not have in HEAD, {path: sha256} of those whose content differs)."""
    if not rels:
        return {}, {}
    head: dict[str, str] = {}
    listing = _git_bytes(root, "--literal-pathspecs", "ls-tree", "-r", "-z", "HEAD", "--", *rels)
    for entry in (listing or b"").split(b"\0"):
        meta, _, name = entry.partition(b"\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == b"blob":
            head[name.decode("utf-8", "surrogateescape")] = parts[2].decode()
    present = [rel for rel in rels if (root / rel).is_file()]
    # git's own blob id of each working file (clean filters and line endings applied as for a commit)
    ids = (
        _git_bytes(root, "hash-object", "--stdin-paths", stdin="\n".join(present).encode())
        if present
        else b""
    )
    working = dict(zip(present, (ids or b"").decode().split(), strict=False))
    untracked: dict[str, str | None] = {}
    modified: dict[str, str | None] = {}
    for rel in rels:
        if rel not in head:
            if rel in working or (root / rel).exists():
                untracked[rel] = sha256_or_none(root / rel)
        elif working.get(rel) != head[rel]:
            modified[rel] = sha256_or_none(root / rel)
    return untracked, modified


def _git_bytes(code_dir: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], input=stdin, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def node_fingerprint(code_dir: str | os.PathLike[str] | None, pins: list[str]) -> dict[str, Any]:
    """What every node of a run must share with rank 0's: the versions (python, torch, torchrelay, each pin; a pin
    not met here is refused here) and the content of the program's own files, relative to this node's code
    directory (a node-local checkout may lie elsewhere, it may not differ)."""
    root = Path(code_dir).resolve() if code_dir is not None else None
    files = running_files(code_dir)
    return {
        "versions": versions(pins),
        "code": {rel: sha256_or_none(root / rel) for rel in files} if root is not None else {},
    }


def fingerprint_summary(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The versions and one digest of the program files: what every rank sends at open (the files themselves
    only when a digest differs, to name them)."""
    code = json.dumps(fingerprint.get("code") or {}, sort_keys=True).encode()
    return {"versions": fingerprint.get("versions") or {}, "code_sha256": hashlib.sha256(code).hexdigest()}


def fingerprint_differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """`what: reference's -> other's` for each version and each program file (present on both) that differ."""
    out = []
    ref_v, other_v = reference.get("versions") or {}, other.get("versions") or {}
    for name in sorted(set(ref_v) | set(other_v)):
        if ref_v.get(name) != other_v.get(name):
            out.append(f"{name} {ref_v.get(name)} -> {other_v.get(name)}")
    ref_c, other_c = reference.get("code") or {}, other.get("code") or {}
    for rel in sorted(set(ref_c) & set(other_c)):
        if ref_c[rel] != other_c[rel]:
            out.append(f"{rel} sha256 {str(ref_c[rel])[:12]}… -> {str(other_c[rel])[:12]}…")
    return out


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
