"""How a segment ended: the one enum, and the one map between end states and exit codes.

The values are the strings history.jsonl has always held (a StrEnum writes and compares as its string), so every
recorded run reads the same.
"""

from __future__ import annotations

from enum import StrEnum

from torchrelay.errors import (
    EXIT_BUDGET,
    EXIT_ERROR,
    EXIT_FINISHED,
    EXIT_MEMORY,
    EXIT_REFUSED,
    EXIT_REQUEST,
    EXIT_SIGNAL,
)


class Ended(StrEnum):
    """A segment's `ended` field in history.jsonl."""

    RUNNING = "running"  # still open, or killed without a word (the next open calls it a crash)
    FINISHED = "finished"
    BUDGET = "budget"
    REQUEST = "request"
    SIGNAL = "signal"
    MEMORY = "memory"
    MEMORY_KILLED = "memory-killed"  # the controller's guard killed it (recorded by the controller)
    REFUSED = "refused"
    ERROR = "error"
    CRASH = "crash"


# The clean stops: a checkpoint at the boundary, resumable as it is.
CLEAN_STOPS = (Ended.BUDGET, Ended.REQUEST, Ended.SIGNAL, Ended.MEMORY)

_EXIT_OF: dict[Ended, int] = {
    Ended.FINISHED: EXIT_FINISHED,
    Ended.BUDGET: EXIT_BUDGET,
    Ended.REQUEST: EXIT_REQUEST,
    Ended.SIGNAL: EXIT_SIGNAL,
    Ended.MEMORY: EXIT_MEMORY,
    Ended.MEMORY_KILLED: EXIT_MEMORY,
    Ended.REFUSED: EXIT_REFUSED,
}
_ENDED_OF: dict[int, Ended] = {
    EXIT_FINISHED: Ended.FINISHED,
    EXIT_BUDGET: Ended.BUDGET,
    EXIT_REQUEST: Ended.REQUEST,
    EXIT_SIGNAL: Ended.SIGNAL,
    EXIT_MEMORY: Ended.MEMORY,
    EXIT_REFUSED: Ended.REFUSED,
}


def exit_code_of(ended: str) -> int:
    """The process exit code a segment that ended so returns (1 for an error, a crash or an unknown state)."""
    try:
        return _EXIT_OF.get(Ended(ended), EXIT_ERROR)
    except ValueError:
        return EXIT_ERROR


def ended_of(code: int) -> Ended:
    """The end state a training process that exits with `code` records (an error for any other code)."""
    return _ENDED_OF.get(code, Ended.ERROR)
