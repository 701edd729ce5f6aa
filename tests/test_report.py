"""`torchrelay report` on real runs: a two-segment and a four-segment run become readable PNGs and one HTML page."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from helpers import launch, segments
from torchrelay.cli import main
from torchrelay.policy.stop import write_request
from torchrelay.report import ReportError, render

SMALL = {"total_updates": 10, "save_every": 3, "warmup_updates": 2}


def relay(example: dict[str, Path], run_dir: Path, stops: list[int], finish: bool = True) -> Path:
    """One launch per stop (stopped by request file), then, with finish, one that finishes the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stop in [*stops, None] if finish else stops:
        if stop is not None:
            write_request(run_dir, at_update=stop)
        done = launch(example["code"], run_dir, config=example["config"], sets=SMALL)
        assert (done.returncode == 0) == (stop is None), done.stdout[-2000:] + done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(example, tmp_path_factory) -> dict[int, Path]:
    """A two-segment and a four-segment run that share their first segment (five launches, not six)."""
    base = tmp_path_factory.mktemp("report")
    first = relay(example, base / "four", [3], finish=False)
    shutil.copytree(first, base / "two")
    return {2: relay(example, base / "two", []), 4: relay(example, first, [5, 7])}


@pytest.fixture(scope="module")
def two_segments(runs) -> Path:
    return runs[2]


@pytest.fixture(scope="module")
def four_segments(runs) -> Path:
    return runs[4]


def check_report(run_dir: Path, out: Path, n_segments: int) -> None:
    result = render(run_dir, out)
    history = segments(run_dir)
    assert len(history) == n_segments and result.segments == n_segments and result.updates == 10
    assert [s["ended"] for s in history] == ["request"] * (n_segments - 1) + ["finished"]

    pngs = result.pngs()
    assert [p.name for p in pngs] == [
        "overview.png",
        "loss.png",
        "lr.png",
        "update_time.png",
        "samples_per_s.png",
        "exposures.png",
    ]
    overview = mpimg.imread(result.overview)
    assert overview.shape[0] > 1200 and overview.shape[1] >= 1300  # five stacked panels, readable width
    for png in pngs[1:]:
        height, width = mpimg.imread(png).shape[:2]
        assert width >= 1000 and 400 <= height <= 900, (png, width, height)
        assert png.stat().st_size > 20_000  # real plots, not an empty canvas

    page = result.html.read_text(encoding="utf-8")
    for png in pngs:  # every plot is embedded, byte for byte: the page stands alone
        assert base64.b64encode(png.read_bytes()).decode("ascii") in page
    assert "<img" in page and 'src="http' not in page and "src='" not in page
    assert "Resumability audit:" in page
    for index, seg in enumerate(history, start=1):  # every segment is named, with how it ended
        assert seg["segment"] in page and f"#{index}" in page
        assert f"{seg['first_update']}–{seg['last_update']}" in page
    for ckpt in sorted(p.name for p in run_dir.glob("checkpoint-*")):
        assert ckpt in page


@pytest.mark.launch
def test_report_of_a_two_segment_run(two_segments, tmp_path):
    check_report(two_segments, tmp_path / "report", 2)


@pytest.mark.launch
def test_report_of_a_four_segment_run(four_segments, tmp_path, capsys):
    check_report(four_segments, tmp_path / "report", 4)
    # The CLI is the same call plus printing; by default the report goes into RUN_DIR/report.
    assert main(["report", str(four_segments)]) == 0
    out = capsys.readouterr().out
    assert f"report: {four_segments / 'report' / 'report.html'}" in out and "4 segment(s)" in out
    assert (four_segments / "report" / "overview.png").is_file()


def test_report_refuses_a_run_without_metrics(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(ReportError, match="no metrics-rank"):
        render(empty, tmp_path / "out")
    assert main(["report", str(tmp_path / "missing")]) == 2  # a wrong path is refused
    assert "missing does not exist: no run directory there" in capsys.readouterr().err


@pytest.mark.launch
def test_a_torn_last_metrics_line_is_skipped(two_segments, tmp_path):
    # A killed writer leaves half a line; the report draws everything before it.
    copy = tmp_path / "run"
    shutil.copytree(two_segments, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    with (copy / "train" / "metrics-rank0.jsonl").open("a") as f:
        f.write(json.dumps({"update": 11, "loss": 1.0})[:12])
    assert render(copy, tmp_path / "out").updates == 10
