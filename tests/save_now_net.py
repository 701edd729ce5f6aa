"""A tiny classifier that saves on a new best validation loss (step.save_now), under torchrun (gloo), for
test_save_now.py: every `eval_every` updates every rank evaluates a held-out batch (drawn from no training RNG,
averaged over the ranks) and asks to save when it improved.

    torchrun --nproc_per_node=2 save_now_net.py --run-dir RUN
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchrelay as tr

HERE = Path(__file__).resolve().parent


class Points(torch.utils.data.Dataset):
    """Sample i: 6 features made from i alone, and its label."""

    def __init__(self, labels: list[int]) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(5_000 + i)
        return torch.randn(6, generator=gen) + self.labels[i], torch.tensor(self.labels[i])


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)  # its own generator: an eval never draws from the training's
    labels = torch.randint(0, 4, (32,), generator=gen)
    return torch.randn(32, 6, generator=gen) + labels[:, None], labels


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = tr.RelayConfig(
        seed=3,
        micro_batch=4,
        grad_accum=2,
        total_updates=12,
        manifest=str(HERE / "samples.jsonl"),  # examples/zoo/samples.jsonl: 64 labels
        save_every=3,
        keep=2,
        params={"lr": 0.05, "eval_every": 2},
    )
    try:
        with tr.Run.open(args.run_dir, cfg) as run:
            p = run.config.params
            torch.manual_seed(run.config.seed)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
            )
            opt = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=0.9)
            best = {"val_loss": float("inf")}  # resumable: a resume compares with the best before the stop
            run.track(model=model, optimizer=opt, best=tr_state(best))
            labels = [int(r["label"]) for r in run.manifest.records]
            xs, ys = held_out()
            for step in run.steps(run.dataloader(Points(labels))):
                for _micro, (x, y) in step.micro_batches(model):
                    (F.cross_entropy(model(x), y) / run.config.grad_accum).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step.update % p["eval_every"] == 0:
                    with torch.no_grad():
                        val = F.cross_entropy(model.module(xs), ys)
                    dist.all_reduce(val)
                    val = float(val) / dist.get_world_size()
                    better = val < best["val_loss"]
                    if better:
                        best["val_loss"] = val
                    step.save_now(better, reason=f"best val_loss {val:.4f}")
                    step.log(val_loss=val)
        return run.exit_code
    finally:
        dist.destroy_process_group()


class tr_state:  # noqa: N801 - reads as what it wraps
    """A dict as a torch Stateful (state_dict / load_state_dict)."""

    def __init__(self, d: dict[str, float]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, float]:
        return dict(self.d)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.d.update(state)


if __name__ == "__main__":
    sys.exit(main())
