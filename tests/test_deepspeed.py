"""DeepSpeed ZeRO-2 through torchrelay on 2 CPU ranks (gloo), against the uninterrupted run: every engine tensor and
counter equal, each sample once.

- examples/train_deepspeed.py, a plain loop around deepspeed.initialize: stopped by a request, handed off (pack,
  verify, prepare with another worker count) and finished.
- examples/train_hf_trainer_deepspeed.py, Trainer(deepspeed=...): stopped by a request, killed inside a save, stopped
  by a late signal and a budget with the loader's worker count changed, handed off and finished.
- Changed learning rate, batch (gradient accumulation) or ZeRO stage refused naming the field; another world size
  refused; DeepSpeed's pickles read weights_only from inside the verified checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import (
    REPO,
    TORCHRUN,
    assert_same_logs,
    clean_env,
    make_code_repo,
    run_tree,
    segments,
    sigterm,
    wait_for_update,
)
from torchrelay.checkpoint.deepspeed_engine import DS_DIR, DS_TAG, _VerifiedLoads, load_engine, safe_load
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.reader import load_tensors
from torchrelay.cli import main
from torchrelay.errors import CheckpointError, ConfigError, UnsafeInput
from torchrelay.ledger.exposure import prove
from torchrelay.policy.stop import write_request

U = 12  # the example's default schedule; it saves every 4 updates
SCRIPT = "train_deepspeed.py"


def _cmd(code: Path, run: Path, data: dict[str, Path], *args: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / SCRIPT),
        "--run-dir",
        str(run),
        "--manifest",
        str(data["manifest"]),
        "--data-root",
        str(data["root"]),
        *args,
    ]


def _env(**extra: str) -> dict[str, str]:
    return clean_env(DS_ACCELERATOR="cpu", **extra)


def launch_ds(code: Path, run: Path, data: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    return run_tree(_cmd(code, run, data, *args), timeout=400, env=_env(), cwd=code)


@pytest.fixture(scope="module")
def ds(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("deepspeed")
    code = make_code_repo(base / "code", (SCRIPT,))
    baseline = base / "baseline"
    out = launch_ds(code, baseline, example)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {"code": code, "baseline": baseline, "manifest": example["manifest"], "root": example["root"]}


def _rank_of(path: Path) -> int:
    return int(path.name.split("_")[3])


def engine_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the engine's checkpoint, and its counters, LR scheduler and each rank's loss scaler."""
    tensors = load_tensors(ckpt)
    files = ckpt / DS_DIR / DS_TAG
    model = safe_load(files / "mp_rank_00_model_states.pt")
    counters = {k: model[k] for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")}
    for rank, path in enumerate(
        sorted(files.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    ):
        assert _rank_of(path) == rank, path
        optim = safe_load(path)["optimizer_state_dict"]
        counters[f"loss_scaler@{rank}"] = vars(optim["loss_scaler"])
    return tensors, counters


@pytest.mark.launch
def test_zero2_request_handoff_is_bit_exact(ds: dict[str, Path], tmp_path: Path) -> None:
    """The plain loop stopped once and finished elsewhere (an engine's stop by a signal and by a budget: the Trainer
    + ZeRO-2 chain below)."""
    code, data = ds["code"], ds
    source = tmp_path / "source"
    source.mkdir()
    write_request(source, at_update=3)
    out = launch_ds(code, source, data)
    assert segments(source)[-1]["ended"] == "request", out.stdout[-3000:] + out.stderr[-3000:]
    assert segments(source)[-1]["last_update"] == 3
    # the engine's own files are inside the committed checkpoint and its inventory, one optimizer shard per rank
    listed = {e["path"] for e in validate_complete(source / "checkpoint-3")["files"]}
    for name in (
        "mp_rank_00_model_states.pt",
        *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)),
    ):
        assert f"{DS_DIR}/{DS_TAG}/{name}" in listed
    assert {"rng/rank-0.safetensors", "rng/rank-1.safetensors"} <= listed  # each rank's RNG, torchrelay's own

    bundle, run = tmp_path / "bundle", tmp_path / "elsewhere"
    assert main(["pack", str(source), str(bundle)]) == 0
    assert main(["verify", str(bundle)]) == 0
    assert main(["prepare", str(bundle), "--run-dir", str(run), "--set", "num_workers=2"]) == 0
    moved = next((run / "source").iterdir())  # the bundle's exact code

    out = launch_ds(moved, run, data)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["request", "finished"] and segs[-1]["resumed_from"] == 3
    assert json.loads((run / "config.json").read_text())["num_workers"] == 2

    want, want_counters = engine_state(ds["baseline"] / f"checkpoint-{U}")
    have, have_counters = engine_state(run / f"checkpoint-{U}")
    assert want.keys() == have.keys() and len(want) >= 10
    assert {k for k in want if k.startswith("optim@rank1.")}, "no optimizer partition of rank 1"
    differ = [k for k in want if not torch.equal(want[k], have[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    assert want_counters == have_counters and want_counters["global_steps"] == U
    assert_same_logs(ds["baseline"], run)
    ledger = prove(run)
    assert ledger.ok and ledger.exposures == ledger.distinct == U * 16


@pytest.mark.launch
def test_changed_zero_stage_and_lr_are_refused_naming_the_fields(ds: dict[str, Path]) -> None:
    out = launch_ds(ds["code"], ds["baseline"], ds, "--zero-stage", "3", "--lr", "0.01")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "params.deepspeed.zero_optimization.stage: 2 -> 3" in text, text[-3000:]
    assert "params.lr: 0.003 -> 0.01" in text
    assert main(["status", str(ds["baseline"]), "--last-exit"]) == 2
    assert segments(ds["baseline"])[-1]["ended"] == "refused"


def test_another_world_size_is_refused_before_deepspeed_reads_a_file(tmp_path: Path) -> None:
    """This process is one rank; a ZeRO-3 record says two: refused before the engine (None here) is touched
    (ZeRO-1/2 partitions are resharded instead: tests/test_zero_reshard.py)."""
    record = {"dir": DS_DIR, "tag": DS_TAG, "zero_stage": 3, "world_size": 2, "global_steps": 4}
    with pytest.raises(
        ConfigError, match=r"(?s)ZeRO stage 3 state is partitioned over 2 ranks, this launch has 1"
    ):
        load_engine(None, tmp_path / "checkpoint-4", record)
    with pytest.raises(CheckpointError, match="holds no DeepSpeed engine state"):
        load_engine(None, tmp_path / "checkpoint-4", None)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_engine_files_are_read_weights_only_and_inside_the_checkpoint(tmp_path: Path) -> None:
    """What DeepSpeed reads through torchrelay is a weights_only load of a file of the verified checkpoint."""
    root = tmp_path / "checkpoint-4" / DS_DIR
    (root / DS_TAG).mkdir(parents=True)
    marker = tmp_path / "pwned"
    planted = root / DS_TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(marker)}, planted)
    loads = _VerifiedLoads(None, root)
    with pytest.raises(
        UnsafeInput, match="not a DeepSpeed checkpoint file torchrelay loads"
    ):  # one line, exit 2
        loads.load(str(planted))
    assert not marker.exists()
    outside = tmp_path / "elsewhere.pt"
    torch.save({"x": torch.zeros(1)}, outside)
    with pytest.raises(CheckpointError, match="outside the verified"):
        loads.load(str(outside))
    torch.save({"x": torch.ones(2)}, root / DS_TAG / "fine.pt")
    assert torch.equal(loads.load(str(root / DS_TAG / "fine.pt"))["x"], torch.ones(2))


@pytest.mark.launch
def test_a_planted_pickle_in_one_ranks_partition_ends_both_ranks_at_once(
    ds: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 19 defect 2: a pickle planted in rank 1's optimizer partition (its inventory entry rewritten to match,
    as a hostile copy would) used to leave rank 0 waiting in the load's gather and rank 1 at the script's barrier
    until gloo's 30-minute timeout. Now both raise the same line, said once, within seconds (util/collective.py)."""
    run = tmp_path / "run"
    shutil.copytree(ds["baseline"], run)
    ckpt = run / f"checkpoint-{U}"
    planted = ckpt / DS_DIR / DS_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "pwned"
    torch.save({"optimizer_state_dict": _Payload(marker)}, planted)
    inventory = json.loads((ckpt / "COMPLETE.json").read_text())
    for entry in inventory["files"]:
        if entry["path"] == f"{DS_DIR}/{DS_TAG}/{planted.name}":
            entry["sha256"] = hashlib.sha256(planted.read_bytes()).hexdigest()
            entry["size"] = planted.stat().st_size
    (ckpt / "COMPLETE.json").write_text(json.dumps(inventory))
    started = time.monotonic()
    out = run_tree(_cmd(ds["code"], run, ds), timeout=150, env=_env(), cwd=ds["code"])
    seconds = time.monotonic() - started
    text = out.stdout + out.stderr
    said = [line for line in text.splitlines() if line.startswith("torchrelay")]
    assert out.returncode != 0 and not marker.exists(), text[-3000:]
    assert len(said) == 1 and said[0].startswith(f"torchrelay: loading checkpoint-{U} failed on rank 1"), said
    assert "Timed out" not in text and seconds < 120, (seconds, text[-3000:])


# Trainer(deepspeed=...): examples/train_hf_trainer_deepspeed.py through tests/trainer_paced.py (its updates paced
# by TRAINER_PACE_S, so that a signal lands before the end); 8 samples an update from a 64-sample set
HF_SCRIPT = "train_hf_trainer_deepspeed.py"
HF_ENV = {"TRAINER_EXAMPLE": HF_SCRIPT.removesuffix(".py")}


def _hf_cmd(code: Path, run: Path, *args: str) -> list[str]:
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / "trainer_paced.py"),
    ]
    return [*cmd, "--output-dir", str(run), *args]


def launch_hf(code: Path, run: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    out = run_tree(_hf_cmd(code, run, *args), timeout=400, env=_env(**HF_ENV, **(env or {})), cwd=code)
    return out.returncode, out.stdout[-4000:] + out.stderr[-4000:]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted Trainer + ZeRO-2 run, and the code repo every launch of it runs from."""
    base = tmp_path_factory.mktemp("hf-deepspeed")
    (base / "code").mkdir()
    shutil.copyfile(REPO / "tests" / "trainer_paced.py", base / "code" / "trainer_paced.py")
    code = make_code_repo(base / "code", (HF_SCRIPT,))
    baseline = base / "baseline"
    rc, out = launch_hf(code, baseline)
    assert rc == 0, out
    return {"code": code, "baseline": baseline}


@pytest.mark.launch
def test_trainer_zero2_stopped_killed_handed_off_ends_bit_exact(hf: dict[str, Path], tmp_path: Path) -> None:
    """Trainer(deepspeed=...) ZeRO-2 stopped by a request, killed inside a save, stopped by a signal late in the
    schedule and by a budget, with the loader's worker count changed, then packed, verified, prepared elsewhere and
    finished there: every parameter and optimizer tensor (each rank's ZeRO partition among them) and the engine's
    counters equal to the uninterrupted run's, each sample once."""
    code, baseline = hf["code"], hf["baseline"]
    run = tmp_path / "run"
    run.mkdir()
    # 1. a request file, honoured after update 3
    write_request(run, at_update=3)
    rc, out = launch_hf(code, run)
    assert rc != 0 and segments(run)[-1]["ended"] == "request", out
    assert segments(run)[-1]["last_update"] == 3
    listed = {e["path"] for e in validate_complete(run / "checkpoint-3")["files"]}
    assert {f"{DS_DIR}/{DS_TAG}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= listed
    # 2. rank 0 SIGKILLed inside the save of checkpoint-4 (the engine's files and the inventory written, not yet
    # renamed), with 2 loader workers
    rc, out = launch_hf(code, run, "--workers", "2", "--kill-at", "rename:4:0")
    assert rc != 0 and not (run / "checkpoint-4").exists(), out
    killed = list(run.glob(".tmp-checkpoint-4-*"))
    assert killed and (killed[0] / DS_DIR / DS_TAG / "mp_rank_00_model_states.pt").is_file(), out
    # 3. SIGTERM late in the schedule (after update 8 of 12): resumes from checkpoint-3, the previous complete one
    proc = subprocess.Popen(
        _hf_cmd(code, run, "--workers", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(**HF_ENV, TRAINER_PACE_S="0.3", TORCHRELAY_CHECK_EVERY="1"),
        cwd=code,
        start_new_session=True,
    )
    try:
        wait_for_update(run, 8, proc, timeout=300)
        sigterm(proc)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    seg = segments(run)[-1]
    assert seg["ended"] == "signal", proc.stdout.read() if proc.stdout else ""
    assert seg["resumed_from"] == 3 and 8 <= seg["last_update"] < U, seg
    assert [s["ended"] for s in segments(run)] == ["request", "crash", "signal"]
    assert not list(run.glob(".tmp-checkpoint-*"))  # the killed save's leftovers were removed at the open
    stopped = seg["last_update"]
    assert (run / f"checkpoint-{stopped}").is_dir()  # the stop saved first
    # 4. a time budget that no update fits in: stops at the first boundary, nothing to save
    rc, out = launch_hf(code, run, env={"TORCHRELAY_BUDGET_S": "0.5"})
    assert segments(run)[-1]["ended"] == "budget" and segments(run)[-1]["last_update"] == stopped, out
    assert main(["status", str(run), "--last-exit"]) == 3
    # 5. packed, verified, prepared into another directory, and finished there with 1 loader worker
    bundle, there = tmp_path / "bundle", tmp_path / "elsewhere" / "run"
    assert main(["pack", str(run), str(bundle)]) == 0
    assert main(["verify", str(bundle)]) == 0
    assert main(["prepare", str(bundle), "--run-dir", str(there)]) == 0
    moved = next((there / "source").iterdir())
    rc, out = launch_hf(moved, there, "--workers", "1")
    assert rc == 0, out
    segs = segments(there)
    assert [s["ended"] for s in segs] == ["request", "crash", "signal", "budget", "finished"]
    assert segs[-1]["resumed_from"] == stopped

    want, want_counters = engine_state(baseline / f"checkpoint-{U}")
    have, have_counters = engine_state(there / f"checkpoint-{U}")
    assert want.keys() == have.keys() and len(want) > 20
    assert {k for k in want if k.startswith("optim@rank1.")}, "no optimizer partition of rank 1"
    differ = [k for k in want if not torch.equal(want[k], have[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    assert want_counters == have_counters and want_counters["global_steps"] == U
    # Trainer's own LR scheduler (not DeepSpeed's) is tracked beside the engine: same LR at every update
    assert_same_logs(baseline, there)
    ledger = prove(there)
    # 12 updates of 8 samples from a 64-sample set: one epoch whole, half of the next, no sample twice in one
    assert ledger.ok and ledger.exposures == U * 8 and ledger.distinct == 64 and ledger.repeats == 0


@pytest.mark.launch
def test_trainer_zero2_refuses_changed_lr_batch_and_stage_naming_the_fields(hf: dict[str, Path]) -> None:
    rc, out = launch_hf(hf["code"], hf["baseline"], "--lr", "0.002", "--grad-accum", "4", "--zero-stage", "3")
    assert rc != 0
    for field in (
        "params.training_args.learning_rate: 0.001 -> 0.002",
        "params.training_args.gradient_accumulation_steps: 2 -> 4",
        "params.training_args.deepspeed.zero_optimization.stage: 2 -> 3",
    ):
        assert field in out, out
    assert segments(hf["baseline"])[-1]["ended"] == "refused"
    assert main(["status", str(hf["baseline"]), "--last-exit"]) == 2
