"""Hugging Face Trainer on DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam), G3A1-shaped.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=4 examples/train_hf_trainer_offload.py --output-dir runs/offload

A tiny Qwen3 (built from a config, no download) with a rank-2 adapter on its query projections trained at 10x the
base learning rate, gradient accumulation 2, warmup then cosine down to 0.1x, ZeRO-2 with `offload_optimizer: cpu`:
the shape of the G3A1 run (docs/DEEPSPEED.md). The optimizer the engine steps is DeepSpeed's CPU Adam over the two
learning rates' param groups; its C++ op is compiled once by DeepSpeed (`CPUAdamBuilder().load()`, cached in
~/.cache/torch_extensions). Launch the same command again
and it continues bit for bit (`--workers` and `--save-steps` may change). With `--reshard` (RelayOptions(reshard=True)),
TORCHRELAY_RESHARD=1 or `torchrelay launch --reshard` it continues on another number of ranks with the same global batch: gradient accumulation is
derived from the run and the ZeRO partitions resharded (docs/ELASTIC.md).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback, TrainingArguments

from torchrelay.integrations.transformers import RelayOptions, RelayTrainer

VOCAB, SEQ, ADAPTER_LR = 64, 16, 10.0  # the adapter's learning rate, as a multiple of the base one


class Tokens(torch.utils.data.Dataset):  # any map-style dataset: len() and dataset[i]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Adapted(torch.nn.Module):
    """A frozen-shape projection plus a low-rank adapter (up starts at zero: the model starts as the base)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.adapter_down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.adapter_up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.zeros_(self.adapter_up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter_up(self.adapter_down(x))


class OffloadTrainer(RelayTrainer):
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW with two param groups, the base at the learning rate and the adapter at 10x. Under ZeRO-Offload
        accelerate replaces it by DeepSpeedCPUAdam over the same groups (adamw_mode because it is an AdamW; a
        DeepSpeedCPUAdam built here would be rebuilt with adamw_mode=False)."""
        if self.optimizer is None:
            named = [(n, p) for n, p in (model or self.model).named_parameters() if p.requires_grad]
            lr = self.args.learning_rate
            self.optimizer = torch.optim.AdamW(
                [
                    {"params": [p for n, p in named if "adapter_" not in n], "lr": lr},
                    {"params": [p for n, p in named if "adapter_" in n], "lr": ADAPTER_LR * lr},
                ],
                lr=lr,
                weight_decay=self.args.weight_decay,
            )
        return self.optimizer


def main(callbacks: tuple[TrainerCallback, ...] = ()) -> int:
    cli = argparse.ArgumentParser()
    cli.add_argument("--output-dir", required=True)  # the run directory
    cli.add_argument("--lr", type=float, default=1e-3)
    cli.add_argument("--updates", type=int, default=6)
    cli.add_argument("--workers", type=int, default=0)  # runtime-only
    cli.add_argument("--save-steps", type=int, default=3)  # runtime-only
    cli.add_argument("--offload", choices=("cpu", "none"), default="cpu")  # none: the engine's own Adam
    cli.add_argument("--reshard", action="store_true")  # this launch may move the run to this number of ranks
    opt = cli.parse_args()
    args = TrainingArguments(
        output_dir=opt.output_dir,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=opt.updates,
        learning_rate=opt.lr,
        warmup_steps=2,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},  # cosine down to 0.1x
        weight_decay=0.01,
        save_steps=opt.save_steps,
        logging_steps=1,
        dataloader_num_workers=opt.workers,
        report_to="none",
        disable_tqdm=True,
        seed=429,
        deepspeed={
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": opt.offload}},
        },
    )
    try:
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,  # Qwen3 needs it: its default (128) is not hidden_size / heads
                max_position_embeddings=SEQ,
            )
        )
        for layer in model.model.layers:
            layer.self_attn.q_proj = Adapted(layer.self_attn.q_proj)
        trainer = OffloadTrainer(
            model=model,
            args=args,
            train_dataset=Tokens(),
            callbacks=list(callbacks),
            relay=RelayOptions(reshard=opt.reshard or None),  # None: TORCHRELAY_RESHARD decides
        )
        trainer.train()  # the engine's checkpoint (each rank's offloaded partition) goes into checkpoint-N/deepspeed/
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another still communicates
        return trainer.relay.exit_code  # 0 finished, 3 budget, 4 request, 5 signal
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
