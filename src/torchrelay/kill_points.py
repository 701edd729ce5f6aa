"""Crash-test kill points: SIGKILL this very process at a named moment, once a test harness armed one.

The code names its moments (`kill_point("pack:marked")` between two steps of pack or prepare, the hook
`save_hook(update, rank)` gives a save for its phases); nothing happens unless this process armed a moment with
`arm()`: a crash test's forked child, or an example script given `--kill-at` (the ranks a crash test kills are
real torchrun processes, which only their own command line reaches). Nothing here reads the environment, so a
stray variable can never kill a production run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

SAVE_PHASES = ("shards", "inventory", "rename")  # inside checkpoint/commit.py's protocol, in this order
# `writer:<update>:<rank>`: not this process but its checkpoint writer process (checkpoint/writer_process.py) dies,
# by its own SIGKILL, inside that save's write: once its files are written, before it answers.
WRITER = "writer"

_armed: str | None = None  # one moment per process: a crash test kills once


def arm(spec: str | None) -> None:
    """Kill this process at `spec` (None disarms): `<phase>:<update>:<rank>` of a save, a phase of SAVE_PHASES,
    `writer:<update>:<rank>` (that save's writer process, see WRITER), or a step of pack or prepare
    (`pack:marked`, `prepare:renamed`)."""
    global _armed
    if spec is not None and spec.count(":") == 2:
        phase, update, rank = spec.split(":")
        if phase not in (*SAVE_PHASES, WRITER) or not update.isdigit() or not rank.isdigit():
            raise ValueError(
                f"kill point {spec!r}: expected <{'|'.join((*SAVE_PHASES, WRITER))}>:<update>:<rank>"
            )
    _armed = spec or None


def armed() -> str | None:
    """The moment this process is armed to be killed at, or None."""
    return _armed


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_point(step: str) -> None:
    """Between two steps of pack or prepare: SIGKILL this process if `step` is the armed moment."""
    if _armed == step:
        _kill()


def save_hook(update: int, rank: int) -> Callable[[str], None] | None:
    """The hook a save of `update` on `rank` calls at each phase, or None when no phase of it is armed."""
    if _armed is None or _armed.count(":") != 2:  # none, or a step of pack or prepare
        return None
    phase, at_update, at_rank = _armed.split(":")
    if phase == WRITER or int(at_update) != update or int(at_rank) != rank:
        return None

    def hook(current: str) -> None:
        if current == phase:
            _kill()

    return hook


def writer_killed(update: int, rank: int) -> bool:
    """Whether the writer process of the save of `update` on `rank` is to SIGKILL itself inside its job (WRITER)."""
    return _armed == f"{WRITER}:{update}:{rank}"
