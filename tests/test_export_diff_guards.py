"""`export` writes nowhere inside a run directory, bundle or checkpoint (any of them, links followed), as `pack` and
`prepare` refuse theirs; `diff` compares what a resume would, the samples each side's own manifest lists included.
On a run written as the library writes one, without training (tests/scale_run.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scale_run import make_run
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.cli import main
from torchrelay.handoff.diff import diff, format_report


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(
        tmp_path_factory.mktemp("guards"),
        samples=4096,
        updates=2,
        ranks=1,
        micro=64,
        checkpoints=[2],
        segment_updates=2,
        total_updates=4,
    )


def test_export_refuses_an_out_inside_any_checkpoint_or_run_directory(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An export into the newest checkpoint was accepted; every resume then refused that checkpoint (a file its
    inventory does not list)."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    (tmp_path / "link").symlink_to(run / "checkpoint-2")
    cases = {
        run / "checkpoint-2" / "hf": f"lies inside the checkpoint {run / 'checkpoint-2'}",
        run / "checkpoint-2": "export folder",  # the checkpoint itself
        run / "exports" / "hf": f"lies inside the run directory (or bundle) {run}",
        other / "checkpoint-2" / "hf": f"lies inside the checkpoint {other / 'checkpoint-2'}",
        other / "train" / "hf": f"lies inside the run directory (or bundle) {other}",
        tmp_path / "link" / "hf": "lies inside the checkpoint",
    }
    for source in (run, run / "checkpoint-2"):
        for out, words in cases.items():
            assert main(["export", str(source), str(out)]) == 2, out
            err = capsys.readouterr().err
            assert err.startswith("torchrelay export: error: ") and words in err, (out, err)
            assert len(err.splitlines()) <= 2 and "Traceback" not in err, err
    assert not (run / "checkpoint-2" / "hf").exists() and not (run / "exports").exists()
    assert not (other / "train" / "hf").exists()
    validate_complete(run / "checkpoint-2", hashes=True)  # the checkpoint is still whole
    # outside every run, it writes (a folder named like a checkpoint is no checkpoint)
    assert main(["export", str(run), str(tmp_path / "serve" / "checkpoint-2")]) == 0, capsys.readouterr().err
    assert (tmp_path / "serve" / "checkpoint-2" / "model.safetensors").is_file()


def test_diff_reports_a_manifest_that_lists_other_samples_under_the_same_contract(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """diff compared the recorded contracts only: a run whose manifest lists other samples was 'contract:
    identical', and its resume was refused."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert diff(run, copy).same_contract
    manifest = copy / "data" / "manifest.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    swapped = json.loads(lines[7])
    swapped["id"] = "another-sample"
    manifest.write_text("".join([*lines[:7], json.dumps(swapped) + "\n", *lines[8:]]))
    report = diff(run, copy)
    assert not report.same_contract
    assert [d.key for d in report.contract] == ["data.fingerprint"]
    recorded = json.loads((copy / "resume_contract.json").read_text())["fields"]["data.fingerprint"]
    assert report.b.data_drift[0][:2] == ("data.fingerprint", recorded) and report.a.data_drift == ()
    text = "\n".join(format_report(report))
    assert "lists other samples than its own contract: a resume under that data_root is refused" in text, text
    assert "contract: identical" not in text and "data.fingerprint: fingerprint_v1:" in text
    assert main(["diff", str(run), str(copy)]) == 1 and main(["diff", str(copy), str(run)]) == 1
    assert "data.fingerprint" in capsys.readouterr().out
    # both sides the same other samples: one continues the other, and each side notes its own difference
    other = tmp_path / "other"
    shutil.copytree(copy, other)
    report = diff(copy, other)
    assert report.contract == [] and report.a.data_drift and report.b.data_drift
    manifest.unlink()  # no manifest at all: a resume is refused, and so is "identical"
    report = diff(run, copy)
    assert not report.same_contract and report.b.data_problem and "does not exist" in report.b.data_problem
