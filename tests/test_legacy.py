"""Runs and bundles written by torchrelay 0.1.0 still open, resume, verify and prepare, and end bit for bit.

tests/fixtures/legacy-v0.1.0/ was written by commit 9ed1f9c (tests/fixtures/make_legacy.py): a 2-rank run of the
example LM stopped at update 8 of 16, a bundle packed from it, the code as a git bundle, the data, and the digests of
every tensor of 0.1.0's own uninterrupted run at update 16. A change of any on-disk format, of the data order, the
RNG restore or the contract that breaks an existing user's run fails here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import git, launch, metrics, segments
from torchrelay.checkpoint.reader import load_tensors
from torchrelay.cli import main
from torchrelay.ledger import prove

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "legacy-v0.1.0"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
BASE = Path(EXPECTED["base"])  # the data root of 0.1.0's run lay here; the manifest names it


@pytest.fixture(scope="module")
def legacy() -> Path:
    """The fixture's data at its recorded place and its code at its recorded commit (a clone of the git bundle)."""
    shutil.rmtree(BASE, ignore_errors=True)
    shutil.copytree(FIXTURE / "data", BASE / "data")
    git(BASE, "clone", "-q", "-b", "main", str(FIXTURE / "code.gitbundle"), "code")
    yield BASE
    shutil.rmtree(BASE, ignore_errors=True)


def _digests(ckpt: Path) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in sorted(load_tensors(ckpt).items())
    }


def _assert_ends_like_0_1_0(run: Path) -> None:
    total = EXPECTED["total_updates"]
    digests = _digests(run / f"checkpoint-{total}")
    assert digests.keys() == EXPECTED["final_tensors_sha256"].keys()
    differ = [k for k, v in digests.items() if v != EXPECTED["final_tensors_sha256"][k]]
    assert not differ, f"{len(differ)} tensors differ from 0.1.0's uninterrupted run, e.g. {differ[:3]}"
    for r in (0, 1):
        assert metrics(run, r) == EXPECTED["metrics"][r], f"metrics of rank {r} differ"
        assert (run / "train" / f"exposures-rank{r}.jsonl").read_text() == EXPECTED["exposures"][r]
    assert prove(run).ok


def test_a_0_1_0_run_resumes_bit_for_bit(legacy: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    assert main(["status", str(run)]) == 0
    out = launch(legacy / "code", run)
    assert out.returncode == 0, out.stdout + out.stderr
    seg = segments(run)[-1]
    assert (seg["resumed_from"], seg["ended"]) == (EXPECTED["stopped_at"], "finished")
    _assert_ends_like_0_1_0(run)


def test_a_0_1_0_bundle_verifies_prepares_and_continues(
    legacy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(FIXTURE / "bundle", bundle)
    assert main(["verify", str(bundle)]) == 0
    moved = tmp_path / "elsewhere" / "root"
    shutil.copytree(legacy / "data" / "root", moved)
    run = tmp_path / "prepared"
    code = main(
        ["prepare", str(bundle), "--run-dir", str(run), "--set", f"data_root={moved}", "--check-files"]
    )
    assert code == 0
    assert "PREPARE_OK" in capsys.readouterr().out
    out = launch(legacy / "code", run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert segments(run)[-1]["resumed_from"] == EXPECTED["stopped_at"]
    _assert_ends_like_0_1_0(run)
