"""BROKEN on purpose: a registered stateful whose load_state_dict forgets a number (nanoGPT's `best_val_loss`).

The script keeps the best loss seen so far in a small object registered with `run.track`. Its state_dict() returns
the number, so every checkpoint holds it; its load_state_dict() restores the count of evaluations but forgets the
number, so after a resume it is 1e9 again (nanoGPT's initial value) and the next "best" decision differs.
No tensor and no logged value differs: `torchrelay audit` compares every restored value, names
`state/best.best_val_loss` and the cause: state saved but not restored by its load_state_dict.
Fix: set every value state_dict() returns in load_state_dict().

    torchrelay audit --updates 6 --stop-at 4 -- torchrun --nproc_per_node=2 examples/broken/forgotten_value.py --config examples/lm.yaml
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


class BestLoss:
    """The best loss so far and how many were seen, as nanoGPT's train.py keeps them."""

    def __init__(self) -> None:
        self.best_val_loss, self.evals = 1e9, 0

    def state_dict(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_val_loss, "evals": self.evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evals = state["evals"]  # BUG: best_val_loss is not restored


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
            best = BestLoss()
            run.track(model=model, optimizer=opt, scheduler=sched, best=best)
            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            for step in run.steps(loader):
                total = 0.0
                for _micro, (xs, lengths) in step.micro_batches():
                    loss = lm_loss(model, xs, lengths) / cfg.grad_accum
                    loss.backward()
                    total += loss.item()
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if step.update % 2 == 0:  # nanoGPT evaluates every eval_interval updates
                    best.evals += 1
                    best.best_val_loss = min(best.best_val_loss, total)
                step.log(loss=total, lr=lr)
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
