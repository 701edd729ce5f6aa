"""Train a LightningModule on 2 ranks (DDP) as a torchrelay run: stop it anywhere, continue it bit for bit.

    torchrun --nproc_per_node=2 examples/train_lightning.py --run-dir runs/lit
    torchrelay stop runs/lit                                   # a clean stop at the next update
    torchrun --nproc_per_node=2 examples/train_lightning.py --run-dir runs/lit --workers 2   # continues it

examples/train_lightning_plain.py is the same script without torchrelay (docs/LIGHTNING.md: the lines that differ).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchrelay as tr
from torchrelay.integrations.lightning import RelayLightning


class Points(torch.utils.data.Dataset):  # sample i is made from i, so the example runs anywhere
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, x.sin().sum(0, keepdim=True)


class Regressor(pl.LightningModule):
    def __init__(self, lr: float, total_updates: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.hparams.total_updates
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 0.5 * (1 + math.cos(math.pi * u / total)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def write_manifest(path: str, samples: int) -> str:  # line i is sample i: its id in the exposure ledger
    text = "".join(f'{{"id": "{i}"}}\n' for i in range(samples))
    part = f"{path}.{os.getpid()}"
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, path)  # the same bytes from every rank, whole or absent
    return path


def main(callbacks: tuple[pl.Callback, ...] = ()) -> int:  # the tests pace updates with one
    cli = argparse.ArgumentParser()
    cli.add_argument("--run-dir", required=True)
    cli.add_argument("--lr", type=float, default=3e-3)
    cli.add_argument("--workers", type=int, default=0)
    opt = cli.parse_args()
    pl.seed_everything(1234)
    model = Regressor(opt.lr, total_updates=12)
    config = tr.RelayConfig(
        seed=1234,
        micro_batch=4,
        grad_accum=2,
        total_updates=12,
        manifest=write_manifest(f"{opt.run_dir.rstrip('/')}.manifest.jsonl", len(Points())),
        num_workers=opt.workers,
        save_every=4,
    )
    relay = RelayLightning(opt.run_dir, config)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=[relay, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, train_dataloaders=relay.dataloader(Points()))
    return relay.exit_code  # 0 finished, 3 budget, 4 request, 5 signal


if __name__ == "__main__":
    sys.exit(main())
