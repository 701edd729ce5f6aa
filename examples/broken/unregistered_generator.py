"""BROKEN on purpose: a random augmentation drawn from a torch.Generator that torchrelay does not know.

The generator is seeded once at start-up, so every launch replays its stream from the beginning: after a
resume the augmentation differs from an uninterrupted run's. `torchrelay audit` names it: RNG not restored.
Fix: `run.track(..., augment=augment)` (torchrelay stores a torch.Generator's state per rank), or draw from the
global torch RNG, which torchrelay restores.

    torchrelay audit --updates 8 --stops 1 -- torchrun --nproc_per_node=2 examples/broken/unregistered_generator.py --config examples/lm.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import torchrelay as tr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the good example's model and data
from train_lm import ByteLM, SourceBytes, collate, lm_loss, load_config  # noqa: E402


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
            run.track(model=model, optimizer=opt, scheduler=sched)
            # BUG: this generator's state is not registered with run.track, so a resume restarts it.
            augment = torch.Generator().manual_seed(cfg.seed + dist.get_rank())

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            for step in run.steps(loader):
                total = 0.0
                for _micro, (xs, lengths) in step.micro_batches():
                    # Augmentation: replace 10% of the input bytes by a random byte.
                    noise = torch.randint(0, 256, xs.shape, generator=augment)
                    xs = torch.where(torch.rand(xs.shape, generator=augment) < 0.1, noise, xs)
                    loss = lm_loss(model, xs, lengths) / cfg.grad_accum
                    loss.backward()
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
