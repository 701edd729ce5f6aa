"""Train a small Hugging Face transformers causal LM with torchrelay, then export it for `from_pretrained`.

The model is built from a config (random weights, nothing downloaded): a Llama decoder sized by the run's params,
plus a training-only `state_head` with an auxiliary loss, as G3A1's state head. The export drops that head and
strips the wrapper's `lm.` prefix, so the folder loads with `AutoModelForCausalLM.from_pretrained`:

    torchrun --nproc_per_node=2 examples/train_hf.py --run-dir runs/hf --config examples/lm.yaml --hf-out runs/hf-cfg
    torchrelay export runs/hf runs/hf-export --drop state_head --rename lm= --include runs/hf-cfg/config.json

With --hf-out, rank 0 writes the model's config.json there and, when the run finishes, probe.safetensors: the
trained model's logits on a fixed input, for comparing the exported model against.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from train_lm import SourceBytes, collate, load_config  # the example LM's data and config
from transformers import LlamaConfig, LlamaForCausalLM

import torchrelay as tr
from torchrelay.config.relay import parse_assignments


def hf_config(p: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=p["d_model"],
        intermediate_size=4 * p["d_model"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["heads"],
        max_position_embeddings=p["seq_len"],
        tie_word_embeddings=False,
    )


class WithStateHead(nn.Module):
    """The language model and a head used only in training (it predicts each target byte's low two bits)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)
        self.state_head = nn.Linear(config.hidden_size, 4)

    def forward(self, xs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        inputs, targets = xs[:, :-1], xs[:, 1:]
        valid = torch.arange(targets.shape[1])[None, :] < (lengths[:, None] - 1)
        out = self.lm(input_ids=inputs, output_hidden_states=True)
        lm_loss = F.cross_entropy(out.logits[valid], targets[valid])
        aux = F.cross_entropy(self.state_head(out.hidden_states[-1])[valid], targets[valid] % 4)
        return lm_loss + 0.1 * aux


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=None, help="YAML config; needed to create a run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--hf-out", type=Path, default=None, help="write config.json and probe.safetensors here"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        with tr.Run.open(
            args.run_dir, load_config(args.config), overrides=parse_assignments(args.set)
        ) as run:
            p, cfg = run.config.params, run.config
            torch.manual_seed(cfg.seed)
            config = hf_config(p)
            model = nn.parallel.DistributedDataParallel(WithStateHead(config))
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, tr.warmup_cosine(cfg.total_updates, cfg.warmup_updates)
            )
            run.track(model=model, optimizer=opt, scheduler=sched)
            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            for step in run.steps(loader):
                total = 0.0
                for _micro, (xs, lengths) in step.micro_batches():
                    loss = model(xs, lengths) / cfg.grad_accum
                    loss.backward()
                    total += loss.item()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step.log(loss=total, lr=sched.get_last_lr()[0])
        if args.hf_out is not None and dist.get_rank() == 0:
            args.hf_out.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(args.hf_out)
            if run.exit_code == 0:
                lm = model.module.lm.eval()
                probe = torch.arange(p["seq_len"], dtype=torch.long)[None, :] % 256
                with torch.no_grad():
                    logits = lm(input_ids=probe).logits
                save_file(
                    {"input_ids": probe, "logits": logits.contiguous()},
                    str(args.hf_out / "probe.safetensors"),
                )
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
