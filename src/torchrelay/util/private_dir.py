"""A folder of this user's alone under a folder every user shares (/dev/shm, /tmp): made 0700, then checked before
use, as ssh-agent's, tmux's and XDG_RUNTIME_DIR's are: each folder from below the shared one down is a real folder
(no link), owned by this user, writable by no one else; the shared one, if every user may write in it, has the
sticky bit (else another user could rename ours away and put theirs in its place). What another user made first is
never used: one line says which folder and why."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def private_folder(path: Path, *, below: Path, make: bool) -> tuple[Path, str] | None:
    """(the folder, why) where `path` is not this user's alone, or None: every folder from below `below` (trusted
    as it is: the system's or the user's choice) down to `path` is checked, from an open descriptor of its parent
    (lstat, then opened without following a link and compared), and made 0700 first where `make`. A folder of this user's that
    others may read is tightened to 0700 where `make` (no one else could have written in it). Check only (`make`
    false): a folder not there yet is no problem, there is nothing in it to read."""
    names = path.relative_to(below).parts
    uid = os.geteuid()
    here = below
    try:
        if make:
            os.makedirs(below, mode=0o700, exist_ok=True)
        fd = os.open(below, _DIR_FLAGS)
    except FileNotFoundError:
        return None if not make else (below, "cannot be made: it vanished")
    except OSError as exc:
        return below, f"cannot be opened: {exc.strerror}"
    try:
        shared = os.fstat(fd).st_mode
        if shared & stat.S_IWOTH and not shared & stat.S_ISVTX:
            return below, f"is writable by every user without the sticky bit (mode {_mode(shared)})"
        for name in names:
            here = here / name
            if make:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # ours from an earlier run, or planted: checked below as any other
                except OSError as exc:
                    return here, f"cannot be made: {exc.strerror}"
            try:
                seen = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            why = _unfit(seen, uid)
            if why:
                return here, why
            try:
                sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:  # ELOOP: swapped for a link since the lstat
                return here, "is a symbolic link" if exc.errno == errno.ELOOP else str(exc.strerror)
            os.close(fd)
            fd = sub
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
                return here, "was replaced while it was checked"
            if make and stat.S_IMODE(opened.st_mode) & 0o077:
                os.fchmod(fd, 0o700)
        return None
    except OSError as exc:
        return here, f"cannot be checked: {exc.strerror}"
    finally:
        os.close(fd)


def _unfit(st: os.stat_result, uid: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"is writable by others (mode {_mode(st.st_mode)})"
    if st.st_mode & stat.S_IWGRP:
        return f"is writable by its group (mode {_mode(st.st_mode)})"
    return None


def _mode(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"
