"""The exposure logs' fast reader (train_records.read_exposures) against the line-by-line one it falls back to.

The fast path checks a block of lines with a few whole-block operations instead of one parse per line: any line
that is not exactly what the writer writes must reach the line reader (util/jsonl's policy, the schema), so that
the ledger proves and refuses exactly what it proved and refused line by line. In-process, on small files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torchrelay.errors import RelayError
from torchrelay.train_records import RankLog, _exposures_by_line, _parse_exposure_block, read_exposures


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
