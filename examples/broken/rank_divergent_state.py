"""BROKEN on purpose: a statistic that differs by rank, saved as one value for all ranks.

Each rank keeps a running mean of its own loss and divides its loss by it (a hand-made loss normalizer). The
ranks see different samples, so their means differ. The object's `state_dict()` averages the mean over the
ranks before saving ("the checkpoint should hold the global statistic"), so every rank resumes with the same
value, which none of them held: the resumed run differs from the first update after the resume. This is the
class of bug BatchNorm statistics under DDP had before torchrelay stored what differs by rank once per rank.
`torchrelay audit` names it: state that differs by rank restored from one copy.
Fix: return this rank's own `mean` from `state_dict()`; torchrelay stores a stateful that differs between ranks
once per rank and gives each rank its own back.

    torchrelay audit --updates 8 --stops 1 -- torchrun --nproc_per_node=2 examples/broken/rank_divergent_state.py --config examples/lm.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import torchrelay as tr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the good example's model and data
from train_lm import ByteLM, SourceBytes, collate, lm_loss, load_config  # noqa: E402


class LossNormalizer:
    """A running mean of this rank's loss; the loss is divided by it."""

    def __init__(self) -> None:
        self.mean = torch.ones(())

    def update(self, loss: torch.Tensor) -> None:
        self.mean = 0.9 * self.mean + 0.1 * loss.detach()

    def state_dict(self) -> dict[str, Any]:
        # BUG: one value for all ranks (their mean); each rank needs its own back.
        mean = self.mean.clone()
        dist.all_reduce(mean)
        return {"mean": mean / dist.get_world_size()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = state["mean"].clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        with tr.Run.open(args.run_dir, load_config(args.config)) as run:
            cfg, p = run.config, run.config.params
            torch.manual_seed(cfg.seed)
            model = nn.parallel.DistributedDataParallel(
                ByteLM(p["d_model"], p["layers"], p["heads"], p["seq_len"], p["dropout"])
            )
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, tr.warmup_cosine(cfg.total_updates, cfg.warmup_updates)
            )
            norm = LossNormalizer()
            run.track(model=model, optimizer=opt, scheduler=sched, norm=norm)

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            for step in run.steps(loader):
                total = 0.0
                for _micro, (xs, lengths) in step.micro_batches():
                    raw = lm_loss(model, xs, lengths)
                    loss = raw / norm.mean / cfg.grad_accum
                    loss.backward()
                    norm.update(raw)
                    total += loss.item()
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step.log(loss=total, lr=lr)
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
