"""Paths read from a bundle or a run directory are untrusted: refuse absolute paths, `..`, `.git`, symlinks that
lead out, and files that are no files (a pipe, a device). `open_regular` is the one way to open such a file."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from torchrelay.errors import IntegrityError, PathError, UnsafeInput

# Characters that `sha256sum` would escape and that no file torchrelay writes ever contains.
_FORBIDDEN_CHARS = ("\x00", "\n", "\r", "\\")
PATH_LIMIT = 4096  # PATH_MAX: no longer path opens
NAME_LIMIT = 255  # NAME_MAX: bytes of one name


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
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in rel.split("/"))
    if len(rel) > PATH_LIMIT or longest > NAME_LIMIT:
        # what no filesystem holds (PATH_MAX, NAME_MAX): refused here, shortened, instead of an ENAMETOOLONG
        # whose message repeated the whole path (megabytes of it) and named neither the file nor the line
        what = f"{len(rel):,} characters" if len(rel) > PATH_LIMIT else f"a name of {longest:,} bytes"
        raise UnsafeInput(
            f"{source}: path {rel[:60]!r}... ({what}) is longer than a path can be",
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


def is_inside(root: Path, path: Path) -> bool:
    """Whether `path` (which may not exist yet), every link on the way followed, resolves inside `root`."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    return real == real_root or real.is_relative_to(real_root)


_OUTSIDE_HINT = "a bundle must not contain symlinks that point outside it; the bundle is damaged or forged"


def ensure_inside(
    root: Path, path: Path, *, source: str, shown: str | None = None, hint: str = _OUTSIDE_HINT
) -> None:
    """Raise UnsafeInput if `path` (which may not exist yet) resolves outside `root`."""
    if not is_inside(root, path):
        real = Path(os.path.realpath(path))
        raise UnsafeInput(
            f"{source}: {shown or path} leads through a symlink to {real}, outside {root}", hint=hint
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


def open_regular(
    path: str | os.PathLike[str],
    *,
    what: str,
    root: str | os.PathLike[str] | None = None,
    follow: bool = False,
) -> tuple[int, int]:
    """(descriptor, size) of the regular file `path`, for files that may come from elsewhere.

    A symbolic link as the last part is refused (O_NOFOLLOW), and with `root` so is a folder on the way that
    leads out of `root`; a pipe, a socket or a device is refused without blocking (O_NONBLOCK, then fstat) and
    before a byte is read. `follow`: a path the user named on the command line (a plan), whose link is theirs.
    A missing file or a folder raises FileNotFoundError or IsADirectoryError, as open()
    does, for the caller to word (`errors.from_exception`: a wrong path, exit 2). The caller closes the descriptor.
    """
    if root is not None:
        ensure_inside(Path(root), Path(path).parent, source=what)
    try:
        nofollow = 0 if follow else os.O_NOFOLLOW
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and not os.path.islink(path):
            # ELOOP from a folder on the way (a link that loops), not from O_NOFOLLOW on the last part
            raise PathError(
                f"{path} ({what}): a symbolic link on the way to it loops",
                hint="a symbolic link loops: fix or remove it",
            ) from None
        if exc.errno == errno.ELOOP:
            raise UnsafeInput(
                f"{path} ({what}) is a symbolic link; refusing to follow it",
                hint="torchrelay never writes links; replace it with the file itself",
            ) from None
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket
            raise UnsafeInput(f"{path} ({what}) is not a regular file; refusing to read it") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # what open() says of a folder; the CLI and Run.open word it (exit 2)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInput(
                f"{path} ({what}) is not a regular file (a pipe or a device); refusing to read it",
                hint="torchrelay writes only regular files; replace it with the file itself",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(
    path: str | os.PathLike[str],
    limit: int,
    *,
    what: str,
    root: str | os.PathLike[str] | None = None,
    follow: bool = False,
) -> bytes:
    """The bytes of the regular file `path` (opened by `open_regular`) of at most `limit` bytes, refused naming
    `path` otherwise; a file that grows while it is read is cut off at the limit, not followed forever."""
    fd, size = open_regular(path, what=what, root=root, follow=follow)
    try:
        if size > limit:
            raise IntegrityError(
                f"{path} ({what}) has {size:,} bytes, more than such a file can have ({limit:,})",
                hint="the file is damaged or not what it should be",
            )
        chunks = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise IntegrityError(f"{path} ({what}) grew past {limit:,} bytes while it was read")
    return data


def refuse_link(path: str | os.PathLike[str], *, what: str) -> None:
    """Raise UnsafeInput if `path`, a file or folder torchrelay writes into, is a symbolic link: writing through a
    planted link would change whatever it points to (a file outside the run)."""
    if os.path.islink(path):
        raise UnsafeInput(
            f"{path} ({what}) is a symlink: remove it",
            hint="torchrelay never writes links, and writes nothing through one; nothing was written",
        )


def open_writable(
    path: str | os.PathLike[str],
    *,
    what: str,
    append: bool = False,
    create: bool = True,
    truncate: bool = False,
) -> int:
    """A descriptor to write the regular file `path` (read-write, or appending with `append`), created if missing
    with `create`, emptied with `truncate`; the writer's counterpart of `open_regular`. A symbolic link as the
    last part is refused, never followed (O_NOFOLLOW), and so are a pipe, a socket or a device (without blocking),
    before a byte is written.
    The folders on the way are the caller's to check (`refuse_link`). The caller closes the descriptor."""
    flags = (
        (os.O_WRONLY | os.O_APPEND if append else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    )
    try:
        fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            refuse_link(path, what=what)
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket
            raise UnsafeInput(f"{path} ({what}) is not a regular file; refusing to write it") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInput(
                f"{path} ({what}) is not a regular file (a pipe or a device); refusing to write it",
                hint="torchrelay writes only regular files; remove it",
            )
        if truncate:  # after the checks, which O_TRUNC would precede
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
