"""Per-rank JSONL logs under train/: metrics and exposures, appended in the loop and trimmed on resume."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from torchrelay.errors import IntegrityError
from torchrelay.util.jsonl import LINE_LIMIT, iter_records
from torchrelay.util.records import Schema
from torchrelay.util.safepath import open_regular, open_writable, refuse_link
from torchrelay.util.schema import INT_LIMIT

TIMING_KEYS = ("update_time", "time", "samples_per_s")
METRIC_SCHEMA = Schema(
    {"update": int}
)  # what every metric record holds (util/records.check), the rest is the user's
_RANK_LOG = re.compile(r"^(metrics|exposures|digests)-rank(\d+)\.jsonl$")  # trimmed at a resume


def refuse_linked_logs(train_dir: Path) -> None:
    """Refuse (UnsafeInput, naming it) a train/ that is a symlink, or a symlink in it (a rank's log, its OOM log,
    recovery-history/, stop-requests/): the run appends to, trims and moves files into them, so a planted link would
    have it write, or cut, a file outside the run. Called before anything of the run is written."""
    refuse_link(train_dir, what="the run's per-rank logs")
    if train_dir.is_dir():
        for path in sorted(train_dir.iterdir()):
            refuse_link(path, what=f"in the run's {train_dir.name}/")


def metrics_path(train_dir: Path, rank: int) -> Path:
    return train_dir / f"metrics-rank{rank}.jsonl"


def is_objective(key: str) -> bool:
    """A logged metric that is one objective's loss: `loss_<name>` (step.log(loss_g3=..., loss_a1=...))."""
    return key.startswith("loss_") and len(key) > len("loss_")


def count_ooms(records: list[dict[str, Any]]) -> dict[str, Any]:
    """CUDA OOMs in all and per segment: {"total", "caught", "fatal", "by_segment": {id: {"caught", "fatal"}}}."""
    by: dict[str, dict[str, int]] = {}
    for r in records:
        seg = by.setdefault(str(r.get("segment")), {"caught": 0, "fatal": 0})
        seg["fatal" if r.get("fatal") else "caught"] += 1
    caught = sum(v["caught"] for v in by.values())
    fatal = sum(v["fatal"] for v in by.values())
    return {"total": caught + fatal, "caught": caught, "fatal": fatal, "by_segment": by}


def ooms_path(train_dir: Path, rank: int) -> Path:
    """Rank r's CUDA out-of-memory errors, one line each: never trimmed at a resume (an OOM that ended a segment
    after its last checkpoint still happened)."""
    return train_dir / f"ooms-rank{rank}.jsonl"


def record_oom(train_dir: Path, rank: int, record: dict[str, Any]) -> None:
    """Append one OOM record (update, segment, fatal, message), flushed to disk: the process may die next."""
    refuse_link(train_dir, what="the run's per-rank logs")
    train_dir.mkdir(parents=True, exist_ok=True)
    path = ooms_path(train_dir, rank)
    with open(open_writable(path, what=path.name, append=True), "a", encoding="utf-8") as f:
        f.write(json.dumps({"rank": rank, **record}, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_ooms(train_dir: Path) -> list[dict[str, Any]]:
    """Every rank's OOM records (few: each is an error a script met)."""
    out: list[dict[str, Any]] = []
    for path in sorted(train_dir.glob("ooms-rank*.jsonl")):
        out.extend(r for r in iter_records(path) if isinstance(r, dict))
    return out


def exposures_path(train_dir: Path, rank: int) -> Path:
    return train_dir / f"exposures-rank{rank}.jsonl"


class RankLog:
    """An append-only JSONL file; one write per line, flushed so a reader sees whole lines."""

    def __init__(self, path: Path) -> None:
        refuse_link(path.parent, what="the run's per-rank logs")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # a link at its name is refused, never written through
        fd = open_writable(path, what=path.name, append=True)
        self._f: IO[str] = open(fd, "a", buffering=1 << 16)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self, durable: bool = False) -> None:
        self._f.flush()
        if durable:
            os.fsync(self._f.fileno())

    def sync_later(self) -> int:
        """Hand every line written so far to the OS and return a descriptor of its own for the file, which the
        caller fsyncs (from any thread: the log may be written or closed meanwhile) and closes."""
        self._f.flush()
        return os.dup(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


class ExposureLog(RankLog):
    """A rank's exposure log: one line per micro-batch, `{"u":U,"m":M,"i":[I,...]}`, each number right-aligned in
    a field as wide as the largest it can be (`exposure_widths`), so that every line of a segment has the same
    length and the ledger reads a block of them as a table of fixed columns (`_parse_fixed_block`): 20 M exposures
    in about a CPU second instead of several. JSON allows the spaces, so every JSON reader reads the lines as before.

    A log begun by an older version (compact lines, no space anywhere) is continued compact, so that a run resumed
    across versions holds the lines the old version would have written; a padded line always holds a space (the
    micro-batch field is one wider than its largest value), which is how the two are told apart."""

    def __init__(self, path: Path, widths: tuple[int, int, int]) -> None:
        self._line = _padded_line(widths) if _continues_padded(path) else None
        super().__init__(path)

    def write_exposure(self, update: int, micro: int, ids: list[int]) -> None:
        if self._line is None:
            self.write({"u": update, "m": micro, "i": ids})
        else:
            self._f.write(self._line(update, micro, ids))


def exposure_widths(total_updates: int, grad_accum: int, samples: int) -> tuple[int, int, int]:
    """The fields' widths of a run's exposure lines: update, micro-batch (one more: the space that marks a padded
    log), sample index; each the digits of its largest value."""
    return len(str(total_updates)), len(str(max(grad_accum - 1, 0))) + 1, len(str(max(samples - 1, 0)))


def exposure_line(update: int, micro: int, ids: list[int], widths: tuple[int, int, int]) -> str:
    """One padded exposure line, as ExposureLog writes it into a new log."""
    return _padded_line(widths)(update, micro, ids)


def _padded_line(widths: tuple[int, int, int]) -> Any:
    wu, wm, wi = widths
    head, one = '{"u":%' + str(wu) + 'd,"m":%' + str(wm) + 'd,"i":[', f"%{wi}d"

    def line(update: int, micro: int, ids: list[int]) -> str:
        return head % (update, micro) + ",".join(map(one.__mod__, ids)) + "]}\n"

    return line


def _continues_padded(path: Path) -> bool:
    """Whether a log opened for appending continues padded: a new or empty one does; an existing one does if its
    first line holds a space (the writer's compact JSON never does)."""
    try:
        fd, _ = open_regular(path, what=path.name)
    except FileNotFoundError:
        return True
    with os.fdopen(fd, "rb") as f:
        head = f.read(256)
    return not head.strip() or b" " in head.split(b"\n", 1)[0]


def _update_of(line: str | bytes) -> int | None:
    """The update of a log line, or None for a line that is no record with one: not JSON, not UTF-8, a number
    of more digits than Python converts, nesting past the parser, or JSON that is no object (`[1]`)."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(rec, dict):
        return None
    value = rec.get("update", rec.get("u"))
    return value if _is_update(value) else None


def trim_after(train_dir: Path, update: int) -> Path | None:
    """Move lines past `update` into train/recovery-history/<when>/ so the live logs read as one run.

    A log is appended in update order and trimmed at every resume, so what lies past `update` (and a torn last
    line) is a tail: it is found reading backwards from the end, and cut off once it is safely archived, without
    reading, let alone rewriting, the rest (a 20,000-update run's logs are hundreds of MB).
    """
    if not train_dir.is_dir():
        return None
    refuse_linked_logs(train_dir)
    archive = train_dir / "recovery-history" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved_any = False
    for path in sorted(train_dir.iterdir()):
        if not _RANK_LOG.match(path.name):
            continue
        with open(open_writable(path, what=path.name, create=False), "rb+") as f:
            cut = _start_of_tail(f, update)
            f.seek(cut)
            moved = f.read()
            if not moved:
                continue
            archive.mkdir(parents=True, exist_ok=True)
            refuse_link(archive, what="a trim's archive")
            with open(open_writable(archive / path.name, what=path.name, append=True), "ab") as out:
                out.write(moved)
                out.flush()
                os.fsync(out.fileno())
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        moved_any = True
    return archive if moved_any else None


def _start_of_tail(f: IO[bytes], update: int) -> int:
    """The offset just past the last whole line of an update <= `update` (0 if there is none)."""
    for offset, line in _reversed_lines(f):
        u = _update_of(line.decode("utf-8", "replace")) if line.endswith(b"\n") else None
        if u is not None and u <= update:
            return offset + len(line)
    return 0


def _reversed_lines(
    f: IO[bytes], block: int = 1 << 16, *, path: Path | None = None
) -> Iterator[tuple[int, bytes]]:
    """(offset, line with its newline) from the last line of `f` to the first, reading backwards; a line longer
    than LINE_LIMIT is damage (IntegrityError), its pieces never joined."""
    pos = f.seek(0, os.SEEK_END)
    rest: list[
        bytes
    ] = []  # the start of a line that began before `pos`: the pieces read, the last read first
    held = 0
    while pos > 0 or rest:
        start = max(0, pos - block)
        f.seek(start)
        chunk = f.read(pos - start)
        pos = start
        if start > 0 and b"\n" not in chunk:  # inside one long line: kept in pieces, joined once it is whole
            rest.append(chunk)
            held += len(chunk)
            if held > LINE_LIMIT:
                raise _line_too_long(path, f"the line before byte {pos + held:,}")
            continue
        chunk += b"".join(reversed(rest))
        pieces = chunk.split(b"\n")
        lines = [p + b"\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
        whole, first = (lines, b"") if start == 0 else (lines[1:], lines[0] if lines else b"")
        rest, held = ([first], len(first)) if first else ([], 0)
        offset = start + len(chunk)
        for line in reversed(whole):
            offset -= len(line)
            yield offset, line


def last_records(path: Path, count: int) -> list[dict[str, Any]]:
    """The last `count` records of a JSONL log, read from its end: a torn last line is left out (a writer killed
    mid-line), any other line that is not a record with an integer "update" is damage (IntegrityError)."""
    out: list[dict[str, Any]] = []
    if not os.path.lexists(path):
        return out
    fd, size = open_regular(path, what=path.name)
    with os.fdopen(fd, "rb") as f:
        for offset, line in _reversed_lines(f, path=path):
            if len(out) >= count:
                break
            if not line.strip():
                continue
            last = offset + len(line) == size
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the parser
                rec = None
            if isinstance(rec, dict) and _is_update(rec.get("update")):
                out.append(rec)
            elif not last:
                raise IntegrityError(
                    f"{path}: the line at byte {offset:,} is not a record with an integer update",
                    hint=f"{path.name} is damaged; restore it from a copy",
                )
    return out[::-1]


def _is_update(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT_LIMIT


def metric_float(value: Any) -> float:
    """A logged metric's value as a float, NaN where it is no number: an integer past what a float holds (JSON
    reads 4300 digits) is +-inf, never an OverflowError in whoever averages, formats or draws it."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def trim_copy(src: Path, dst: Path, update: int) -> None:
    """Copy a rank log keeping only lines up to `update` (for bundles). The log is opened the one safe way (a
    link, a pipe or a device refused, naming it: a plain open waited on a pipe for ever and copied /dev/zero
    until memory ran out) and read a bounded line at a time."""
    fd, _ = open_regular(src, what=src.name)
    with os.fdopen(fd, "rb") as fin, open(dst, "wb") as fout:
        number = 0
        while line := fin.readline(LINE_LIMIT + 1):
            number += 1
            if len(line) > LINE_LIMIT:
                raise _line_too_long(src, f"line {number}")
            u = _update_of(line) if line.endswith(b"\n") else None
            if u is not None and u <= update:
                fout.write(line)


def copy_log(src: Path, dst: Path) -> None:
    """Copy a log whole (an OOM log, for bundles), opened the one safe way: a link, a pipe or a device is refused,
    naming it (shutil.copyfile followed a link to /dev/zero and wrote until the disk was full)."""
    fd, _ = open_regular(src, what=src.name)
    with os.fdopen(fd, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)


def rank_logs(train_dir: Path, kind: str) -> dict[int, Path]:
    """{rank: path} of one kind of log ('metrics' or 'exposures')."""
    out = {}
    if train_dir.is_dir():
        for path in train_dir.iterdir():
            m = _RANK_LOG.match(path.name)
            if m and m.group(1) == kind:
                out[int(m.group(2))] = path
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------ reading exposure logs fast
# The writer above makes every exposure line `{"u":U,"m":M,"i":[I,...]}` (json.dumps, compact): a file made only of
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


def _line_too_long(path: Path | None, which: str) -> IntegrityError:
    return IntegrityError(
        f"{path}: {which} is longer than {LINE_LIMIT:,} bytes",
        hint=f"{path.name if path else 'the log'} is damaged; restore it from a copy",
    )


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
