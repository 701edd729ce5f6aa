"""The library's one logger, `torchrelay`, whose records carry the rank; the CLI and `Run.open` give it a voice.

The library never prints (the CLI's verbs do). A training script that configures no logging still sees the
library's lines where it always did: `Run.open` installs `StreamSplitter` when the root logger has no handler,
so that information goes to stdout and warnings to stderr, each line exactly as the library words it.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "torchrelay"
logger = logging.getLogger(LOGGER)

_rank: int | None = None


def set_rank(rank: int) -> None:
    """The rank every record names from now on (`Run.open` sets it; otherwise the RANK variable, else 0)."""
    global _rank
    _rank = rank


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            try:
                record.rank = _rank if _rank is not None else int(os.environ.get("RANK", "0"))
            except ValueError:
                record.rank = 0
        return True


logger.addFilter(_RankFilter())


class StreamSplitter(logging.Handler):
    """Information to stdout, warnings and errors to stderr, the message alone; the streams are looked up at
    each record (a test's capture or a redirected sys.stdout is honoured), and flushed after each line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _ours() -> StreamSplitter | None:
    return next((h for h in logger.handlers if isinstance(h, StreamSplitter)), None)


def configure(level: int) -> None:
    """The CLI's set-up: the library's records through `StreamSplitter`, from `level` up."""
    if _ours() is None:
        logger.addHandler(StreamSplitter())
    logger.setLevel(level)


def ensure_voice() -> None:
    """`Run.open`'s set-up: where the program configured no logging at all, the library's lines still appear."""
    if logging.getLogger().handlers or logger.handlers:
        return
    logger.addHandler(StreamSplitter())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
