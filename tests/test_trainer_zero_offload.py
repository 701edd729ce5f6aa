"""Hugging Face Trainer + DeepSpeed ZeRO-2 with `offload_optimizer: cpu` (DeepSpeedCPUAdam) on 4 ranks, the G3A1
shape (issue 21): examples/train_hf_trainer_offload.py, a tiny Qwen3 with an adapter at 10x the learning rate.

Both tests compare against one uninterrupted 4-rank run, launched once for the module (checkpoints every 2
updates; the checkpoint cadence is runtime-only and never changes a bit):
- stopped late (update 5 of 6) and resumed with a loader worker: every tensor of the engine's checkpoint equal;
- moved 4 -> 2 -> 4 in place (tests/test_trainer_zero_move.py's move, with CPU Adam): within the audit's bound.

DeepSpeedCPUAdam's C++ op is compiled by DeepSpeed on first use (scripts/env.sh builds it once, before the tests);
without a C++ compiler the tests skip, saying so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import assert_same_logs, segments
from test_deepspeed import engine_state
from test_four_ranks import cpu_adam_or_skip
from test_trainer_zero_move import launch_trainer, move_4_to_2_to_4, tail_of, trainer_code
from torchrelay.checkpoint.deepspeed_engine import DS_DIR, DS_TAG
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.ledger.exposure import prove
from torchrelay.policy.stop import write_request

# 6 updates of 16 samples (2 a micro-batch, 2 micro-batches, 4 ranks) from a 64-sample set
WORLD, U, STOP = 4, 6, 5
OFFLOAD = ("--offload", "cpu")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted 4-rank run with CPU Adam (checkpoints 2, 4, 6), once for the module, and its code."""
    cpu_adam_or_skip()
    base = tmp_path_factory.mktemp("offload")
    code, whole = trainer_code(base), base / "whole"
    started = time.monotonic()
    out = launch_trainer(code, whole, WORLD, *OFFLOAD, "--save-steps", "2")
    assert out.returncode == 0, tail_of(out)
    # the engine steps DeepSpeed's CPU Adam, on every rank
    chain = "OPTIMIZER DeepSpeedOptimizerWrapper > DeepSpeedZeroOptimizer > DeepSpeedCPUAdam"
    assert out.stdout.count(chain) == WORLD, tail_of(out)
    return {"code": code, "whole": whole, "seconds": time.monotonic() - started}


@pytest.mark.launch
@pytest.mark.timeout(
    1500
)  # launches of 4 ranks that each import transformers and DeepSpeed: minutes under load
def test_trainer_zero2_cpu_adam_on_4_ranks_stopped_late_and_resumed_with_a_worker_is_bit_exact(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    """The G3A1 shape on its world size: stopped by a request after update 5 of 6 and resumed with 1 loader worker
    per rank instead of none, every tensor of the engine's checkpoint (the model, each of the 4 ranks' ZeRO
    partitions of the CPU-offloaded optimizer, the LR scheduler) and its counters equal to the uninterrupted
    4-rank run's; the ledger exact. Without the CPU Adam replay (deepspeed_engine.replay_cpu_adam) the resumed
    update parts from the uninterrupted one in the last bits."""
    code, whole, run = uninterrupted["code"], uninterrupted["whole"], tmp_path / "run"
    run.mkdir()
    write_request(run, at_update=STOP)
    out = launch_trainer(code, run, WORLD, *OFFLOAD)
    assert out.returncode != 0 and segments(run)[-1]["ended"] == "request", tail_of(out)
    assert segments(run)[-1]["last_update"] == STOP
    listed = {e["path"] for e in validate_complete(run / f"checkpoint-{STOP}")["files"]}
    parts = {f"{DS_DIR}/{DS_TAG}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)}
    assert parts <= listed and {f"rng/rank-{r}.safetensors" for r in range(WORLD)} <= listed
    out = launch_trainer(code, run, WORLD, *OFFLOAD, "--workers", "1")
    assert out.returncode == 0, tail_of(out)
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["request", "finished"] and segs[-1]["resumed_from"] == STOP
    assert segs[-1]["world_size"] == WORLD

    want, want_counters = engine_state(whole / f"checkpoint-{U}")
    have, have_counters = engine_state(run / f"checkpoint-{U}")
    assert want.keys() == have.keys()
    assert {k.split(".")[0] for k in want if k.startswith("optim@")} == {
        f"optim@rank{r}" for r in range(WORLD)
    }
    differ = [k for k in want if not torch.equal(want[k], have[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"
    assert want_counters == have_counters and want_counters["global_steps"] == U
    # the loss and both learning rates at every update, each rank's ids
    assert_same_logs(whole, run, ranks=WORLD)
    ledger = prove(run)
    # 6 updates of 16 samples from 64: one epoch whole, half of the next, no sample twice in one
    assert ledger.ok and ledger.exposures == U * 16 and ledger.distinct == 64 and ledger.repeats == 0


@pytest.mark.launch
@pytest.mark.full
@pytest.mark.timeout(1800)  # launches of 4 and 2 ranks that each import transformers and DeepSpeed
def test_trainer_zero2_cpu_adam_moves_4_to_2_to_4_in_place_proven_and_the_ledger_exact(
    uninterrupted: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tests/test_trainer_zero_move.py's move with `offload_optimizer: cpu`: the run stopped after update 2 on 4
    ranks, moved to 2 (TORCHRELAY_RESHARD=1) and back to 4 (RelayOptions(reshard=True)), against the uninterrupted
    run: each move proven at load (DeepSpeedCPUAdam's partitions resharded), the ledger exact, every parameter
    within the audit's bound, `status` showing the move."""
    code, run = uninterrupted["code"], tmp_path / "run"
    run.mkdir()
    write_request(run, at_update=2)
    started = time.monotonic()
    out = launch_trainer(code, run, WORLD, *OFFLOAD)
    shown = [
        f"uninterrupted, 4 ranks: {uninterrupted['seconds']:.0f} s",
        f"4 ranks to update 2: {time.monotonic() - started:.0f} s",
    ]
    assert (run / "checkpoint-2" / "COMPLETE.json").exists(), tail_of(out)
    move_4_to_2_to_4(code, uninterrupted["whole"], run, True, capsys, shown)
