"""argparse types of the verbs' numbers and ids: a value out of range is refused as argparse refuses a wrong type
(the usage and `argument --at-update: ...`, exit 2), before the verb does anything with it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from torchrelay.paths.layout import MAX_UPDATE
from torchrelay.paths.rundir import RunDir
from torchrelay.util.schema import INT_LIMIT
from torchrelay.util.shown import visible

JOBS_LIMIT = 1024  # hashing or copying threads: far past the cores of any node


def run_directory(text: str) -> RunDir:
    """A verb's RUN_DIR, as the path model every reader below takes (whether it holds a run is the verb's check)."""
    return RunDir(text)


def count(low: int, high: int = INT_LIMIT) -> Callable[[str], int]:
    """An int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{visible(text)}'") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its own message on a ValueError
    return parse


update = count(0, MAX_UPDATE)  # an update number, as a checkpoint's name holds one


def _finite(text: str, *, of: str, positive: bool) -> float:
    """A finite number >= 0 (> 0 where `positive`) of `of` ("seconds", or "" for a plain number), or argparse's
    one-line refusal saying what it must be."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {of or 'a number'}, got '{visible(text)}'") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        what = f"a finite number{' of ' + of if of else ''} {'> 0' if positive else '>= 0'}"
        raise argparse.ArgumentTypeError(f"must be {what}, got '{visible(text)}'")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    return _finite(text, of="seconds", positive=False)


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a time limit: one of 0 could never be kept)."""
    return _finite(text, of="seconds", positive=True)


def tolerance(text: str) -> float:
    """A finite number >= 0."""
    return _finite(text, of="", positive=False)


def updates_list(text: str) -> list[int]:
    """Update numbers separated by commas (3,7,9), each in [1, MAX_UPDATE]."""
    each = count(1, MAX_UPDATE)
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            out.append(each(part.strip()))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (expected updates like 3,7,9)") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected updates like 3,7,9, got '{visible(text)}'")
    return out


def job_id(text: str) -> str:
    """A Slurm job id as a stop request holds one (stop.JOB_ID); anything else would read back as no job."""
    from torchrelay.policy.stop import JOB_ID

    if not JOB_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"'{visible(text)}' is not a job id (letters, digits and _.+-, at most 64, e.g. 123 or 123_4)"
        )
    return text
