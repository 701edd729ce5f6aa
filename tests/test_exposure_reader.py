"""The exposure logs' fast reader (train_records.read_exposures) against the line-by-line one it falls back to.

The fast path checks a block of lines with a few whole-block operations instead of one parse per line: any line
that is not exactly what the writer writes must reach the line reader (util/jsonl's policy, the schema), so that
the ledger proves and refuses exactly what it proved and refused line by line. In-process, on small files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchrelay.errors import RelayError
from torchrelay.records.exposure_read import (
    _exposures_by_line,
    _parse_exposure_block,
    _parse_fixed_block,
    read_exposures,
)
from torchrelay.records.train import ExposureLog, RankLog, exposure_widths, trim_after, trim_copy


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(lines))
    return path


def _written(tmp_path: Path) -> list[str]:
    """Lines exactly as the loop writes them (RankLog.write), of two micro-batch sizes (a resize)."""
    path = tmp_path / "w.jsonl"
    log = RankLog(path)
    rng = np.random.default_rng(0)
    for u in range(1, 40):
        for m in range(2):
            size = 3 if u < 20 else 5
            log.write({"u": u, "m": m, "i": rng.integers(0, 10**6, size).tolist()})
    log.write({"u": 40, "m": 0, "i": [0, 10, 100, 999999999999999999]})  # a zero, and the largest width
    log.close()
    return path.read_text().splitlines(keepends=True)


def _same(path: Path) -> None:
    """read_exposures gives what the line reader gives, or the same refusal."""
    try:
        want = _exposures_by_line(path)
    except RelayError as exc:
        with pytest.raises(type(exc)) as got:
            read_exposures(path)
        assert str(got.value) == str(exc)
        return
    got = read_exposures(path)
    for k in ("updates", "counts", "ids"):
        assert np.array_equal(getattr(got, k), getattr(want, k)), k


def test_written_lines_take_the_fast_path_and_read_as_the_line_reader_reads_them(tmp_path: Path) -> None:
    lines = _written(tmp_path)
    uniform = "".join(lines[:30]).encode()
    mixed = "".join(lines).encode()
    assert _parse_exposure_block(uniform) is not None and _parse_exposure_block(mixed) is not None
    _same(_write(tmp_path / "all.jsonl", lines))
    _same(_write(tmp_path / "torn.jsonl", [*lines, '{"u":41,"m":0,"i":[1,']))  # a torn last line


@pytest.mark.parametrize(
    "bad",
    [
        '{"u":7,"m":0,"i":[01,2]}\n',  # a leading zero: not JSON
        '{"u":7,"m":0,"i":[00,2]}\n',
        '{"u":07,"m":0,"i":[1,2]}\n',
        '{"u":7,"m":0,"i":[1,,2]}\n',  # an empty slot
        '{"u":,"m":0,"i":[1,2]}\n',
        '{"u":7,"m":0,"i":[1,2,]}\n',
        '{7"u":,"m":0,"i":[1,2]}\n',  # a number moved out of its slot, the count kept
        '{"u":7,"m":0,"i"1:[,2]}\n',
        '{"u":7,"m":0,"i":1[,2]}\n',
        '{"u":7,"m":0,"i":[1,2]1}\n',
        '{"u":7,"m":,"i":[1,2]}1\n',
        '{"u":7,"m":0,"i":[1,2]}{"u":7,"m":0,"i":[3]}\n',  # two records on one line
        '{"u":7,"m":0,"i":[1,2]}\n\n',  # a blank line
        '{"u":7,"m":0,"i":[]}\n',  # an empty list: read line by line
        '{"u":7,"m":0,"i":[1000000000000000000]}\n',  # past 18 digits
        '{"u":7,"m":0,"i":[99999999999999999999999]}\n',  # past int64
        '{"u":7,"m":0,"i":[1,2],"x":1}\n',  # a field the writer does not write
        '{"u":7,"m":0,"i":[-1,2]}\n',
        '{"u":7, "m":0,"i":[1,2]}\n',
        '{"u":7,"m":0,"i":[1.5,2]}\n',
        '{"u":"7","m":0,"i":[1,2]}\n',
        '["u",7,"m",0,"i",[1,2]]\n',
    ],
)
def test_any_other_line_reaches_the_line_reader(tmp_path: Path, bad: str) -> None:
    lines = _written(tmp_path)
    for at in (0, 5, len(lines) - 1):
        block = "".join([*lines[:at], bad, *lines[at:]])
        assert _parse_exposure_block(block.encode()) is None, (at, bad)
        _same(_write(tmp_path / f"bad-{at}.jsonl", [block]))


# ------------------------------------------------------------------------------ padded lines (ExposureLog)


def _padded(tmp_path: Path) -> list[str]:
    """Lines as ExposureLog writes them: two segments of other widths and micro-batch sizes (a longer schedule and
    a resize), with a zero and each width's largest value."""
    path = tmp_path / "exposures-rank0.jsonl"
    rng = np.random.default_rng(1)
    for first, stop, accum, size, total in ((1, 20, 2, 3, 99), (20, 40, 12, 5, 1000)):
        log = ExposureLog(path, exposure_widths(total, accum, 10**6))
        for u in range(first, stop):
            for m in range(accum):
                log.write_exposure(u, m, rng.integers(0, 10**6, size).tolist())
        log.write_exposure(stop - 1, accum - 1, [0, 999_999])
        log.close()
    return path.read_text().splitlines(keepends=True)


def test_padded_lines_take_the_fixed_path_and_read_as_the_line_reader_reads_them(tmp_path: Path) -> None:
    lines = _padded(tmp_path)
    assert len({len(x) for x in lines}) == 4  # two segments, each with its own width and its short last line
    assert all(" " in x for x in lines)
    assert _parse_fixed_block("".join(lines).encode()) is not None
    assert _parse_exposure_block("".join(lines).encode()) is None  # the compact reader cannot read them
    _same(_write(tmp_path / "all.jsonl", lines))
    _same(_write(tmp_path / "torn.jsonl", [*lines, lines[-1][:12]]))
    got = read_exposures(tmp_path / "all.jsonl")
    assert got.ids.max() == 999_999 and got.ids.min() == 0 and got.updates.max() == 39


@pytest.mark.parametrize(
    "bad",
    [
        '{"u": 7,"m": 0,"i":[ 01,  2]}\n',  # a leading zero: not JSON
        '{"u": 7,"m": 0,"i":[ 00,  2]}\n',
        '{"u":07,"m": 0,"i":[  1,  2]}\n',
        '{"u": 7,"m": 0,"i":[ 1 ,  2]}\n',  # a space after a number: JSON, not the writer's
        '{"u": 7,"m": 0,"i":[   ,  2]}\n',  # an empty field
        '{"u":  ,"m": 0,"i":[  1,  2]}\n',
        '{"u": 7,"m": 0,"i":[  1,  -2]}\n',
        '{"u": 7,"m": 0,"i":[  1,\t 2]}\n',
        '{"u": 7,"m": 0,"i":[  1, 2.]}\n',
        '{"u": 7,"m": 0,"i":[  1, 2 ]}\n',
        '{"u": 7,"m": 0,"i":[  1,  2] }\n',
        ' {"u": 7,"m": 0,"i":[  1, 2]}\n',
        '7{"u": 7,"m": 0,"i":[  1,  2]}\n',
        '{"u": 7,"m": 0,"i":[1 2,  2]}\n',
        '{"u": 7,"m": 0,"i" :[  1, 2]}\n',
        '{"u": 7,"m": 0,"i":[  1,   22]}\n',  # ids of two widths
        '{"u": 7,"m": 0,"i":[  1,  2],"x":1}\n',
        '{"u": 7,"m": 0,"i":[  1,1000000000000000000]}\n',  # past 18 digits
        '{"u": 7,"m": 0,"i":[  1,99999999999999999999999]}\n',  # past int64
        '{"u": 7,"m":"0","i":[  1,  2]}\n',
        '{"u": 7,"m": 0,"i":[]}\n',
        '{"u": 7,"m": 0,"i":[  1,  2]}\n\n',  # a blank line
        '{"u": 7, "m": 0, "i": [1, 2]}\n',  # json.dumps' own spacing
    ],
)
def test_any_other_padded_line_reaches_the_line_reader(tmp_path: Path, bad: str) -> None:
    lines = _padded(tmp_path)
    for at in (0, 5, len(lines) - 1):
        block = "".join([*lines[:at], bad, *lines[at:]])
        assert _parse_fixed_block(block.encode()) is None, (at, bad)
        _same(_write(tmp_path / f"bad-{at}.jsonl", [block]))


def test_a_line_of_the_same_length_and_another_layout_reaches_the_line_reader(tmp_path: Path) -> None:
    # The same length as its neighbours, so inside their table: the comparison of the fixed columns finds it.
    lines = _padded(tmp_path)
    for moved in (
        lines[3].replace('"m": ', '"m":', 1).replace('"u":', '"u": ', 1),  # a space moved from m to u
        lines[3].replace('"i"', '"j"', 1),  # only a byte outside the numbers differs
        lines[3].replace('"m"', "'m'", 1),
    ):
        assert len(moved) == len(lines[3]) and moved != lines[3]
        block = "".join([*lines[:5], moved, *lines[5:]])
        assert _parse_fixed_block(block.encode()) is None
        _same(_write(tmp_path / "moved.jsonl", [block]))


def test_a_log_begun_compact_is_continued_compact_and_a_new_one_padded(tmp_path: Path) -> None:
    # A run begun by an older version holds, after a resume, the lines that version would have written.
    widths = exposure_widths(100, 2, 1000)
    old = tmp_path / "old.jsonl"
    log = RankLog(old)
    log.write({"u": 1, "m": 0, "i": [1, 2]})
    log.close()
    for path in (old, tmp_path / "new.jsonl"):
        log = ExposureLog(path, widths)
        log.write_exposure(2, 1, [3, 40])
        log.close()
    assert old.read_text() == '{"u":1,"m":0,"i":[1,2]}\n{"u":2,"m":1,"i":[3,40]}\n'
    assert (tmp_path / "new.jsonl").read_text() == '{"u":  2,"m": 1,"i":[  3, 40]}\n'
    log = ExposureLog(tmp_path / "new.jsonl", widths)  # a padded log is continued padded
    log.write_exposure(3, 0, [5])
    log.close()
    assert (tmp_path / "new.jsonl").read_text().splitlines()[1] == '{"u":  3,"m": 0,"i":[  5]}'


def test_padded_logs_are_trimmed_on_resume_and_for_bundles(tmp_path: Path) -> None:
    lines = _padded(tmp_path)
    train = tmp_path / "train"
    train.mkdir()
    log = train / "exposures-rank0.jsonl"
    _write(log, [*lines, lines[-1][:12]])  # and a torn last line
    kept = [x for x in lines if json.loads(x)["u"] <= 25]
    trim_copy(log, tmp_path / "copy.jsonl", 25)
    assert (tmp_path / "copy.jsonl").read_text() == "".join(kept)
    archive = trim_after(train, 25)
    assert archive is not None and log.read_text() == "".join(kept)
    assert (archive / log.name).read_text() == "".join([*lines[len(kept) :], lines[-1][:12]])
    _same(log)
