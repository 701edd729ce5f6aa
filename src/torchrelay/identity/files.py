"""A code tree's files as git sees them, with or without git: git's tree hash computed over the files, every file
that changed (against git's index, or against the source manifest of the bundle the tree came from), run
directories inside the tree left out (output, not code)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

from torchrelay.errors import RelayError
from torchrelay.paths.layout import CONTRACT_FILE, SOURCE_MANIFEST
from torchrelay.util.hashing import sha256_or_none
from torchrelay.util.safepath import read_regular

SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def git(code_dir: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_bytes(code_dir: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), *args], input=stdin, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_tree_of_dir(
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
            if child.name in SKIP_DIRS or prefix + child.name in without or child == skip:
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
                entries.append((child.name, mode + b" " + child.name.encode() + b"\0" + _blob_of_file(child)))
        if not entries:
            return b""
        body = b"".join(e for _, e in sorted(entries))
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    digest = tree(root, "")
    return digest.hex() if digest else ""


def _blob(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


_BLOCK = 1 << 20


def _blob_of_file(path: Path) -> bytes:
    """git's blob hash of a regular file, read a block at a time (a file read whole, then copied behind the
    header, took twice its size in memory: an extracted source archive's file may be a gzip bomb's gigabytes). A
    pipe or a device put there since the caller looked is not waited on, nor read for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        digest = hashlib.sha1(b"blob %d\0" % st.st_size)
        left = st.st_size  # the header's size is the bytes hashed: a file that grows is cut there
        while left > 0 and (chunk := f.read(min(left, _BLOCK))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.digest()


# A changed file that is not code is named by its SHA-256 up to this size, by its size beyond (a dataset left in
# the tree is not read at every open).
_HASHED_UP_TO = 64 << 20


def file_id(path: Path) -> str | None:
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


def changed_in_git(root: Path, program: set[str], skip: Path | None) -> dict[str, str | None]:
    """Every file git reports as changed (tracked and edited, deleted, or new and not ignored), except the
    program's own and untracked run directories: {path: sha256, None when deleted}."""
    listing = git_bytes(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames")
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
        out[rel] = file_id(root / rel) if (root / rel).exists() or (root / rel).is_symlink() else None
    return out


def listing(root: Path, skip: Path | None, *, runs: bool = True) -> dict[str, str | None]:
    """{path: id} of every file under root (symlinks as their target), as git would see them; runs=False leaves
    out run directories, as git_tree_of_dir does."""
    out: dict[str, str | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in SKIP_DIRS and here / d != skip and (runs or not (here / d / CONTRACT_FILE).exists())
        ]
        names = filenames + [d for d in dirnames if (here / d).is_symlink()]
        for name in names:
            rel = (here / name).relative_to(root).as_posix()
            if "\n" not in rel:
                out[rel] = file_id(here / name)
    return out


def source_manifest(tree: Path) -> Path | None:
    """The source manifest of a tree extracted from a bundle: beside it in the bundle's source/, or at the top of
    the run directory `prepare` made (DIR/source/<tree>); None for any other tree."""
    for path in (tree.parent / SOURCE_MANIFEST, tree.parent.parent / SOURCE_MANIFEST):
        if tree.parent.name == "source" and path.is_file():
            return path
    return None


def changed_from_manifest(root: Path, ours: set[str], skip: Path | None) -> dict[str, str | None] | None:
    """For a tree extracted from a bundle that no longer hashes to its commit's tree: each file that differs from
    the bundle's source manifest (`source_manifest.sha256`, beside the tree), or None without one."""
    manifest = source_manifest(root)
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
    now = listing(root, skip)
    return {
        rel: now.get(rel)
        for rel in sorted(set(packed) | set(now))
        if rel not in ours and packed.get(rel) != now.get(rel)
    }
