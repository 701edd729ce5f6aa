"""Hugging Face Trainer as a torchrelay run (examples/train_hf_trainer.py, 2 ranks under torchrun on CPU).

Stopped by a request, killed inside a save, stopped by a signal late in the schedule and by a budget, packed,
verified, prepared elsewhere and finished there, with the loader's worker count changed along the way: it ends bit for
bit where the uninterrupted run ends, every sample seen exactly once. A changed learning rate is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import (
    REPO,
    TORCHRUN,
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    make_code_repo,
    segments,
    sigterm,
    wait_for_update,
)
from torchrelay.cli import main
from torchrelay.ledger import prove

U = 12  # the example's max_steps: 8 updates an epoch, so the schedule crosses into epoch 1
# the example, its updates paced by TRAINER_PACE_S (a signal must land before the run ends)
SCRIPT = "trainer_paced.py"


def _cmd(code: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / SCRIPT),
        "--output-dir",
        str(run_dir),
        *extra,
    ]


def _launch(code: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    import subprocess

    out = subprocess.run(
        _cmd(code, run_dir, *extra),
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(**(env or {})),
        cwd=code,
    )
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("trainer-code") / "code"
    dest.mkdir()
    shutil.copyfile(REPO / "tests" / SCRIPT, dest / SCRIPT)
    return make_code_repo(dest, scripts=("train_hf_trainer.py",))


@pytest.fixture(scope="module")
def baseline(code: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("trainer-baseline") / "run"
    rc, out = _launch(code, run)
    assert rc == 0, out
    assert "SCHEDULE_GATE_PASS (12, 2)" in out and "TRAINING_CONTRACT" in out
    assert (run / "final" / "model.safetensors").is_file()  # save_model() of a finished run
    return run


def test_trainer_stopped_killed_handed_off_ends_bit_exact(code: Path, baseline: Path, tmp_path: Path) -> None:
    import subprocess

    run = tmp_path / "run"
    run.mkdir()
    # 1. a request file, honoured after update 3
    main(["stop", str(run), "--at-update", "3", "--before-start"])
    rc, out = _launch(code, run)
    assert rc != 0 and "exitcode  : 4" in out, out
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 3
    assert not (run / "final").exists()  # save_model() of a stopped run writes nothing
    # 2. rank 0 SIGKILLed inside the save of checkpoint-4 (its inventory written, not yet renamed), 2 loader workers
    rc, out = _launch(code, run, "--workers", "2", env={"TORCHRELAY_TEST_KILL": "rename:4:0"})
    assert rc != 0, out
    assert not (run / "checkpoint-4").exists() and list(run.glob(".tmp-checkpoint-4-*")), out
    # 3. SIGTERM late in the schedule (after update 8 of 12): resumes from checkpoint-3, the previous complete one
    proc = subprocess.Popen(
        _cmd(code, run, "--workers", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(TRAINER_PACE_S="0.3", TORCHRELAY_CHECK_EVERY="1"),
        cwd=code,
        start_new_session=True,
    )
    wait_for_update(run, 8, proc)
    sigterm(proc)
    proc.wait(timeout=120)
    seg = segments(run)[-1]
    assert seg["ended"] == "signal", proc.stdout.read() if proc.stdout else ""
    assert seg["resumed_from"] == 3 and 8 <= seg["last_update"] < U, seg
    assert [s["ended"] for s in segments(run)] == ["request", "crash", "signal"]
    assert segments(run)[1]["runtime_changes"] == {"num_workers": [0, 2]}  # recorded by the killed launch
    assert not list(run.glob(".tmp-checkpoint-*"))  # the killed save's leftovers were removed at the open
    stopped = seg["last_update"]
    # 4. a time budget that no update fits in: stops at the first boundary, nothing to save
    rc, out = _launch(code, run, env={"TORCHRELAY_BUDGET_S": "0.5"})
    assert segments(run)[-1]["ended"] == "budget" and segments(run)[-1]["last_update"] == stopped, out
    assert main(["status", str(run), "--last-exit"]) == 3
    # 5. packed, verified, prepared into another directory, and finished there
    bundle = tmp_path / "bundle"
    assert main(["pack", str(run), str(bundle)]) == 0
    assert main(["verify", str(bundle)]) == 0
    there = tmp_path / "elsewhere" / "run"
    assert main(["prepare", str(bundle), "--run-dir", str(there)]) == 0
    moved = next((there / "source").iterdir())
    rc, out = _launch(moved, there)
    assert rc == 0, out
    assert segments(there)[-1]["resumed_from"] == stopped

    assert assert_same_final_state(baseline, there, U) > 20  # every parameter and optimizer tensor
    assert_same_logs(baseline, there)  # per-rank metrics (loss, lr, grad_norm) and exposures
    ledger = prove(there)
    # 12 updates of 8 samples from a 64-sample set: one epoch whole, half of the next, no sample twice in one
    assert ledger.ok and ledger.exposures == U * 8 and ledger.distinct == 64 and ledger.repeats == 0
    assert json.loads((there / "resume_contract.json").read_text()) == json.loads(
        (baseline / "resume_contract.json").read_text()
    )


def test_trainer_refuses_a_changed_learning_rate(code: Path, baseline: Path) -> None:
    rc, out = _launch(code, baseline, "--lr", "0.002")
    assert rc != 0 and "exitcode  : 2" in out, out
    assert "params.training_args.learning_rate: 0.001 -> 0.002" in out, out
    assert segments(baseline)[-1]["ended"] == "refused"
    assert main(["status", str(baseline), "--last-exit"]) == 2


def test_readme_shows_the_example_file() -> None:
    body = (REPO / "examples" / "train_hf_trainer.py").read_text()
    assert body[body.index("import argparse") :] in (REPO / "README.md").read_text()


def test_trainer_runtime_and_contract_arguments() -> None:
    from transformers import TrainingArguments

    from torchrelay.integrations.hf_contract import math_args

    a = TrainingArguments(output_dir="/a", use_cpu=True, report_to="none", dataloader_num_workers=0)
    b = TrainingArguments(
        output_dir="/b", use_cpu=True, report_to="none", dataloader_num_workers=8, logging_steps=3
    )
    assert math_args(a) == math_args(b)  # paths, workers, reporting and logging are runtime-only
    c = TrainingArguments(output_dir="/a", use_cpu=True, report_to="none", per_device_train_batch_size=3)
    assert {k for k in math_args(a) if math_args(a)[k] != math_args(c)[k]} == {"per_device_train_batch_size"}
