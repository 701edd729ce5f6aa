"""BROKEN on purpose: the batches come from the script's own shuffled DataLoader, not torchrelay's sampler.

torchrelay paces the updates, but the data is drawn from a DataLoader with shuffle=True that starts a new
permutation in every launch: after a resume the model sees other samples than an uninterrupted run would.
`torchrelay audit` names it: data order not restored. Fix: take the batches from `step.micro_batches()` of
`run.dataloader(dataset)`.

    torchrelay audit --updates 8 --stops 1 -- torchrun --nproc_per_node=2 examples/broken/own_shuffle.py --config examples/lm.yaml
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

            dataset = SourceBytes(run.manifest.records, p["seq_len"])
            # BUG: our own shuffled loader; a fresh launch starts its permutation over.
            own = torch.utils.data.DataLoader(
                dataset, batch_size=cfg.micro_batch, shuffle=True, collate_fn=collate
            )
            batches = iter(own)
            for step in run.steps(run.dataloader(dataset, collate_fn=collate)):
                total = 0.0
                for _micro, _ignored in step.micro_batches():
                    xs, lengths = next(batches)
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
