"""Every contract field changed in turn is refused with `field: old -> new`; runtime fields are accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import git, launch, segments
from torchrelay.cli import main
from torchrelay.policy.stop import write_request

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def stopped(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped after update 2 with a complete checkpoint-2."""
    run = tmp_path_factory.mktemp("contract") / "run"
    run.mkdir()
    write_request(run, at_update=2)
    out = launch(example["code"], run, config=example["config"])
    assert (run / "checkpoint-2" / "COMPLETE.json").exists(), out.stdout + out.stderr
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize(
    ("sets", "nproc", "field", "old", "new"),
    [
        ({"params.lr": 0.001}, 2, "params.lr", "0.003", "0.001"),
        ({"seed": 7}, 2, "seed", "1234", "7"),
        ({"micro_batch": 2}, 2, "micro_batch", "4", "2"),
        ({}, 1, "world_size", "2", "1"),
    ],
)
def test_contract_field_changed_is_refused(
    example: dict[str, Path],
    stopped: Path,
    tmp_path: Path,
    sets: dict,
    nproc: int,
    field: str,
    old: str,
    new: str,
) -> None:
    run = _copy(stopped, tmp_path)
    before = segments(run)
    out = launch(example["code"], run, nproc=nproc, sets=sets)
    assert out.returncode != 0
    assert f"{field}: {old} -> {new}" in out.stderr, out.stderr[-3000:]
    # one message from rank 0 (issue 9 defect 6); no frame of a rank, only torchrun's own ChildFailedError
    assert out.stderr.count("torchrelay: resume refused") == 1, out.stderr[-3000:]
    frames = [line for line in out.stderr.splitlines() if line.strip().startswith('File "')]
    assert all("site-packages" in f or "bin/torchrun" in f for f in frames), frames
    assert out.stderr.count("exitcode  : 2") == nproc  # every rank ended with the refusal's code
    # nothing ran, and the launch is on record as refused (issue 8 defect 5)
    after = segments(run)
    assert after[:-1] == before and (after[-1]["ended"], after[-1]["exit_code"]) == ("refused", 2)
    assert f"{field}: {old} -> {new}" in after[-1]["notes"][-1]
    assert main(["status", "--last-exit", str(run)]) == 2
    assert (run / "checkpoint-2" / "COMPLETE.json").exists()


def test_manifest_content_change_is_refused(example: dict[str, Path], stopped: Path, tmp_path: Path) -> None:
    run = _copy(stopped, tmp_path)
    lines = (run / "data" / "manifest.jsonl").read_text().splitlines()
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(lines[:-1]) + "\n")  # one sample fewer
    out = launch(example["code"], run, sets={"manifest": str(other)})
    assert out.returncode != 0
    assert "data.fingerprint: 'fingerprint_v1:" in out.stderr and "data.samples:" in out.stderr, out.stderr[
        -3000:
    ]


def test_code_commit_change_is_refused(example: dict[str, Path], stopped: Path, tmp_path: Path) -> None:
    code = tmp_path / "code"
    shutil.copytree(example["code"], code)
    old = git(code, "rev-parse", "HEAD")
    (code / "train_lm.py").write_text((code / "train_lm.py").read_text() + "\n# a later change\n")
    git(code, "commit", "-qam", "later")
    new = git(code, "rev-parse", "HEAD")
    run = _copy(stopped, tmp_path)
    out = launch(code, run)
    assert out.returncode != 0
    assert f"code.commit: '{old}' -> '{new}'" in out.stderr, out.stderr[-3000:]


def test_runtime_field_change_resumes_and_is_recorded(
    example: dict[str, Path], stopped: Path, tmp_path: Path
) -> None:
    run = _copy(stopped, tmp_path)
    out = launch(example["code"], run, sets={"params.log_every": 5, "save_every": 4})
    assert out.returncode == 0, out.stdout + out.stderr
    seg = segments(run)[-1]
    assert seg["runtime_changes"] == {"params.log_every": [1, 5], "save_every": [8, 4]}
    assert json.loads((run / "config.json").read_text())["save_every"] == 4


def test_stale_stop_request_is_ignored_and_reported(
    example: dict[str, Path], stopped: Path, tmp_path: Path
) -> None:
    run = _copy(stopped, tmp_path)
    write_request(run, job="999")
    out = launch(example["code"], run, env={"SLURM_JOB_ID": "123"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ignored stale stop request for job 999 (this job: 123)" in out.stderr
    seg = segments(run)[-1]
    assert seg["ended"] == "finished" and seg["job"] == "123"
    assert any("stale stop request for job 999" in n for n in seg["notes"])
    assert (run / "REQUEST_STOP").exists()  # it belongs to another job: left for it


def test_request_for_this_job_is_honoured(example: dict[str, Path], stopped: Path, tmp_path: Path) -> None:
    run = _copy(stopped, tmp_path)
    write_request(run, job="123", at_update=4)
    launch(example["code"], run, env={"SLURM_JOB_ID": "123"})
    seg = segments(run)[-1]
    assert (seg["ended"], seg["last_update"]) == ("request", 4)
    assert not (run / "REQUEST_STOP").exists()
    assert list((run / "train" / "stop-requests").iterdir())


def test_flipped_byte_in_checkpoint_is_refused_naming_the_file(
    example: dict[str, Path], stopped: Path, tmp_path: Path
) -> None:
    run = _copy(stopped, tmp_path)
    victim = next((run / "checkpoint-2" / "model").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    out = launch(example["code"], run)
    assert out.returncode != 0
    assert f"{victim} does not match its SHA-256 in COMPLETE.json" in out.stderr, out.stderr[-3000:]
