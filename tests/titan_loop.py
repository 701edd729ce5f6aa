"""torchtitan 0.3's Trainer, by hand, on the CPU: its construction order and its `train` loop, line for line, around
a tiny language model (torchtitan's Trainer itself needs CUDA and triton). The pieces are torchtitan's own: its
configs, `OptimizersContainer`, `LRSchedulersContainer`, `DataloaderExhaustedError`, and the manager and loader
configs `build` with the keyword arguments the Trainer passes. Run under torchrun (gloo):

    torchrun --nproc_per_node=2 titan_loop.py --dump DIR --data DIR
Writes DIR/rng-rank<r>.pt: torch.rand(4) drawn after training (the RNG a resume restored).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config.configs import DebugConfig, TrainingConfig

from torchrelay.integrations.torchtitan import RelayCheckpointManager, RelayTokenLoader

SEQ = 16


@dataclass
class Config:  # the sections of torchtitan's Trainer.Config this loop reads
    training: TrainingConfig
    debug: DebugConfig
    checkpoint: RelayCheckpointManager.Config
    dataloader: RelayTokenLoader.Config
    optimizer: OptimizersContainer.Config = field(
        default_factory=lambda: OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[
                ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
            ],
        )
    )
    lr_scheduler: LRSchedulersContainer.Config = field(
        default_factory=lambda: LRSchedulersContainer.Config(warmup_steps=2)
    )
    dump_folder: str = "outputs"


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.drop = nn.Dropout(0.2)  # draws from the rank's RNG every micro-batch
        self.out = nn.Linear(32, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.emb(tokens)))


class Trainer:
    """torchtitan's Trainer.__init__ and train(), the parts that touch checkpointing and data, in its order."""

    def __init__(self, config: Config) -> None:
        self.config = config
        dist.init_process_group("gloo")
        torch.manual_seed(config.debug.seed or 0)  # dist_utils.set_determinism
        model = TinyLM()
        self.model_parts = [nn.parallel.DistributedDataParallel(model)]
        self.optimizers = config.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        world = dist.get_world_size()
        global_batch = config.training.global_batch_size
        self.gradient_accumulation_steps = global_batch // (config.training.local_batch_size * world)
        self.step = 0
        self.ntokens_seen = 0
        self.dataloader = config.dataloader.build(
            dp_world_size=world,
            dp_rank=dist.get_rank(),
            tokenizer=None,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
            snapshot_every_n_steps=config.checkpoint.interval * self.gradient_accumulation_steps,
        )
        self.checkpointer = config.checkpoint.build(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            sd_adapter=None,
            base_folder=config.dump_folder,
        )

    def batch_generator(self, data_iterable: Any) -> Any:
        data_iterator = iter(data_iterable)
        while True:
            try:
                batch = next(data_iterator)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            input_dict, labels = batch
            self.ntokens_seen += labels.numel()
            yield input_dict, labels

    def train_step(self, data_iterator: Any) -> None:
        self.optimizers.zero_grad()
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        for input_dict, labels in microbatches:
            logits = self.model_parts[0](input_dict["input"])
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            (loss / self.gradient_accumulation_steps).backward()
        torch.nn.utils.clip_grad_norm_(self.model_parts[0].parameters(), self.config.training.max_norm)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        time.sleep(float(_PACE))

    def train(self) -> None:
        self.checkpointer.load(step=self.config.checkpoint.load_step)
        data_iterator = self.batch_generator(self.dataloader)
        while self.step < self.config.training.steps:
            self.step += 1
            try:
                self.train_step(data_iterator)
            except DataloaderExhaustedError:
                break
            self.checkpointer.save(self.step, last_step=(self.step == self.config.training.steps))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]

    def close(self) -> None:
        self.checkpointer.close()


_PACE = "0"


def main() -> int:
    global _PACE
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pace", default="0")
    args = p.parse_args()
    _PACE = args.pace
    manifest = Path(args.data) / "train.jsonl"
    config = Config(
        training=TrainingConfig(local_batch_size=2, global_batch_size=8, seq_len=SEQ, steps=args.steps),
        debug=DebugConfig(seed=1234),
        checkpoint=RelayCheckpointManager.Config(enable=True, interval=2, manifest=str(manifest)),
        dataloader=RelayTokenLoader.Config(replacement=True, num_workers=args.workers),
        dump_folder=args.dump,
    )
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    torch.save(
        {"rand": torch.rand(4), "step": trainer.step, "ntokens_seen": trainer.ntokens_seen},
        Path(args.dump) / f"rng-rank{dist.get_rank()}.pt",
    )
    code = trainer.checkpointer.exit_code
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
