"""Four ranks, as the G3A1 run had (issue 21), and DeepSpeed's CPU Adam, its optimizer.

- examples/train_hf_trainer_offload.py: Trainer + DeepSpeed ZeRO-2 with `offload_optimizer: cpu`
  (DeepSpeedCPUAdam) on 4 CPU ranks, stopped late and resumed with a loader worker: tests/test_trainer_zero_offload.py
  (it shares its uninterrupted run with the move 4 -> 2 -> 4 there).
- examples/train_lm.py, the plain torchrelay loop, on 4 ranks: stopped late and resumed with other workers,
  bit for bit.
- DeepSpeedCPUAdam in a plain loop (no engine): saved and loaded by torchrelay, it steps on bit for bit.

DeepSpeedCPUAdam's C++ op is compiled by DeepSpeed on first use (scripts/env.sh builds it once, before the tests);
without a C++ compiler the tests that need it skip, saying so.
"""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import (
    assert_same_final_state,
    assert_same_logs,
    launch,
    segments,
)
from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory
from torchrelay.checkpoint.state import load_state, save_state
from torchrelay.ledger.exposure import prove
from torchrelay.policy.stop import write_request

WORLD = 4


def cpu_adam_or_skip() -> Any:
    """DeepSpeedCPUAdam, its op loaded (built by DeepSpeed if not cached), or a skip naming what is missing."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("DeepSpeedCPUAdam needs its C++ op built and no C++ compiler (g++) is on PATH")
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)
    return DeepSpeedCPUAdam


# --- DeepSpeedCPUAdam in a plain loop, in process -----------------------------------------------------------------


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.full  # loads (on a fresh machine: builds) DeepSpeed's C++ op: 90 s in the fast tier on a busy host
def test_cpu_adam_tracked_in_a_plain_loop_steps_on_bit_exact(tmp_path: Path) -> None:
    """Before the fix only the ZeRO engine's CPU Adam was replayed: a plain loop's DeepSpeedCPUAdam, loaded by
    torchrelay into a fresh process's optimizer, took its first step with pow-computed beta powers and parted from
    the uninterrupted run in the last bits."""
    cpu_adam = cpu_adam_or_skip()

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        groups = [{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 1e-1}]
        return net, cpu_adam(groups, lr=1e-2, weight_decay=0.01, adamw_mode=True)

    whole, whole_opt = make()
    _steps(whole, whole_opt, 1, 20)
    saved, saved_opt = make()
    _steps(saved, saved_opt, 1, 5)
    save_state(tmp_path, rank=0, model=saved, optimizer=saved_opt, statefuls={}, loop={"update": 5})
    write_inventory(tmp_path, inventory_entries(tmp_path, list_files(tmp_path)))
    fresh, fresh_opt = make()
    load_state(tmp_path, rank=0, model=fresh, optimizer=fresh_opt, statefuls={})
    _steps(fresh, fresh_opt, 6, 20)
    differ = [
        n
        for (n, a), b in zip(whole.named_parameters(), fresh.parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert not differ, f"parted after the resume: {differ}"


# --- four ranks under torchrun ------------------------------------------------------------------------------------


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _seconds(started: tuple[float, float], what: str) -> None:
    """The launches' cost, shown by pytest -s: CPU seconds (what an idle machine's cores must give) and wall."""
    wall, cpu = time.monotonic() - started[0], _cpu() - started[1]
    print(f"{what}: {cpu:.0f} s CPU, {wall:.0f} s wall")


@pytest.mark.launch
def test_plain_loop_on_4_ranks_stopped_late_and_resumed_with_a_worker_is_bit_exact(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """examples/train_lm.py on 4 ranks (16 updates, checkpoints every 8): a request stops it after update 14 and
    it finishes with 1 loader worker per rank instead of none, equal to the uninterrupted 4-rank run."""
    code, config = example["code"], example["config"]
    whole, run = tmp_path / "whole", tmp_path / "run"
    started = time.monotonic(), _cpu()
    out = launch(code, whole, nproc=WORLD, config=config)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _seconds(started, "plain loop, 4 ranks, uninterrupted")
    run.mkdir()
    write_request(run, at_update=14)
    out = launch(code, run, nproc=WORLD, config=config)
    assert segments(run)[-1]["ended"] == "request", out.stdout[-3000:] + out.stderr[-3000:]
    assert segments(run)[-1]["last_update"] == 14
    out = launch(code, run, nproc=WORLD, sets={"num_workers": 1})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _seconds(started, "plain loop, 4 ranks, all three launches")
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["request", "finished"] and segs[-1]["resumed_from"] == 14
    assert segs[-1]["world_size"] == WORLD and segs[-1]["runtime_changes"] == {"num_workers": [0, 1]}
    assert assert_same_final_state(whole, run, 16) > 5
    assert_same_logs(whole, run, ranks=WORLD)
    ledger = prove(run)
    assert ledger.ok and ledger.exposures == prove(whole).exposures and ledger.repeats == prove(whole).repeats
