"""Per-rank JSONL logs under train/: metrics and exposures, appended in the loop and trimmed on resume."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

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


def _line_too_long(path: Path | None, which: str) -> IntegrityError:
    return IntegrityError(
        f"{path}: {which} is longer than {LINE_LIMIT:,} bytes",
        hint=f"{path.name if path else 'the log'} is damaged; restore it from a copy",
    )
