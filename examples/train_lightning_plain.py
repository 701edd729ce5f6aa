"""A plain PyTorch Lightning script: examples/train_lightning.py without torchrelay (docs/LIGHTNING.md counts the
lines that differ). It does not resume exactly: stopped mid-epoch, its data order, its RNG and its step restart.

    torchrun --nproc_per_node=2 examples/train_lightning_plain.py
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


def main(callbacks: tuple[pl.Callback, ...] = ()) -> int:  # the tests pace updates with one
    cli = argparse.ArgumentParser()
    cli.add_argument("--lr", type=float, default=3e-3)
    cli.add_argument("--workers", type=int, default=0)
    opt = cli.parse_args()
    pl.seed_everything(1234)
    model = Regressor(opt.lr, total_updates=12)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=12,
        callbacks=list(callbacks),
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
    )
    data = torch.utils.data.DataLoader(Points(), batch_size=4, shuffle=True, num_workers=opt.workers)
    trainer.fit(model, train_dataloaders=data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
