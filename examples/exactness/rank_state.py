"""State that differs by rank, resumed bit for bit: BatchNorm statistics and per-rank random generators.

A small causal convolutional byte LM with BatchNorm and Dropout, gradient accumulation, and an augmentation
drawn from three generators that each rank seeds differently (torch.Generator, numpy Generator, random.Random),
all registered with `run.track` as they are. At an update boundary each rank's BatchNorm running statistics
differ (each normalised its own micro-batches); torchrelay stores what differs by rank once per rank.

    torchrun --nproc_per_node=2 examples/exactness/rank_state.py --run-dir runs/rs --config examples/lm.yaml \
        --set params.parallel=ddp          # or fsdp2 (fully_shard), syncbn (SyncBatchNorm under DDP), none

`none` trains a plain module on every rank and all-reduces the gradients by hand (no wrapper at all).
SyncBatchNorm needs GPUs: add `--set params.device=cuda` on every launch (NCCL, deterministic kernels).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchrelay as tr
from torchrelay.config.relay import parse_assignments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the reference example's data and config
from train_lm import SourceBytes, collate, load_config  # noqa: E402

PARALLEL = ("ddp", "fsdp2", "syncbn", "none")


class ConvLM(nn.Module):
    """Two causal convolutions with BatchNorm, Dropout and a residual; predicts the next byte."""

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.conv1 = nn.Conv1d(d_model, d_model, 3)
        self.bn1 = nn.BatchNorm1d(d_model)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv1d(d_model, d_model, 3)
        self.bn2 = nn.BatchNorm1d(d_model)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x).transpose(1, 2)
        h = self.drop(F.relu(self.bn1(self.conv1(F.pad(h, (2, 0))))))
        h = h + F.relu(self.bn2(self.conv2(F.pad(h, (2, 0)))))
        return self.head(h.transpose(1, 2))


def wrap(model: nn.Module, parallel: str) -> nn.Module:
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    if parallel == "syncbn":
        return nn.parallel.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model))
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model  # "none": the gradients are all-reduced by hand below


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = any(item == "params.device=cuda" for item in args.set)  # SyncBatchNorm runs on GPUs only
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    try:
        with tr.Run.open(
            args.run_dir, load_config(args.config), overrides=parse_assignments(args.set)
        ) as run:
            cfg, p = run.config, run.config.params
            parallel = p.get("parallel", "ddp")
            if parallel not in PARALLEL:
                raise SystemExit(f"params.parallel={parallel!r}: choose one of {PARALLEL}")
            torch.manual_seed(cfg.seed)
            model = wrap(ConvLM(p["d_model"], p["dropout"]).to(device), parallel)
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, tr.warmup_cosine(cfg.total_updates, cfg.warmup_updates)
            )
            # Each rank augments its own samples with its own streams: per-rank state, as such scripts hold it.
            noise = torch.Generator().manual_seed(cfg.seed + 1000 * rank)
            picks = np.random.default_rng(cfg.seed + 1000 * rank)
            mask = random.Random(cfg.seed + 1000 * rank)
            run.track(model=model, optimizer=opt, scheduler=sched, noise=noise, picks=picks, mask=mask)

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            pace = float(p.get("min_update_s", 0))
            for step in run.steps(loader):
                started = time.perf_counter()
                total = 0.0
                # Gradients sync in the last micro-batch only (DDP's no_sync, FSDP2's deferral); so DDP broadcasts
                # rank 0's BatchNorm statistics at some forwards and not at others.
                for _micro, (xs, lengths) in step.micro_batches(model if parallel != "none" else None):
                    inputs, targets = xs[:, :-1].clone(), xs[:, 1:]
                    rate = 0.05 + 0.1 * mask.random()
                    flip = torch.rand(inputs.shape, generator=noise) < rate
                    inputs[flip] = int(picks.integers(0, 256))
                    valid = torch.arange(targets.shape[1])[None, :] < (lengths[:, None] - 1)
                    inputs, targets, valid = inputs.to(device), targets.to(device), valid.to(device)
                    loss = F.cross_entropy(model(inputs)[valid], targets[valid]) / cfg.grad_accum
                    loss.backward()
                    total += loss.item()
                if parallel == "none":
                    for param in model.parameters():
                        dist.all_reduce(param.grad)
                        param.grad /= dist.get_world_size()
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step.log(loss=total, lr=lr)
                if pace > 0:  # a slower update, never a different one
                    time.sleep(max(0.0, pace - (time.perf_counter() - started)))
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
