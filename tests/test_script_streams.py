"""Python's `random` and numpy's global generator: seeded per rank from the run's seed when a launch opens, so a
script's draws from them are the same in every uninterrupted run, and restored at a resume."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from torchrelay import RelayConfig, Run
from torchrelay.policy.stop import write_request


def _draws(example: dict[str, Path], run_dir: Path, *, seed: int = 3) -> list[tuple[float, float]]:
    """Train until the run stops, drawing from the global `random` and numpy generators in every update."""
    cfg = RelayConfig(
        seed=seed,
        micro_batch=2,
        total_updates=4,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=1,
    )
    random.seed()  # what a fresh process holds: the OS's entropy
    np.random.seed(None)
    out = []
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            noise = random.random()  # an augmentation's coin flip, a dropout rate jittered by hand
            out.append((noise, float(np.random.rand())))
            for _ in step.micro_batches():
                (model(torch.ones(1, 4)) * noise).sum().backward()
            opt.step()
            opt.zero_grad()
    return out


def test_two_uninterrupted_runs_draw_the_same_from_random_and_numpy(example, tmp_path):
    first = _draws(example, tmp_path / "a")
    assert len(first) == 4 and len(set(first)) == 4
    assert _draws(example, tmp_path / "b") == first
    assert _draws(example, tmp_path / "other", seed=4) != first  # the run's seed decides them
    # A resume restores the streams where the stop left them, so the relayed run draws what the uninterrupted did.
    (tmp_path / "c").mkdir()
    write_request(tmp_path / "c", at_update=2)
    assert _draws(example, tmp_path / "c") == first[:2]
    assert _draws(example, tmp_path / "c") == first[2:]
