"""A plain loop around deepspeed.initialize (ZeRO-2 by default), resumable bit for bit with torchrelay.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/train_deepspeed.py --run-dir runs/ds \\
        --manifest data/manifest.jsonl --data-root data/root       # examples/prepare_data.py --out data
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/train_deepspeed.py --run-dir runs/ds \\
        --manifest data/manifest.jsonl --data-root data/root       # the same command continues it

The DeepSpeed configuration is part of the run's contract (params["deepspeed"]): a continuation with another
ZeRO stage, learning rate or batch size is refused naming the field. The engine saves its own checkpoint
(model, ZeRO optimizer partitions, LR scheduler, step counters) into each torchrelay checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchrelay as tr
from torchrelay.config.relay import parse_assignments


class TinyLM(nn.Module):
    """Predicts the next byte from the current one and a running context: small, but every part trains."""

    def __init__(self, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.mix = nn.Linear(d_model, d_model)
        # draws from the RNG, which torchrelay restores per rank (and re-derives at a move: docs/ELASTIC.md)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x).cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return self.head(self.drop(F.gelu(self.mix(h))))


class SourceBytes(torch.utils.data.Dataset):
    """Sample i = the bytes the manifest's line i names, padded to seq_len + 1."""

    def __init__(self, records: list[dict], seq_len: int) -> None:
        self.records, self.seq_len = records, seq_len

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> torch.Tensor:
        rec = self.records[i]
        with open(rec["path"], "rb") as f:
            f.seek(rec["offset"])
            data = f.read(min(rec["length"], self.seq_len + 1))
        x = torch.zeros(self.seq_len + 1, dtype=torch.long)
        x[: len(data)] = torch.tensor(list(data), dtype=torch.long)
        return x


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--data-root", default="")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--offload", action="store_true", help="ZeRO-Offload: the optimizer on the CPU (DeepSpeedCPUAdam)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="runtime override")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # on GPUs: "nccl"; DeepSpeed uses the group it finds
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
    }
    if args.offload:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg = tr.RelayConfig(
        seed=1234,
        micro_batch=4,  # = train_micro_batch_size_per_gpu
        grad_accum=2,  # = gradient_accumulation_steps
        total_updates=args.updates,
        warmup_updates=2,
        manifest=args.manifest,
        data_root=args.data_root,
        save_every=4,
        pins=[f"deepspeed=={deepspeed.__version__}"],  # continued only with the DeepSpeed that began it
        params={
            "lr": args.lr,
            "d_model": 32,
            "seq_len": 64,
            "dropout": args.dropout,
            "deepspeed": ds_config,
            "min_update_s": 0,
        },
        runtime_params=["min_update_s"],  # pacing for demos and stop tests: never changes a bit
    )
    try:
        with tr.Run.open(args.run_dir, cfg, overrides=parse_assignments(args.set)) as run:
            p = run.config.params
            torch.manual_seed(run.config.seed)
            model = TinyLM(p["d_model"], p.get("dropout", 0.1))
            offload = "offload_optimizer" in p["deepspeed"]["zero_optimization"]
            if offload:  # DeepSpeed's compiled CPU Adam, as ZeRO-Offload wants
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                opt = DeepSpeedCPUAdam(model.parameters(), lr=p["lr"], adamw_mode=True)
            else:
                opt = torch.optim.AdamW(
                    model.parameters(), lr=p["lr"]
                )  # torch's AdamW: no compiled op needed
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, tr.warmup_cosine(cfg.total_updates, cfg.warmup_updates)
            )
            # The accumulation is the layout's: after a move to another world size it is the run's derived one.
            ds = {**p["deepspeed"], "gradient_accumulation_steps": run.config.grad_accum}
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
            run.track(model=engine)  # restores model, ZeRO partitions, scheduler, counters when resuming

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]))
            for step in run.steps(loader):
                started = time.perf_counter()
                total = 0.0
                for _micro, xs in step.micro_batches(engine):
                    logits = engine(xs[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, 256), xs[:, 1:].reshape(-1))
                    engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps
                    engine.step()  # steps optimizer and scheduler on the update's last micro-batch only
                    total += loss.item() / run.config.grad_accum  # the layout's, after a move too
                step.log(loss=total, lr=sched.get_last_lr()[0])
                time.sleep(max(0.0, p["min_update_s"] - (time.perf_counter() - started)))
        return run.exit_code
    finally:
        dist.barrier()  # every rank gets here, also on a refusal (all ranks refuse together)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
