"""How tests/data/format1-checkpoint/ was made: torchrelay at main 9ed1f9c (state format 1, statefuls saved from
rank 0 only), 2 ranks, DDP over Linear + BatchNorm1d, AdamW, a StepLR and a stateful holding a tensor.

    PYTHONPATH=<torchrelay 9ed1f9c>/src python tests/data/format1-checkpoint.py OUT_DIR

tests/test_rank_state.py checks that today's code still resumes it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class Ema:
    def __init__(self) -> None:
        self.v = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v, "n": 2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.v = state["v"]


def child(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=2)
    from torchrelay.checkpoint.state import save_state

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    ema = Ema()
    ema.v = torch.arange(3.0) + 0.5
    (Path(out) / "rng").mkdir(parents=True, exist_ok=True)
    save_state(
        Path(out),
        rank=rank,
        model=model,
        optimizer=opt,
        statefuls={"scheduler": sched, "ema": ema},
        loop={"update": 2, "world_size": 2},
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(child, args=(sys.argv[1],), nprocs=2)
