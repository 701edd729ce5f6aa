"""Exposure logs read back as arrays: the writer's lines parsed a block at a time by numpy, any other line by the
JSONL reader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchrelay.errors import IntegrityError
from torchrelay.records.train import _line_too_long, _start_of_tail
from torchrelay.util.jsonl import LINE_LIMIT, iter_records
from torchrelay.util.records import Schema
from torchrelay.util.safepath import open_regular

# The writer (records/train.py: exposure_line, ExposureLog) makes every exposure line `{"u":U,"m":M,"i":[I,...]}` (json.dumps, compact): a file made only of
# such lines is read as arrays, 20 M exposures in seconds; any other file is read line by line (util/jsonl's
# policy for a torn or damaged line applies either way). The check of a block costs a few passes of bytes and
# numpy operations over it, none per number but numpy's own parse (profiled at LingBot size: RESULTS.md).
_EXPOSURE_HEAD = b'{"u":,"m":,"i":['
_DIGITS = b"0123456789"
_NOT_DIGIT = bytes(c if 48 <= c <= 57 else 32 for c in range(256))
# Each byte's role around a number: a digit (0), what may stand before one (o: `:` `[`), after one (c: `]`),
# both (b: `,`); anything else (x).
_ROLE = bytes(48 if 48 <= c <= 57 else {58: 111, 91: 111, 44: 98, 93: 99}.get(c, 120) for c in range(256))
_POWERS = [10**k for k in range(1, 19)]


@dataclass(slots=True)
class Exposures:
    """One rank's exposure log as arrays: each line's update and number of ids, and all ids in file order."""

    updates: np.ndarray
    counts: np.ndarray
    ids: np.ndarray


def read_exposures(path: Path) -> Exposures:
    """The exposure lines of `path` (a last line without its newline is a torn write: left out)."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rest: list[bytes] = []  # the start of a line the blocks read so far have not ended, in pieces
    held = lines = 0
    fd, _ = open_regular(path, what=path.name)  # no symlink, no pipe, no device
    with os.fdopen(fd, "rb") as f:
        while block := f.read(_EXPOSURE_BLOCK):
            cut = block.rfind(b"\n") + 1
            if not cut:  # inside one long line: held in pieces up to the bound of every JSONL reader
                rest.append(block)
                held += len(block)
                if held > LINE_LIMIT:
                    raise _line_too_long(path, f"line {lines + 1}")
                continue
            data = b"".join([*rest, block[:cut]])
            rest, held = ([block[cut:]], len(block) - cut) if cut < len(block) else ([], 0)
            parsed = _parse_block(data)
            if parsed is None:
                return _exposures_by_line(path)
            lines += len(parsed[0])
            parts.append(parsed)
    tail = b"".join(rest)
    if not parts:
        return _exposures_by_line(path) if tail.strip() else Exposures(*(np.zeros(0, np.int64),) * 3)
    return Exposures(*(np.concatenate([p[k] for p in parts]) for k in range(3)))


_EXPOSURE_BLOCK = 1 << 23
EXPOSURE_SCHEMA = Schema({"u": int, "i": [int]})


def parse_exposure_lines(data: bytes) -> Exposures | None:
    """The exposure lines of `data`, whole lines only, read as read_exposures reads a block; None where a line is
    not one the fast readers accept (the caller then reads the whole file with read_exposures)."""
    parts = []
    pos = 0
    while pos < len(data):
        end = data.rfind(b"\n", pos, pos + _EXPOSURE_BLOCK) + 1
        if end <= pos:  # a line longer than a block
            end = data.find(b"\n", pos) + 1
            if not end or end - pos > LINE_LIMIT:
                return None
        parsed = _parse_block(data[pos:end])
        if parsed is None:
            return None
        parts.append(parsed)
        pos = end
    if not parts:
        return Exposures(*(np.zeros(0, np.int64),) * 3)
    return Exposures(*(np.concatenate([p[k] for p in parts]) for k in range(3)))


def read_exposures_from(path: Path, start: int) -> Exposures | None:
    """The exposure lines of `path` from byte `start` (a line's start) on, a torn last line left out as
    read_exposures leaves it; None wherever read_exposures might read them otherwise (a line the fast readers do
    not accept, a torn line that is not text), so that a caller falls back to the whole file."""
    fd, _ = open_regular(path, what=path.name)
    with os.fdopen(fd, "rb") as f:
        f.seek(start)
        data = f.read()
    cut = data.rfind(b"\n") + 1
    torn = data[cut:]
    if len(torn) > LINE_LIMIT or not torn.isascii():
        return None
    return parse_exposure_lines(data[:cut])


def end_of_update(path: Path, update: int) -> int:
    """The offset just past the last whole line of `path` of an update <= `update` (0 if there is none), read
    backwards from the end: a log holds its lines in update order, so what lies past it is the few updates a loop
    logged since."""
    fd, _ = open_regular(path, what=path.name)
    with os.fdopen(fd, "rb") as f:
        return _start_of_tail(f, update)


def _parse_block(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A block of whole lines as arrays by the first reading that accepts it, else None (the line reader's)."""
    first = data[: data.find(b"\n")]
    if b" " in first:  # padded lines (ExposureLog); a compact line never holds a space
        return _parse_fixed_block(data)
    return _parse_exposure_block(data)


# A block of padded lines is made of runs of equal lines, one a segment (a resize or a longer schedule changes the
# length); a block of many runs is not what the writer wrote.
_MAX_RUNS = 16
_PAD = 32


def _parse_fixed_block(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(updates, counts, ids) of whole lines that each are runs of lines of one length and one layout, else None.

    Each run is a table of fixed columns (lines, line length): its first line gives the layout (`_layout`), every
    other column of the table must hold the first line's byte (one comparison) and every number's field spaces
    then digits, with no leading zero (`_fixed_numbers`). A line that passes is JSON with exactly these values."""
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)
    lengths = np.diff(ends, prepend=-1)
    bounds = [0, *(np.flatnonzero(lengths[1:] != lengths[:-1]) + 1).tolist(), len(ends)]
    if len(bounds) - 1 > _MAX_RUNS:
        return None
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        start = int(ends[a - 1]) + 1 if a else 0
        table = buf[start : int(ends[b - 1]) + 1].reshape(b - a, int(lengths[a]))
        got = _parse_fixed_run(table)
        if got is None:
            return None
        parts.append(got)
    return parts[0] if len(parts) == 1 else tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def _parse_fixed_run(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(updates, counts, ids) of a table of lines of one length, if every line has the first line's layout."""
    layout = _layout(table[0].tobytes())
    if layout is None:
        return None
    fixed, (us, uw), (ms, mw), (ids_at, iw, count) = layout
    if not (table[:, fixed] == table[0, fixed]).all():
        return None
    lines = len(table)
    updates = _fixed_numbers(table[:, us : us + uw].reshape(lines, 1, uw))
    micro = _fixed_numbers(table[:, ms : ms + mw].reshape(lines, 1, mw))
    ids = _fixed_numbers(
        table[:, ids_at : ids_at + count * (iw + 1)].reshape(lines, count, iw + 1)[:, :, :iw]
    )
    if updates is None or micro is None or ids is None:
        return None
    return updates[:, 0], np.full(lines, count, dtype=np.int64), ids.reshape(-1)


def _layout(line: bytes) -> tuple[np.ndarray, tuple[int, int], tuple[int, int], tuple[int, int, int]] | None:
    """The columns of one padded line: (every column outside the numbers, the update's (start, width), the
    micro-batch's, the ids' (start, width, count)), else None; a width is at most 18 digits, so that every value is
    below int64's bound. The ids are read at the first one's width: a comma elsewhere falls in a number's field,
    which `_fixed_numbers` refuses."""
    skeleton = line.translate(None, b" " + _DIGITS)
    count = len(skeleton) - len(_EXPOSURE_HEAD) - 2  # the list's commas, and one
    if count < 1 or skeleton != _EXPOSURE_HEAD + b"," * (count - 1) + b"]}\n":
        return None
    row = np.frombuffer(line, dtype=np.uint8)
    fixed = np.flatnonzero((row != _PAD) & ((row < 48) | (row > 57)))
    gaps = np.diff(fixed) - 1  # the number of padded digits after each skeleton byte
    numbers = [4, 9, *range(15, 15 + count)]  # after `"u":`, `"m":`, `[` and each comma of the list
    widths = gaps[numbers]
    if fixed[0] or np.delete(gaps, numbers).any() or widths.min() < 1 or widths.max() > 18:
        return None
    start = fixed[numbers] + 1
    # The ids at the first one's width, each with its comma (the last one's `]`), must end where the line's
    # `]}` does: a first id wider than the others would lay the columns past the line's end.
    if int(start[2]) + count * (int(widths[2]) + 1) != len(line) - 2:
        return None
    return (
        fixed,
        (int(start[0]), int(widths[0])),
        (int(start[1]), int(widths[1])),
        (int(start[2]), int(widths[2]), count),
    )


def _fixed_numbers(fields: np.ndarray) -> np.ndarray | None:
    """The values of a (lines, numbers, width) array of right-aligned numbers, or None unless each is spaces then
    one or more digits without a leading zero (what json.loads reads as that integer, and nothing else).

    Read column by column of a transposed copy: each step is then a contiguous pass over one byte of every number
    (the same checks over the (..., width) view took twice the time, their inner loops a few bytes long)."""
    width = fields.shape[-1]
    value: np.ndarray | None = None
    digit_before = space_before = None
    for k, column in enumerate(np.moveaxis(fields, -1, 0).copy()):
        space = column == _PAD
        digit = (column - 48) < 10  # uint8: every byte below '0' wraps past 10
        if not (space | digit).all() or (k == width - 1 and not digit.all()):
            return None
        if digit_before is not None and (digit_before & space).any():  # a space after a digit
            return None
        if k < width - 1:  # a zero that starts a number of two digits or more
            zero = column == 48
            if (zero if space_before is None else zero & space_before).any():
                return None
        digit_before, space_before = digit, space
        ones = column & 15  # a space (32) & 15 is 0, a digit's is its value
        value = ones.astype(np.int64) if value is None else value * 10 + ones
    return value


def _parse_exposure_block(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(updates, counts, ids) of whole lines written as the writer writes them, else None.

    What is checked, and why it is enough: without its digits each line is the writer's skeleton
    `{"u":,"m":,"i":[,,]}`; every run of digits starts after `:`, `[` or `,` and ends before `,` or `]` (so it
    fills one slot of the skeleton, and no slot holds two); there are as many runs as slots (none is empty); and
    the digits are exactly as many as the values' own (no leading zero), each value below 10^18."""
    skeleton = data.translate(None, _DIGITS)
    lines = skeleton.count(b"\n")
    first_line = skeleton.find(b"\n") + 1
    width = first_line - len(_EXPOSURE_HEAD) - 3  # the commas of the first line's list
    if width < 0:
        return None
    if len(skeleton) == first_line * lines:  # every line as long as the first: one comparison
        if skeleton != (_EXPOSURE_HEAD + b"," * width + b"]}\n") * lines:
            return None
    elif (
        not skeleton.startswith(_EXPOSURE_HEAD)
        or skeleton.count(_EXPOSURE_HEAD) != lines
        or skeleton.count(b"\n" + _EXPOSURE_HEAD) != lines - 1
        or skeleton.count(b"]}\n") != lines
        or skeleton.replace(_EXPOSURE_HEAD, b"").replace(b"]}\n", b"").translate(None, b",")
    ):
        return None
    role = data.translate(_ROLE)
    even = np.frombuffer(role, "<u2", count=len(role) // 2)
    odd = np.frombuffer(role, "<u2", count=(len(role) - 1) // 2, offset=1)

    def pairs(*two: bytes) -> int:  # occurrences of these byte pairs in `role`, at any offset
        codes = [int.from_bytes(t, "little") for t in two]
        return sum(int(np.count_nonzero(view == c)) for c in codes for view in (even, odd))

    empty_lists = pairs(b"oc")  # `[]`: the skeleton allows no other `:]`
    if empty_lists:  # a line's count is then not its skeleton's length: rare, read line by line
        return None
    values = np.fromstring(data.translate(_NOT_DIGIT), dtype=np.int64, sep=" ")
    slots = 3 * lines + len(skeleton) - lines * (len(_EXPOSURE_HEAD) + 3)
    if len(values) != slots or pairs(b"o0", b"b0") != slots or pairs(b"0b", b"0c") != slots:
        return None
    if slots and int(values.max()) >= _POWERS[-1]:  # also what numpy makes of a number past int64
        return None
    digits = len(values)
    for power in _POWERS[:-1]:
        above = int(np.count_nonzero(values >= power))
        if not above:
            break
        digits += above
    if digits != len(data) - len(skeleton):  # a leading zero, or a digit outside the values
        return None
    if len(skeleton) == first_line * lines:
        table = values.reshape(lines, width + 3)
        return table[:, 0].copy(), np.full(lines, width + 1, dtype=np.int64), table[:, 2:].reshape(-1)
    breaks = np.flatnonzero(np.frombuffer(skeleton, dtype=np.uint8) == 10)
    per_line = np.diff(breaks, prepend=-1) - (len(_EXPOSURE_HEAD) + 3) + 3
    starts = np.cumsum(per_line) - per_line
    keep = np.ones(len(values), dtype=bool)
    keep[starts] = keep[starts + 1] = False
    return values[starts], per_line - 2, values[keep]


def _exposures_by_line(path: Path) -> Exposures:
    updates: list[int] = []
    counts: list[int] = []
    ids: list[int] = []
    for rec in iter_records(path, schema=EXPOSURE_SCHEMA):
        got = rec["i"]
        updates.append(rec["u"])
        counts.append(len(got))
        ids.extend(got)
    try:
        return Exposures(
            np.asarray(updates, dtype=np.int64),
            np.asarray(counts, dtype=np.int64),
            np.asarray(ids, dtype=np.int64),
        )
    except OverflowError:  # JSON's integers have no bound; no update or manifest index comes near 2^63
        raise IntegrityError(
            f"{path}: an update or sample index is past 64 bits",
            hint=f"{path.name} is damaged; restore it from a copy",
        ) from None
