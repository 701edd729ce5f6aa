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
from torchrelay.errors import ConfigError, RelayError
from torchrelay.layout import CONTRACT_FILE, SOURCE_MANIFEST
from torchrelay.util.hashing import sha256_or_none
from torchrelay.util.safepath import read_regular

_SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def _git(code_dir: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_tree_of_dir(
    root: Path, without: frozenset[str] = frozenset(), skip: Path | None = None, *, runs: bool = True
) -> str:
    """The tree hash git would give these files: a `git archive` extracted elsewhere hashes the same, run
    directories it tracks (a fixture, an example run) included.

    `without`: paths (relative, posix) left out, as git leaves out files it does not track; `skip`: a folder left
    out (the run's own directory, when it lies inside the code directory: output, not code); runs=False: every run
    directory is left out (a tree no commit records, where a run directory can only be output).
    """

    def tree(d: Path, prefix: str) -> bytes:
        entries: list[tuple[str, bytes]] = []
        for child in d.iterdir():
            if child.name in _SKIP_DIRS or prefix + child.name in without or child == skip:
                continue
            st = child.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(child).encode()
                entries.append((child.name, b"120000 " + child.name.encode() + b"\0" + _blob(data)))
            elif stat.S_ISDIR(st.st_mode):
                if not runs and (child / CONTRACT_FILE).exists():
                    continue
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
    was_untracked = _paths_of(known, "code.untracked")
    was_modified = _paths_of(known, "code.modified")
    was_program = [str(p) for p in (known or {}).get("code.program") or [] if isinstance(p, str)]
    # A contract written before `code.program` existed keeps its sense of a plain tree: only what it recorded.
    legacy = known is not None and "code.program" not in known
    program = sorted(set(_relative(root, files)) | set(_relative(root, was_program)))
    top = _git(root, "rev-parse", "--show-toplevel") if use_git else None
    if top is not None and Path(top).resolve() == root:
        commit = _git(root, "rev-parse", "HEAD")
        tree = _git(root, "rev-parse", "HEAD^{tree}")
        status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
        tracked_dirty = bool(status)
        diff = _git(root, "diff", "HEAD", "--binary") if tracked_dirty else None
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
            "changed": _changed_in_git(root, set(wanted), skip),
            "_tracked_dirty": tracked_dirty,
        }
    commit = (known or {}).get("code.commit")
    if commit is None and not legacy:  # no commit anywhere: every file of the program is there by content
        was_untracked = sorted(set(was_untracked) | set(program))
    untracked = {rel: sha256_or_none(_inside(root, rel)) for rel in was_untracked}
    modified = {rel: sha256_or_none(_inside(root, rel)) for rel in was_modified}
    tree = _git_tree_of_dir(root, frozenset(was_untracked), skip, runs=commit is not None)
    ours = set(was_untracked) | set(was_modified)
    changed: dict[str, str | None] | None
    if commit is None:
        changed = {rel: sha for rel, sha in _listing(root, skip, runs=False).items() if rel not in ours}
    elif tree == (known or {}).get("code.tree"):
        changed = {}  # the commit's own tree: nothing else differs from it
    else:
        changed = _changed_from_manifest(root, ours, skip)
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


# A changed file that is not code is named by its SHA-256 up to this size, by its size beyond (a dataset left in
# the tree is not read at every open).
_HASHED_UP_TO = 64 << 20


def _file_id(path: Path) -> str | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "symlink:" + os.readlink(path)
    if not stat.S_ISREG(st.st_mode):
        return "special"  # a FIFO or a device is never opened: reading one could block or never end
    if st.st_size > _HASHED_UP_TO:
        return f"size:{st.st_size}"
    return sha256_or_none(path)


def _is_run_output(root: Path, rel: str, skip: Path | None, cache: dict[Path, bool]) -> bool:
    """Whether rel lies in a run directory (a folder holding a resume contract) that git does not track."""
    folder = (root / rel).parent
    while folder != root and root in folder.parents:
        if folder not in cache:
            cache[folder] = folder == skip or (folder / CONTRACT_FILE).is_file()
        if cache[folder]:
            return True
        folder = folder.parent
    return False


def _changed_in_git(root: Path, program: set[str], skip: Path | None) -> dict[str, str | None]:
    """Every file git reports as changed (tracked and edited, deleted, or new and not ignored), except the
    program's own and untracked run directories: {path: sha256, None when deleted}."""
    listing = _git_bytes(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames")
    out: dict[str, str | None] = {}
    cache: dict[Path, bool] = {}
    for entry in (listing or b"").split(b"\0"):
        if len(entry) < 4:
            continue
        code, rel = entry[:2], entry[3:].decode("utf-8", "surrogateescape")
        if rel in program or "\n" in rel:
            continue
        if code == b"??" and _is_run_output(root, rel, skip, cache):
            continue
        out[rel] = _file_id(root / rel) if (root / rel).exists() or (root / rel).is_symlink() else None
    return out


def _listing(root: Path, skip: Path | None, *, runs: bool = True) -> dict[str, str | None]:
    """{path: id} of every file under root (symlinks as their target), as git would see them; runs=False leaves
    out run directories, as _git_tree_of_dir does."""
    out: dict[str, str | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and here / d != skip and (runs or not (here / d / CONTRACT_FILE).exists())
        ]
        names = filenames + [d for d in dirnames if (here / d).is_symlink()]
        for name in names:
            rel = (here / name).relative_to(root).as_posix()
            if "\n" not in rel:
                out[rel] = _file_id(here / name)
    return out


def _source_manifest(tree: Path) -> Path | None:
    """The source manifest of a tree extracted from a bundle: beside it in the bundle's source/, or at the top of
    the run directory `prepare` made (DIR/source/<tree>); None for any other tree."""
    for path in (tree.parent / SOURCE_MANIFEST, tree.parent.parent / SOURCE_MANIFEST):
        if tree.parent.name == "source" and path.is_file():
            return path
    return None


def _changed_from_manifest(root: Path, ours: set[str], skip: Path | None) -> dict[str, str | None] | None:
    """For a tree extracted from a bundle that no longer hashes to its commit's tree: each file that differs from
    the bundle's source manifest (`source_manifest.sha256`, beside the tree), or None without one."""
    manifest = _source_manifest(root)
    if manifest is None:
        return None
    try:  # the one safe way to open a file that may be hostile: no link followed, no FIFO, bounded
        lines = read_regular(manifest, 64 << 20, what="the bundle's source manifest").decode().splitlines()
    except (RelayError, OSError, UnicodeDecodeError):
        return None  # files that cannot be named: the tree's hash decides (code_changes refuses a change)
    prefix = root.name + "/"
    packed: dict[str, str] = {}
    for line in lines:
        sha, _, name = line.partition("  ")
        if name.startswith(prefix):
            packed[name.removeprefix(prefix)] = sha
    now = _listing(root, skip)
    return {
        rel: now.get(rel)
        for rel in sorted(set(packed) | set(now))
        if rel not in ours and packed.get(rel) != now.get(rel)
    }


CODE_FIELDS = (
    "code.commit",
    "code.tree",
    "code.dirty",
    "code.dirty_sha256",
    "code.untracked",
    "code.modified",
    "code.program",
    "code.changed",
)
_ABSENT = "<absent>"  # as contract_diff words a side without the value
_BY_FILE = ("code.untracked", "code.modified", "code.changed")


def code_changes(
    recorded: Mapping[str, Any], now: Mapping[str, Any], *, strict: bool = False
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """The one code-identity rule (docs/CODE_IDENTITY.md): (refused, other) differences, each (field, old, new).

    Refused: another commit, or a file of the program (the script and the modules it imports from the code
    directory, recorded then or imported now) whose content differs. Other: any other file of the tree that
    differs (named `code.changed[path]`), and the tree fields it moves; `strict` refuses those too. A contract
    written before the program was recorded (no `code.program`) refuses any change of its tree, as it did.
    """
    refused: list[tuple[str, Any, Any]] = []
    other: list[tuple[str, Any, Any]] = []
    a_commit, b_commit = recorded.get("code.commit"), now.get("code.commit")
    if a_commit is not None and b_commit is not None and a_commit != b_commit:
        refused.append(("code.commit", a_commit, b_commit))
    legacy = "code.program" not in recorded
    program = {str(p) for p in [*(recorded.get("code.program") or []), *(now.get("code.program") or [])]}
    keys = [
        k for k in _BY_FILE if k in recorded and k in now
    ]  # a field written later is compared when both have it
    sides = []
    for fields in (recorded, now):
        delta: dict[str, tuple[str, Any]] = {}
        for key in keys:
            value = fields.get(key)
            for name, sha in value.items() if isinstance(value, dict) else ():
                delta[str(name)] = (key, sha)
                if key != "code.changed":
                    program.add(str(name))
        sides.append(delta)
    old, new = sides
    unknown = "code.changed" in keys and now.get("code.changed") is None  # files that cannot be named
    named = False
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, (None, _ABSENT))[1], new.get(name, (None, _ABSENT))[1]
        if a == b:
            continue
        named = True
        key = new.get(name, old.get(name, ("code.changed", None)))[0]
        (refused if name in program else other).append((f"{key}[{name}]", a, b))
    # the tree fields: the commit's own when both sides know it; else they say the tree moved
    both_commits = a_commit is not None and b_commit is not None
    for key in ("code.tree", "code.dirty", "code.dirty_sha256"):
        a, b = recorded.get(key, _ABSENT), now.get(key, _ABSENT)
        if a == b or (key == "code.tree" and both_commits):
            continue
        if legacy or (key == "code.tree" and (unknown or not named)):
            refused.append((key, a, b))  # a change no file of the program can be told apart from
        else:
            other.append((key, a, b))
    if strict:
        refused, other = refused + other, []
    return sorted(refused), sorted(other)


def tree_note(other: list[tuple[str, Any, Any]], *, commit: bool) -> str | None:
    """The warning (and segment note) for changes of the tree outside the program, each file named, or None;
    commit: the run has one (a file absent from code.changed is then as in the commit, not missing)."""
    if not other:
        return None
    words = []
    for key, old, new in other:
        if not key.startswith("code.changed["):
            continue
        if new is None:
            what = "deleted"
        elif new == _ABSENT:
            what = "as in the commit again" if commit else "removed"
        else:
            what = "new" if old == _ABSENT and not commit else "changed"
        words.append(f"{key.removeprefix('code.changed[')[:-1]} ({what})")
    named = ", ".join(words) or ", ".join(f"{k}: {o!r} -> {n!r}" for k, o, n in other)
    return (
        f"the code directory changed outside the program since the run recorded it: {named}; recorded, not "
        "refused (the code is the commit, the script and the modules it imports; strict_code: true refuses any "
        "change)"
    )


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
    """The git top level holding the running script; else the source tree `prepare` extracted that holds it (the
    folder beside a `source_manifest.sha256`: the script may lie deeper, as examples/train.py of a repository);
    else the script's own folder."""
    path = Path(script or sys.argv[0] or ".").resolve()
    folder = path if path.is_dir() else path.parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top:
        return Path(top)
    for tree in (folder, *folder.parents):
        if tree.parent != tree and _source_manifest(tree) is not None:
            return tree
    return folder


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
