"""Runs and bundles written by torchrelay 0.1.0 still open, resume, verify and prepare, and end bit for bit where
0.1.0 itself ends them.

tests/fixtures/legacy-v0.1.0/ was written by commit 9ed1f9c (tests/fixtures/make_legacy.py): a 2-rank run of the
example LM stopped at update 8 of 16, a bundle packed from it, the code as a git bundle, the data, and 0.1.0's own
library (`git archive 9ed1f9c src/torchrelay`). A change of any on-disk format, of the data order, the RNG restore
or the contract that breaks an existing user's run fails here.

What the fixture fixes is what no floating-point kernel computes: the names of the tensors, every rank's exposures
(the data order) and the ledger. The tensors and losses at update 16 depend on the kernels of the machine that runs
updates 9-16 (an AMD EPYC and an Intel Xeon differ in 47 of 68 tensors; see docs/NUMERICS.md), so the reference is
computed here: 0.1.0's library continues the same stopped run to its end, on this machine, in one launch. Where
0.1.0 wrote the fixture, that continuation equalled its uninterrupted run bit for bit.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import git, launch, metrics, segments
from torchrelay.checkpoint.reader import load_tensors
from torchrelay.cli import main
from torchrelay.ledger.exposure import prove

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "legacy-v0.1.0"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
BASE = Path(EXPECTED["base"])  # the data root of 0.1.0's run lay here; the manifest names it


@pytest.fixture(scope="module")
def legacy() -> Path:
    """The fixture's data at its recorded place, its code at its recorded commit (a clone of the git bundle) and
    0.1.0's library under BASE/torchrelay-0.1.0/src. BASE is one fixed path (the manifest names it): a second
    session running this module on the machine (another checkout's suite) waits for this one instead of
    removing its files mid-launch."""
    lock = open(f"{BASE}.lock", "a")  # noqa: SIM115 - held, and released by closing, at the fixture's end
    fcntl.flock(lock, fcntl.LOCK_EX)
    shutil.rmtree(BASE, ignore_errors=True)
    shutil.copytree(FIXTURE / "data", BASE / "data")
    git(BASE, "clone", "-q", "-b", "main", str(FIXTURE / "code.gitbundle"), "code")
    with tarfile.open(FIXTURE / "torchrelay-0.1.0.tar.gz") as tar:
        # Our own archive; the filter where this Python has it (3.11.4 on), which 3.14 applies by default.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(BASE / "torchrelay-0.1.0", **safe)  # type: ignore[arg-type]
    yield BASE
    shutil.rmtree(BASE, ignore_errors=True)
    lock.close()


@pytest.fixture(scope="module")
def reference(legacy: Path) -> dict[str, Any]:
    """0.1.0's own end of the stopped run, computed on this machine: its tensor digests and every rank's metrics."""
    run = legacy / "reference"
    shutil.copytree(FIXTURE / "run", run)
    out = launch(legacy / "code", run, env={"PYTHONPATH": str(legacy / "torchrelay-0.1.0" / "src")})
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_ends_like_0_1_0_in_what_no_kernel_computes(run)
    return {"digests": _digests(run), "metrics": [metrics(run, r) for r in (0, 1)]}


def _digests(run: Path) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in sorted(load_tensors(run / f"checkpoint-{EXPECTED['total_updates']}").items())
    }


def _assert_ends_like_0_1_0_in_what_no_kernel_computes(run: Path) -> None:
    assert sorted(load_tensors(run / f"checkpoint-{EXPECTED['total_updates']}")) == EXPECTED["final_tensors"]
    for r in (0, 1):
        assert (run / "train" / f"exposures-rank{r}.jsonl").read_text() == EXPECTED["exposures"][r]
        assert [m["update"] for m in metrics(run, r)] == list(range(1, EXPECTED["total_updates"] + 1))
    assert prove(run).ok


def _assert_ends_like_0_1_0(run: Path, reference: dict[str, Any]) -> None:
    _assert_ends_like_0_1_0_in_what_no_kernel_computes(run)
    digests = _digests(run)
    differ = [k for k, v in digests.items() if v != reference["digests"][k]]
    assert not differ, f"{len(differ)} tensors differ from 0.1.0's own end of the run, e.g. {differ[:3]}"
    for r in (0, 1):
        assert metrics(run, r) == reference["metrics"][r], f"metrics of rank {r} differ"


def test_a_0_1_0_run_resumes_bit_for_bit(legacy: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    assert main(["status", str(run)]) == 0
    out = launch(legacy / "code", run)
    assert out.returncode == 0, out.stdout + out.stderr
    seg = segments(run)[-1]
    assert (seg["resumed_from"], seg["ended"]) == (EXPECTED["stopped_at"], "finished")
    _assert_ends_like_0_1_0(run, reference)


def test_a_0_1_0_bundle_verifies_prepares_and_continues(
    legacy: Path, reference: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
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
    _assert_ends_like_0_1_0(run, reference)
