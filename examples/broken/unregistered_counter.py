"""BROKEN on purpose: a loss ramp driven by a counter that torchrelay does not know.

The script counts its own updates in a Python variable and scales the loss by `min(1, count / 8)` (a hand-made
warm-up). The counter starts at 0 in every launch, so after a resume the loss is scaled as at the start of the
run. Nothing random differs: `torchrelay audit` finds every random stream in the same state at the resume and
names the cause: state not registered with torchrelay.
Fix: derive it from `step.update`, or `run.track(..., ramp=obj)` with any object that has
state_dict/load_state_dict.

    torchrelay audit --updates 8 --stops 1 -- torchrun --nproc_per_node=2 examples/broken/unregistered_counter.py --config examples/lm.yaml
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
            count = 0  # BUG: not registered with run.track, so a resume starts it at 0 again

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            for step in run.steps(loader):
                count += 1  # noqa: SIM113 - a counter of its own is the bug shown here
                ramp = min(1.0, count / 8)
                total = 0.0
                for _micro, (xs, lengths) in step.micro_batches():
                    loss = ramp * lm_loss(model, xs, lengths) / cfg.grad_accum
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
