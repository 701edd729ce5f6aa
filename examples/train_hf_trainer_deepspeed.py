"""Hugging Face Trainer on DeepSpeed ZeRO-2 (Trainer(deepspeed=...)) as a torchrelay run (README: with DeepSpeed).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/train_hf_trainer_deepspeed.py --output-dir runs/hf-ds

The output directory is the run directory; launch the same command again and it continues bit for bit from the
newest complete checkpoint (`--workers` may change between launches; `--lr`, `--grad-accum` and `--zero-stage` may
not: refused, naming e.g. params.training_args.deepspeed.zero_optimization.stage). On GPUs drop DS_ACCELERATOR and
use_cpu.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from torchrelay.integrations.transformers import RelayTrainer


class Tokens(torch.utils.data.Dataset):  # any map-style dataset: len() and dataset[i]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main(callbacks: tuple[TrainerCallback, ...] = ()) -> int:
    cli = argparse.ArgumentParser()
    cli.add_argument("--output-dir", required=True)  # the run directory
    cli.add_argument("--lr", type=float, default=1e-3)
    cli.add_argument("--grad-accum", type=int, default=2)
    cli.add_argument("--zero-stage", type=int, default=2)
    cli.add_argument("--workers", type=int, default=0)  # runtime-only
    opt = cli.parse_args()
    args = TrainingArguments(
        output_dir=opt.output_dir,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=opt.grad_accum,
        max_steps=12,
        learning_rate=opt.lr,
        warmup_steps=2,
        weight_decay=0.01,
        save_steps=4,
        logging_steps=1,
        dataloader_num_workers=opt.workers,
        report_to="none",
        disable_tqdm=True,
        seed=1234,
        # Trainer fills in the "auto" values from the arguments above; the whole dict is part of the contract
        deepspeed={
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": opt.zero_stage},
        },
    )
    try:
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
        # opens the run (or validates and resumes it); callbacks: the tests pace updates with one
        trainer = RelayTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
        trainer.train()  # the engine's checkpoint goes into torchrelay's checkpoint-N/deepspeed/
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another still communicates
        return trainer.relay.exit_code  # 0 finished, 3 budget, 4 request, 5 signal
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
