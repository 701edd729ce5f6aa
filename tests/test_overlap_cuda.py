"""A save's copies behind the next forward and backward (SaveTuning.overlap_copy), where a GPU is: every checkpoint
holds the state of its update, bit for bit, though the next update's step would overwrite it mid-copy if it did not
wait; without the wait (the control) it does. Skipped without CUDA (the CPU VM); run on the GPU machine
(`PYTHONPATH=src:tests python -m pytest tests/test_overlap_cuda.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import host_stage
from torchrelay.checkpoint.reader import load_tensors
from torchrelay.config.tuning import SaveTuning

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

UPDATES = 6


def _train(example: dict[str, Path], run_dir: Path, tuning: SaveTuning) -> dict[int, dict[str, torch.Tensor]]:
    """A run saving after every update (all kept), 1.6 GB of Linear(4096) x 8 + AdamW on the GPU; the state after
    each update's step, on the host, by the names the reader gives."""
    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=UPDATES,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=1,
        keep_every=1,
        save_tuning=tuning,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {p: n for n, p in model.named_parameters()}
    want: dict[int, dict[str, torch.Tensor]] = {}
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, batch in step.micro_batches():
                x = torch.randn(64, 4096, device="cuda") + float(sum(batch))
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state: dict[str, torch.Tensor] = {
                f"model.{n}": p.detach().cpu() for n, p in model.named_parameters()
            }
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[f"optim.{names[p]}.{k}"] = v.cpu()
            want[step.update] = state
    return want


def _differing(run_dir: Path, want: dict[int, dict[str, torch.Tensor]]) -> list[str]:
    bad = []
    for update, state in want.items():
        got = load_tensors(run_dir / f"checkpoint-{update}")
        for name, value in state.items():
            if not torch.equal(got[name], value):
                bad.append(f"checkpoint-{update}: {name}")
    return bad


def test_every_checkpoint_holds_its_updates_state_while_the_copies_overlap_the_next_update(
    example: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    want = _train(example, run_dir, SaveTuning(overlap_copy=True))
    assert _differing(run_dir, want) == []


def test_the_control_without_the_steps_wait_catches_the_overwrite(
    example: dict[str, Path], tmp_path: Path, monkeypatch: Any
) -> None:
    """The same run with the step no longer waiting for the copies: some checkpoint holds a later step's values
    (so the test above would see a missing wait)."""
    monkeypatch.setattr(host_stage.Landed, "before_step", lambda self: None)
    run_dir = tmp_path / "run"
    want = _train(example, run_dir, SaveTuning(overlap_copy=True))
    assert _differing(run_dir, want) != []
