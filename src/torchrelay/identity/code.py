"""Who trained what: the code's identity (git commit, tree hash, dirty flag, the program's own files) and where
the code directory of a running script is."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torchrelay.errors import UnsafeInput
from torchrelay.identity.files import (
    SKIP_DIRS,
    changed_from_manifest,
    changed_in_git,
    git,
    git_bytes,
    git_tree_of_dir,
    listing,
    source_manifest,
)
from torchrelay.util.hashing import sha256_or_none


def code_identity(
    code_dir: str | os.PathLike[str] | None,
    *,
    use_git: bool = True,
    files: Iterable[str | os.PathLike[str]] = (),
    known: Mapping[str, Any] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """{commit, tree, dirty, dirty_sha256, untracked, modified, program, changed} (docs/CODE_IDENTITY.md).

    The code is the commit (None for a plain tree) plus the program: the script and the modules it imports from
    code_dir (`files`, from `running_files`), tracked or not. `program` lists their paths; each that differs from
    the commit is there by content (`untracked`, `modified`: {path: sha256}). `changed` is every other file of the
    tree that differs from the commit ({path: sha256, None when deleted}; for a tree without a commit, every other
    file; None when the tree differs in files that cannot be named). `known`, a recorded contract's fields, adds
    the files that run recorded, so that a check made without the program (prepare, preflight) looks at the same
    files. A plain tree that came from a bundle of a commit is that commit's tree (`tree`, the hash git gives it)
    with the recorded untracked files beside it. use_git=False hashes the files as git would without running git:
    for a tree that came from a bundle, where a planted `.git/` (core.fsmonitor, hooks) or one in a parent folder
    would make git run its commands. run_dir: the run's own directory, left out when it lies inside code_dir.
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
            "program": [],
            "changed": {},
            "_tracked_dirty": None,
        }
    root = Path(code_dir).resolve()
    skip = Path(run_dir).resolve() if run_dir is not None else None
    # the recorded contract's own paths (with or without git): each inside the code directory, or refused unread
    was_untracked = _paths_of(known, "code.untracked", root)
    was_modified = _paths_of(known, "code.modified", root)
    was_program = [str(p) for p in (known or {}).get("code.program") or [] if isinstance(p, str)]
    # A contract written before `code.program` existed keeps its sense of a plain tree: only what it recorded.
    legacy = known is not None and "code.program" not in known
    program = sorted(set(_relative(root, files)) | set(_relative(root, was_program)))
    top = git(root, "rev-parse", "--show-toplevel") if use_git else None
    if top is not None and Path(top).resolve() == root:
        commit = git(root, "rev-parse", "HEAD")
        tree = git(root, "rev-parse", "HEAD^{tree}")
        status = git(root, "status", "--porcelain", "--untracked-files=no") or ""
        tracked_dirty = bool(status)
        diff = git(root, "diff", "HEAD", "--binary") if tracked_dirty else None
        wanted = sorted(set(program) | set(was_untracked) | set(was_modified))
        untracked, modified = _against_head(root, wanted)
        return {
            "commit": commit,
            "tree": tree,
            "dirty": tracked_dirty or bool(untracked),
            "dirty_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
            "untracked": untracked,
            "modified": modified,
            "program": sorted(set(program) | set(untracked) | set(modified)),
            "changed": changed_in_git(root, set(wanted), skip),
            "_tracked_dirty": tracked_dirty,
        }
    commit = (known or {}).get("code.commit")
    if commit is None and not legacy:  # no commit anywhere: every file of the program is there by content
        was_untracked = sorted(set(was_untracked) | set(program))
    untracked = {rel: sha256_or_none(root / rel) for rel in was_untracked}
    modified = {rel: sha256_or_none(root / rel) for rel in was_modified}
    tree = git_tree_of_dir(root, frozenset(was_untracked), skip, runs=commit is not None)
    ours = set(was_untracked) | set(was_modified)
    changed: dict[str, str | None] | None
    if commit is None:
        changed = {rel: sha for rel, sha in listing(root, skip, runs=False).items() if rel not in ours}
    elif tree == (known or {}).get("code.tree"):
        changed = {}  # the commit's own tree: nothing else differs from it
    else:
        changed = changed_from_manifest(root, ours, skip)
    return {
        "commit": None,
        "tree": tree,
        "dirty": bool(untracked or modified),
        "dirty_sha256": None,
        "untracked": untracked,
        "modified": modified,
        "program": sorted(set(program) | ours),
        "changed": changed,
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
        if any(p in SKIP_DIRS or p.endswith(("site-packages", "dist-packages")) for p in rel.parts[:-1]):
            continue  # a virtual environment (or a cache) inside the code directory is not the code
        if "\n" not in rel.as_posix():
            out.append(rel.as_posix())
    return out


def _paths_of(known: Mapping[str, Any] | None, key: str, root: Path) -> list[str]:
    """The paths a recorded contract's field names ({path: sha256}), each a path inside root; one that is not
    (absolute, with a `..`, through a link out of root) is refused naming the field, before any file is read: its
    digest, printed in the contract's difference, would tell the content of any file the trainer can read."""
    value = (known or {}).get(key)
    if not isinstance(value, dict):
        return []
    prefix = str(root) + os.sep
    for rel in value:
        text = str(rel)
        parts = Path(text).parts
        if (
            not text
            or Path(text).is_absolute()
            or ".." in parts
            or "\0" in text
            or not os.path.realpath(root / text).startswith(prefix)
        ):
            raise UnsafeInput(
                f"contract field {key}: {text[:200]!r} is not a path inside the code directory {root} "
                "(absolute, '..', or a link out of it); nothing was read",
                hint="the contract is damaged or forged: restore the run's resume_contract.json (or the bundle)",
            )
    return sorted(str(k) for k in value)


def _against_head(root: Path, rels: list[str]) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """({path: sha256} of those git does not have in HEAD, {path: sha256} of those whose content differs)."""
    if not rels:
        return {}, {}
    head: dict[str, str] = {}
    listing = git_bytes(root, "--literal-pathspecs", "ls-tree", "-r", "-z", "HEAD", "--", *rels)
    for entry in (listing or b"").split(b"\0"):
        meta, _, name = entry.partition(b"\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == b"blob":
            head[name.decode("utf-8", "surrogateescape")] = parts[2].decode()
    present = [rel for rel in rels if (root / rel).is_file()]
    # git's own blob id of each working file (clean filters and line endings applied as for a commit)
    ids = (
        git_bytes(root, "hash-object", "--stdin-paths", stdin="\n".join(present).encode()) if present else b""
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


def find_code_dir(script: str | None = None) -> Path | None:
    """The git top level holding the running script; else the source tree `prepare` extracted that holds it (the
    folder beside a `source_manifest.sha256`: the script may lie deeper, as examples/train.py of a repository);
    else the script's own folder."""
    path = Path(script or sys.argv[0] or ".").resolve()
    folder = path if path.is_dir() else path.parent
    top = git(folder, "rev-parse", "--show-toplevel")
    if top:
        return Path(top)
    for tree in (folder, *folder.parents):
        if tree.parent != tree and source_manifest(tree) is not None:
            return tree
    return folder
