"""The exact source of a run, for a bundle: a `git archive` of the recorded commit, an archive of the program's
files git does not track (a script not yet committed), a `git bundle` of its branch, and a manifest of the
archives' files; or, for a run trained from a plain tree, a tarball of it."""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from torchrelay.errors import ConfigError, IntegrityError, UnsafeInput
from torchrelay.identity import code_identity
from torchrelay.paths.layout import CONTRACT_FILE, SOURCE_DIR, SOURCE_MANIFEST
from torchrelay.util.safepath import NAME_LIMIT, PATH_LIMIT, check_relative

_SKIP = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


@dataclass(slots=True)
class SourceInfo:
    """What `pack` wrote under source/ (paths relative to the bundle) and how it proved them exact."""

    archive: str | None = None
    archive_prefix: str | None = None
    git_bundle: str | None = None
    branch: str | None = None
    commit: str | None = None
    tree: str | None = None
    manifest: str | None = None
    untracked: str | None = None  # an archive of the run's code files git does not track, same prefix
    untracked_files: list[str] = field(default_factory=list)
    proofs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


# A git that never answers (a hung credential helper, a dead network mount) must not hang `pack`; an archive or a
# bundle of a large history is given minutes.
GIT_TIMEOUT_S = 600.0


def _git(code_dir: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess[Any]:
    try:
        return subprocess.run(
            ["git", "-C", str(code_dir), *args],
            capture_output=True,
            text=not binary,
            check=False,
            timeout=GIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{code_dir}: `git {args[0] if args else ''}` did not finish in {GIT_TIMEOUT_S:g} s",
            hint="check that git answers in that checkout (a credential helper, a network mount), then try again",
        ) from None


def write_source(
    code: dict[str, Any],
    code_dir: Path | None,
    out_dir: Path,
    *,
    allow_dirty: bool,
    run_dir: Path | None = None,
    strict_code: bool = False,
) -> SourceInfo:
    """Write the source recorded by the contract's code identity into `out_dir` (the bundle's source/)."""
    info = SourceInfo(commit=code.get("commit"), tree=code.get("tree"))
    # Untracked files of the program (a script not yet committed) are carried below; edits of its tracked files
    # are not: the archive of the commit would not be the code that ran. Other changed files of the tree are not
    # the code (docs/CODE_IDENTITY.md): left behind, with a warning, unless the run asked for strict_code.
    untracked = code.get("untracked") or {}
    changed = sorted(code.get("changed") or {})
    if "program" in code:
        tracked_changes = bool(code.get("modified")) or (strict_code and bool(changed))
        what = sorted(code.get("modified") or {}) + (changed if strict_code else [])
    else:  # a contract written before the program was recorded: any change of a tracked file
        tracked_changes = (
            code.get("dirty_sha256") is not None
            or bool(code.get("modified"))
            or (bool(code.get("dirty")) and not untracked)
        )
        what = sorted(code.get("modified") or {})
    if changed and not tracked_changes and "program" in code:
        info.warnings.append(
            f"changed files of the tree that are not the program's are not carried: {', '.join(changed[:10])}"
            f"{' ...' if len(changed) > 10 else ''} (the contract's code.changed records them)"
        )
    if tracked_changes:
        named = f" ({', '.join(what[:10])}{' ...' if len(what) > 10 else ''})" if what else ""
        message = (
            f"the run was trained from a git tree with uncommitted changes{named} "
            f"(code.dirty_sha256 {str(code.get('dirty_sha256'))[:16]}...): no archive can reproduce that code"
        )
        if not allow_dirty:
            raise ConfigError(
                message,
                hint="commit the changes and start a new run, or pass --allow-dirty to pack without exact source",
            )
        info.warnings.append(
            message + "; packed anyway (--allow-dirty): a continuation's contract check will fail"
        )
    if not code.get("tree"):
        info.warnings.append("the contract records no code identity: no source is included")
        return info
    if code_dir is None:
        raise ConfigError(
            f"the run's code (commit {code.get('commit')}, tree {code.get('tree')}) must be packed, "
            "but no code directory was given",
            hint="pass --code-dir with the git checkout (or plain tree) the run was trained from",
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if code.get("commit"):
        _from_git(info, Path(code_dir), out_dir)
        if untracked:
            extra = _carry_untracked(info, Path(code_dir), out_dir, untracked)
            assert info.archive is not None  # _from_git wrote it
            base = gzip.decompress((out_dir / Path(info.archive).name).read_bytes())
            info.manifest = _write_manifest(base, out_dir, extra)
    else:
        _from_plain_tree(info, Path(code_dir), out_dir, untracked, run_dir)
    return info


def _carry_untracked(info: SourceInfo, code_dir: Path, out_dir: Path, files: dict[str, Any]) -> bytes:
    """source/<prefix>.untracked.tar.gz: the program's files git does not track, each the content the run
    recorded (code.untracked), under the archive's prefix so that they land beside the commit's files."""
    prefix = str(info.archive_prefix)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, want in sorted(files.items()):
            path = code_dir / check_relative(rel, source="contract code.untracked")
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ConfigError(
                    f"{path} cannot be read ({exc.strerror}): the run ran it, and git does not track it",
                    hint="restore the file as it was when the run trained, or pass --code-dir with that tree",
                ) from exc
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                raise IntegrityError(
                    f"{path} changed since the run recorded it (sha256 {got[:16]}..., the run ran "
                    f"{str(want)[:16]}...): the bundle must carry the code that ran",
                    hint="restore the file as it was when the run trained (git does not track it), then pack",
                )
            ti = tarfile.TarInfo(f"{prefix}/{rel}")
            ti.size, ti.mtime = len(data), 0
            ti.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(ti, io.BytesIO(data))
    archive = out_dir / f"{prefix}.untracked.tar.gz"
    with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(buf.getvalue())
    info.untracked, info.untracked_files = f"{SOURCE_DIR}/{archive.name}", sorted(files)
    info.proofs.append(
        f"{info.untracked}: {len(files)} file(s) git does not track ({', '.join(sorted(files)[:5])}"
        f"{', ...' if len(files) > 5 else ''}) = contract code.untracked (SHA-256)"
    )
    return buf.getvalue()


def _from_git(info: SourceInfo, code_dir: Path, out_dir: Path) -> None:
    commit = str(info.commit)
    if _git(code_dir, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ConfigError(
            f"{code_dir} does not hold commit {commit}, which the run was trained from",
            hint="pass --code-dir with a clone that has this commit (git fetch it first)",
        )
    tree = _git(code_dir, "rev-parse", f"{commit}^{{tree}}").stdout.strip()
    if tree != info.tree:
        raise IntegrityError(f"commit {commit} has tree {tree}, but the contract records tree {info.tree}")
    info.proofs.append(f"git rev-parse {commit[:12]}^{{tree}} = {tree} = contract code.tree")
    name = code_dir.resolve().name or "source"
    prefix = f"{name}-{commit[:7]}"
    archive = out_dir / f"{prefix}.tar.gz"
    # `git archive` output is deterministic for a commit; gzip -n keeps it so (no name or time stamp).
    tar = _git(code_dir, "archive", "--format=tar", f"--prefix={prefix}/", commit, binary=True)
    if tar.returncode != 0:
        raise ConfigError(f"git archive {commit} failed in {code_dir}: {tar.stderr.decode(errors='replace')}")
    with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(tar.stdout)
    info.archive, info.archive_prefix = f"{SOURCE_DIR}/{archive.name}", prefix
    info.manifest = _write_manifest(tar.stdout, out_dir)
    info.proofs.append(f"{info.archive} = git archive {commit[:12]} (prefix {prefix}/)")

    branch = _branch_containing(code_dir, commit)
    if branch is None:
        info.warnings.append(
            f"no local branch contains {commit[:12]}: no git history (git bundle) is included"
        )
        return
    safe = branch.replace("/", "_")
    bundle = out_dir / f"{safe}.bundle"
    made = _git(code_dir, "bundle", "create", str(bundle.resolve()), branch)
    if made.returncode != 0:
        info.warnings.append(f"git bundle create failed ({made.stderr.strip()}): no git history included")
        bundle.unlink(missing_ok=True)
        return
    info.git_bundle, info.branch = f"{SOURCE_DIR}/{bundle.name}", branch
    tip = _git(code_dir, "rev-parse", branch).stdout.strip()
    info.proofs.append(f"{info.git_bundle}: branch {branch}, tip {tip[:12]}, contains {commit[:12]}")


def _branch_containing(code_dir: Path, commit: str) -> str | None:
    current = _git(code_dir, "symbolic-ref", "--quiet", "--short", "HEAD").stdout.strip()
    listed = _git(code_dir, "branch", "--contains", commit, "--format=%(refname:short)").stdout.split()
    if current and current in listed:
        return current
    return listed[0] if listed else None


def _from_plain_tree(
    info: SourceInfo,
    code_dir: Path,
    out_dir: Path,
    untracked: dict[str, Any] | None = None,
    run_dir: Path | None = None,
) -> None:
    # A plain tree's recorded untracked files (its program) are hashed apart from its tree.
    known = {"code.untracked": untracked or {}}
    tree = code_identity(code_dir, use_git=False, known=known, run_dir=run_dir)["tree"]
    if tree != info.tree:
        raise IntegrityError(
            f"{code_dir} hashes to tree {tree}, but the run was trained from tree {info.tree}",
            hint="pass --code-dir with the exact source tree the run was trained from",
        )
    info.proofs.append(f"{code_dir} has git tree hash {tree} = contract code.tree")
    prefix = f"{code_dir.resolve().name}-{str(tree)[:7]}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(_plain_files(code_dir, run_dir)):
            rel = path.relative_to(code_dir).as_posix()
            ti = tar.gettarinfo(str(path), arcname=f"{prefix}/{rel}")
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            if (
                ti.islnk()
            ):  # a second name of a file already added: carried as the file (prepare takes no hard link)
                ti.type, ti.linkname, ti.size = tarfile.REGTYPE, "", path.stat().st_size
            if ti.isreg():
                with open(path, "rb") as f:
                    tar.addfile(ti, f)
            else:
                tar.addfile(ti)
    archive = out_dir / f"{prefix}.tar.gz"
    with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(buf.getvalue())
    info.archive, info.archive_prefix = f"{SOURCE_DIR}/{archive.name}", prefix
    info.manifest = _write_manifest(buf.getvalue(), out_dir)
    info.warnings.append("the run was trained from a plain tree (no git commit): no git history is included")


def _plain_files(root: Path, run_dir: Path | None = None) -> list[Path]:
    """The files a plain tree's hash covers (identity/files.git_tree_of_dir, runs=False): run directories left out."""
    out: list[Path] = []
    skip = run_dir.resolve() if run_dir is not None else None
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP and (here / d).resolve() != skip and not (here / d / CONTRACT_FILE).exists()
        ]
        out.extend(Path(dirpath) / n for n in filenames)
        out.extend(Path(dirpath) / d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))
    return out


def _write_manifest(tar_bytes: bytes, out_dir: Path, *more: bytes) -> str:
    """source_manifest.sha256: `sha256sum` lines for every regular file inside the archive(s)."""
    lines = []
    for one in (tar_bytes, *more):
        with tarfile.open(fileobj=io.BytesIO(one), mode="r:") as tar:
            for member in tar.getmembers():
                if member.isreg():
                    data = tar.extractfile(member)
                    assert data is not None  # a regular member always has data
                    lines.append(f"{hashlib.sha256(data.read()).hexdigest()}  {member.name}\n")
    (out_dir / SOURCE_MANIFEST).write_text("".join(sorted(lines, key=lambda s: s[66:])))
    return f"{SOURCE_DIR}/{SOURCE_MANIFEST}"


def extract_source(archive: Path, dest: Path, prefix: str) -> Path:
    """Extract an (untrusted) source archive into `dest/prefix`; refuse anything but plain files, folders and
    symbolic links that stay inside it, and any `.git` (a planted repository makes git run its config's
    commands); return the folder. Nothing is written through a link: each member is created relative to its
    folder's descriptor, every folder on the way opened without following a link (tarfile's own "data" filter
    resolved a chain of links as text past PATH_MAX and wrote outside: CVE-2025-4517)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = tar.getmembers()
            links = {check_relative(m.name, source=archive.name): m.linkname for m in members if m.issym()}
            seen: set[PurePosixPath] = set()
            room = PATH_LIMIT - len(os.fsencode(dest)) - 1
            for member in members:
                _check_member(archive, member, prefix, links=links, seen=seen, room=room)
            _check_space(archive, members, dest)
            _extract(archive, tar, members, dest)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)[:200]
        raise IntegrityError(f"{archive}: cannot extract ({why})", hint="re-download the bundle") from exc
    return dest / prefix


# Room kept free beside what a source archive unpacks to: the run prepared beside it still has its files to write.
_SPARE_BYTES = 64 << 20


def _check_space(archive: Path, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Refuse an archive whose files would not fit where it is extracted, before a byte of it is written: a
    compressed bomb (a megabyte of zeros unpacking to a terabyte) filled the disk of the host it was prepared on.
    Each member's size is its header's, read with the headers; the extraction writes exactly that many bytes."""
    total = sum(m.size for m in members if m.isreg())
    free = shutil.disk_usage(dest).free
    if total + _SPARE_BYTES > free:
        raise IntegrityError(
            f"{archive}: its files unpack to {total >> 20} MiB; {dest} has {free >> 20} MiB free",
            hint="free space where the run is prepared; a source archive that `pack` wrote holds the run's code, "
            "so one this large is likely forged: re-download the bundle",
        )


def _check_member(
    archive: Path,
    member: tarfile.TarInfo,
    prefix: str,
    *,
    links: dict[PurePosixPath, str],
    seen: set[PurePosixPath],
    room: int,
) -> None:
    """Every member is checked before the first byte lands: a refusal leaves nothing half-extracted. No member
    lies under a link (`pack` writes none), and a link's target is resolved through the archive's other links, as
    the file system will: it must end inside `prefix`, outside any `.git`."""

    def refuse(why: str) -> UnsafeInput:
        return UnsafeInput(
            f"{archive}: member {_short(member.name)} refused: {why}; nothing was extracted",
            hint="a source archive that `pack` wrote holds only the run's files; this one is damaged or forged",
        )

    try:
        rel = check_relative(member.name, source="its name")
    except UnsafeInput as exc:
        raise refuse(f"not a safe relative path ({exc.message})") from None
    if rel.parts[0] != prefix:
        raise refuse(f"outside the expected folder {prefix}/")
    if len(os.fsencode(str(rel))) > room:
        raise refuse(
            f"its path would be longer than a path can be ({PATH_LIMIT} bytes) where it is extracted"
        )
    if rel in seen:
        raise refuse("it is in the archive twice")
    seen.add(rel)
    if any(PurePosixPath(*rel.parts[:k]) in links for k in range(1, len(rel.parts))):
        raise refuse("it lies under a symbolic link of the archive")
    if member.islnk():  # neither `git archive` nor a plain tree's archive (below) writes one
        raise refuse(f"a hard link (links to {_short(member.linkname)}), which pack never writes")
    if not (member.isfile() or member.isdir() or member.issym()):
        raise refuse("a device, pipe or other special file")
    if member.issym():
        link = member.linkname
        if not link or link.startswith("/") or len(link) > PATH_LIMIT or "\0" in link:
            raise refuse(f"links to {_short(link)}, outside {prefix}/")
        if any(len(os.fsencode(part)) > NAME_LIMIT for part in link.split("/")):
            raise refuse(f"links to {_short(link)}, a name longer than a name can be")
        # resolved as the file system will resolve it once extracted: against the member's folder, one part at a
        # time, and through every link of the archive on the way (a `..` after a link climbs from wherever that
        # link leads; text alone would climb from the link's own folder: CVE-2025-4517)
        where = _resolve(list(rel.parent.parts), link, links, hops=[_MAX_HOPS])
        if where is _LOOP:
            raise refuse(f"links to {_short(link)}, through a loop of symbolic links")
        if not where or where[0] != prefix:
            raise refuse(f"links to {_short(link)}, outside {prefix}/")
        if any(part.lower() == ".git" for part in where):
            raise refuse("links into a .git folder")


_LOOP: list[str] = []  # _resolve's answer for a chain of links longer than the kernel follows
_MAX_HOPS = 40  # Linux's MAXSYMLINKS


def _resolve(
    where: list[str], link: str, links: dict[PurePosixPath, str], *, hops: list[int]
) -> list[str] | None:
    """The folder parts `link` (a link's target, in the folder `where`) leads to through the archive's own
    `links` ({member: target}); None where it climbs above the archive's root or a link on the way is absolute,
    _LOOP where it takes more links than `hops` holds (counted over the whole lookup, as the kernel counts: links
    whose targets name other links many times over would otherwise take time exponential in their number)."""
    if link.startswith("/"):
        return None
    where = list(where)
    for part in link.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                return None
            where.pop()
            continue
        target = links.get(PurePosixPath(*where, part))
        if target is None:
            where.append(part)
            continue
        if hops[0] <= 0:
            return _LOOP
        hops[0] -= 1
        found = _resolve(where, target, links, hops=hops)
        if found is None or found is _LOOP:
            return found
        where = found
    return where


def _short(name: str, keep: int = 80) -> str:
    """A member's name for a message: a forged one may be kilobytes long."""
    return repr(name) if len(name) <= keep else f"{name[:keep]!r}... ({len(name):,} characters)"


def _extract(archive: Path, tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Create the checked members under `dest`, never following a link: a folder on the way is opened with
    O_NOFOLLOW relative to its parent's descriptor, a file is created new (O_EXCL, O_NOFOLLOW), a link made as
    it is recorded and never entered."""
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for member in members:
            parts = check_relative(member.name, source=archive.name).parts
            try:
                parent = _open_folders(root, parts[:-1])
                try:
                    _create(tar, member, parent, parts[-1])
                finally:
                    if parent != root:
                        os.close(parent)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
                    raise UnsafeInput(
                        f"{archive}: member {_short(member.name)} refused: it would be written through a link "
                        f"or over a file already there ({exc.strerror}); {dest} is partly extracted",
                        hint="a source archive that `pack` wrote holds only the run's files; it is forged",
                    ) from None
                raise IntegrityError(
                    f"{archive}: cannot extract member {_short(member.name)} ({exc.strerror or exc})",
                    hint="check the free space where the run is prepared, or re-download the bundle",
                ) from None
    finally:
        os.close(root)


def _open_folders(root: int, parts: tuple[str, ...]) -> int:
    fd = root
    for part in parts:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o755, dir_fd=fd)
        inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        if fd != root:
            os.close(fd)
        fd = inner
    return fd


def _create(tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
    if member.isdir():
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent)
        os.close(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent))
    elif member.issym():
        os.symlink(member.linkname, name, dir_fd=parent)
    else:
        mode = 0o755 if member.mode & 0o100 else 0o644
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        data = tar.extractfile(member)
        assert data is not None  # a regular member always has data
        with os.fdopen(os.open(name, flags, mode, dir_fd=parent), "wb") as out:
            shutil.copyfileobj(data, out)
