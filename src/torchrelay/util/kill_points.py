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
# `stall:<update>:<rank>`: that save's write stops making progress without dying, inside a write (once its first
# piece has reached the kernel), as a write stuck on a dead network file system: its writer process SIGSTOPs
# itself, or, written from the persist thread, the writing thread blocks for good; either is left to the deadline
# (TORCHRELAY_PERSIST_STALL_S: checkpoint/writer_process.py, checkpoint/persist.py's Persister.wait).
STALL = "stall"
FAULTS = (WRITER, STALL)  # inside the write of a save, not of this process's own phases
# `send:<update>:<rank>`, `receive:<update>:<rank>`: a node's first rank dies inside the memory tier's replication
# of that update (checkpoint/replica.py): right before it sends its part to the partner node, or once the first
# file of the part it receives is written (a half replica left in its memory)
REPLICA_PHASES = ("send", "receive")

_armed: str | None = None  # one moment per process: a crash test kills once


def arm(spec: str | None) -> None:
    """Kill this process at `spec` (None disarms): `<phase>:<update>:<rank>` of a save, a phase of SAVE_PHASES,
    `writer:<update>:<rank>` (that save's writer process, see WRITER), `stall:<update>:<rank>` (that save's write
    stops, see STALL), or a step of pack or prepare
    (`pack:marked`, `prepare:renamed`), or a moment of the memory tier's replication (REPLICA_PHASES)."""
    global _armed
    if spec is not None and spec.count(":") == 2:
        phase, update, rank = spec.split(":")
        phases = (*SAVE_PHASES, *FAULTS, *REPLICA_PHASES)
        if phase not in phases or not update.isdigit() or not rank.isdigit():
            raise ValueError(f"kill point {spec!r}: expected <{'|'.join(phases)}>:<update>:<rank>")
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
    if phase in (*FAULTS, *REPLICA_PHASES) or int(at_update) != update or int(at_rank) != rank:
        return None

    def hook(current: str) -> None:
        if current == phase:
            _kill()

    return hook


def write_fault(update: int, rank: int) -> str | None:
    """What the write of the save of `update` on `rank` is to suffer: WRITER (its writer process SIGKILLs itself
    inside its job), STALL (it stops inside a write), or None."""
    for fault in FAULTS:
        if _armed == f"{fault}:{update}:{rank}":
            return fault
    return None
