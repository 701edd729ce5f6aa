"""Rich progress bars for the handoff verbs; thread-safe byte/item counters the library calls back into."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
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
def _bar(description: str, total: int, *columns: ProgressColumn) -> Iterator[Callable[[int], None]]:
    """Yield a callback `advance(n)` driving a progress bar (a no-op when not on a terminal)."""
    if not enabled():
        yield lambda n: None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), *columns, console=_console)
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def byte_bar(description: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
    """A bytes progress bar: `with byte_bar(...) as advance: advance(nbytes)`."""
    return _bar(description, total, DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())


def item_bar(description: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
    """A count progress bar: `with item_bar(...) as advance: advance(count)`."""
    return _bar(description, total, MofNCompleteColumn(), TimeRemainingColumn())


class PrepareBars:
    """One live display with two bars: bytes verified/copied, and manifest files checked (when asked)."""

    def __init__(self, total_bytes: int) -> None:
        self._progress: Progress | None = None
        self._bytes_task: TaskID | None = None
        self._files_task: TaskID | None = None
        self.total_bytes = total_bytes

    def __enter__(self) -> PrepareBars:
        if enabled():
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=_console,
            )
            self._progress.__enter__()
            self._bytes_task = self._progress.add_task("verify + copy (bytes)", total=self.total_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def on_bytes(self, n: int) -> None:
        if self._progress is not None and self._bytes_task is not None:
            self._progress.advance(self._bytes_task, n)

    def on_files(self, done: int, total: int) -> None:
        if self._progress is None:
            return
        if self._files_task is None:
            self._files_task = self._progress.add_task("check manifest files", total=total)
        self._progress.update(self._files_task, completed=done, total=total)
