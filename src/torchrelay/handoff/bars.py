"""Rich progress bars for the handoff verbs; thread-safe byte/item counters the library calls back into."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

# Progress goes to stderr so stdout stays clean for the PASS/OK lines scripts grep for.
_console = Console(stderr=True)


def enabled() -> bool:
    """Bars only on a terminal; logs and tests get the plain lines."""
    return sys.stderr.isatty()


@contextmanager
def byte_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield a callback `advance(nbytes)` driving a bytes progress bar (a no-op when not on a terminal)."""
    if not enabled():
        yield lambda n: None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_console,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextmanager
def item_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield a callback `advance(count)` driving a count progress bar (a no-op when not on a terminal)."""
    if not enabled():
        yield lambda n: None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=_console,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
