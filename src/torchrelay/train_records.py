"""Per-rank JSONL logs under train/: metrics and exposures, appended in the loop and trimmed on resume."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from torchrelay.errors import IntegrityError
from torchrelay.util.jsonl import LINE_LIMIT, iter_records
from torchrelay.util.records import Schema
from torchrelay.util.safepath import open_regular

TIMING_KEYS = ("update_time", "time", "samples_per_s")
METRIC_SCHEMA = Schema(
    {"update": int}
)  # what every metric record holds (util/records.check), the rest is the user's
_RANK_LOG = re.compile(r"^(metrics|exposures)-rank(\d+)\.jsonl$")


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
    train_dir.mkdir(parents=True, exist_ok=True)
    with open(ooms_path(train_dir, rank), "a", encoding="utf-8") as f:
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
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self, durable: bool = False) -> None:
        self._f.flush()
        if durable:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


def _update_of(line: str) -> int | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    value = rec.get("update", rec.get("u"))
    return int(value) if isinstance(value, int) else None


def trim_after(train_dir: Path, update: int) -> Path | None:
    """Move lines past `update` into train/recovery-history/<when>/ so the live logs read as one run.

    A log is appended in update order and trimmed at every resume, so what lies past `update` (and a torn last
    line) is a tail: it is found reading backwards from the end, and cut off once it is safely archived, without
    reading, let alone rewriting, the rest (a 20,000-update run's logs are hundreds of MB).
    """
    if not train_dir.is_dir():
        return None
    archive = train_dir / "recovery-history" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved_any = False
    for path in sorted(train_dir.iterdir()):
        if not _RANK_LOG.match(path.name):
            continue
        with open(path, "rb+") as f:
            cut = _start_of_tail(f, update)
            f.seek(cut)
            moved = f.read()
            if not moved:
                continue
            archive.mkdir(parents=True, exist_ok=True)
            with open(archive / path.name, "ab") as out:
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
    return isinstance(value, int) and not isinstance(value, bool)


def trim_copy(src: Path, dst: Path, update: int) -> None:
    """Copy a rank log keeping only lines up to `update` (for bundles)."""
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            u = _update_of(line) if line.endswith("\n") else None
            if u is not None and u <= update:
                fout.write(line)


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
            parsed = _parse_exposure_block(data)
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


def _line_too_long(path: Path | None, which: str) -> IntegrityError:
    return IntegrityError(
        f"{path}: {which} is longer than {LINE_LIMIT:,} bytes",
        hint=f"{path.name if path else 'the log'} is damaged; restore it from a copy",
    )


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
