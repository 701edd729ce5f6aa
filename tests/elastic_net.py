"""A tiny CNN for the layout tests (test_elastic.py), launched under torchrun (gloo): a convolution with a bias, an
optional BatchNorm after it (whose input bias then has a zero true gradient), an optional Dropout, AdamW, clipping.

    torchrun --nproc_per_node=2 elastic_net.py --run-dir RUN [--set params.norm=bn] [--set elastic=exact]

params: norm (bn | group | none), dropout (p), parallel (ddp | fsdp2 | none), dtype; runtime params (not in the
contract, so a test can change them at a move to make a real change): lr_scale (the learning rate times this from
the segment that sets it on) and skip_update (in that update, rank 0 drops the first sample of its first micro-batch).
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
from torchrelay.config.relay import parse_assignments

HERE = Path(__file__).resolve().parent


class Images(torch.utils.data.Dataset):
    """Sample i: a 3x6x6 image shifted by its class, made from i alone."""

    def __init__(self, labels: list[int]) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(10_000 + i)
        return torch.randn(3, 6, 6, generator=gen) + self.labels[i], torch.tensor(self.labels[i])


def build(p: dict, dtype: torch.dtype) -> nn.Module:
    norm = {"bn": nn.BatchNorm2d(8), "group": nn.GroupNorm(2, 8), "none": nn.Identity()}[p["norm"]]
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        norm,
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Dropout(p["dropout"]),
        nn.Linear(16, 4),
    ).to(dtype)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = tr.RelayConfig(
        seed=7,
        micro_batch=4,
        grad_accum=2,
        total_updates=8,
        manifest=str(HERE / "samples.jsonl"),  # examples/zoo/samples.jsonl: 64 labels
        save_every=4,
        params={
            "norm": "bn",
            "dropout": 0.0,
            "parallel": "ddp",
            "dtype": "float32",
            "lr": 3e-3,
            "lr_scale": 1.0,
            "skip_update": 0,
        },
        runtime_params=["lr_scale", "skip_update"],
    )
    try:
        with tr.Run.open(args.run_dir, cfg, overrides=parse_assignments(args.set)) as run:
            cfg, p = run.config, run.config.params
            dtype = getattr(torch, p["dtype"])
            torch.manual_seed(cfg.seed)
            net = build(p, dtype)
            if p["parallel"] == "ddp":
                model: nn.Module = nn.parallel.DistributedDataParallel(net)
            elif p["parallel"] == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                model = fully_shard(net)
            else:
                model = net
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=0.01)
            run.track(model=model, optimizer=opt)
            for group in opt.param_groups:
                group["lr"] = p["lr"] * p["lr_scale"]  # a runtime knob: a real change when a move sets it
            labels = [int(r["label"]) for r in run.manifest.records]
            for step in run.steps(run.dataloader(Images(labels))):
                for micro, (image, label) in step.micro_batches(model):
                    image, label = image.to(dtype), label
                    if step.update == p["skip_update"] and micro == 0 and run.rank == 0:
                        image, label = image[1:], label[1:]  # one sample left out: a real change
                    loss = F.cross_entropy(model(image), label) / cfg.grad_accum
                    loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
                step.log(loss=float(loss), grad_norm=float(norm))
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
