"""nanoGPT's training loop on torchrelay: random windows of a token file (train.bin, uint16), resumable bit for bit.

    python examples/train_tokens.py --make-data data/tok      # train.bin (Python's stdlib as byte tokens) + manifest
    torchrun --nproc_per_node=2 examples/train_tokens.py --run-dir runs/tok --data data/tok
    torchrun --nproc_per_node=2 examples/train_tokens.py --run-dir runs/tok              # continues it

nanoGPT's get_batch draws `batch_size` offsets per call from the rank's RNG; here `tr.TokenWindows` gives each
sample its window from the run's seed and the sample's place in the data stream (with replacement, as get_batch,
or without), so any worker count, world size or resume reads the same windows, and the ledger proves them.
What changed against nanoGPT's train.py (docs/TOKENS.md): get_batch became a dataset over `run.manifest`, the
loop runs `for step in run.steps(loader)`, the checkpointing and the resume branch became `run.track`, the
evaluation draws from a generator of its own, and a new best validation loss calls `step.save_now`.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchrelay as tr
from torchrelay.config.relay import parse_assignments


class GPT(nn.Module):
    """A small causal transformer (nanoGPT's model.py in spirit, torch's layers in fact)."""

    def __init__(self, vocab: int, block_size: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, 0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(block_size), persistent=False
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_data(out: Path, max_tokens: int = 200_000) -> Path:
    """train.bin: bytes of Python's standard library as uint16 tokens (vocab 256), and its window manifest."""
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40])[:max_tokens]
    np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(out / "train.bin")
    return tr.token_manifest([out / "train.bin"], out / "train.jsonl", block_size=64)


@torch.no_grad()
def estimate_loss(model: nn.Module, data: np.ndarray, block: int, seed: int, update: int) -> float:
    """nanoGPT's estimate_loss, drawing its windows from a generator of its own: the training's stream is untouched."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + update)
    starts = torch.randint(len(data) - block - 1, (8,), generator=gen).tolist()
    chunk = torch.stack([torch.from_numpy(data[s : s + block + 1].astype(np.int64)) for s in starts])
    model.eval()
    loss = float(model(chunk[:, :-1], chunk[:, 1:]))
    model.train()
    return loss


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument(
        "--data", type=Path, default=None, help="the folder --make-data wrote (to create a run)"
    )
    parser.add_argument(
        "--make-data", type=Path, default=None, metavar="DIR", help="write train.bin and stop"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args()
    if args.make_data is not None:
        print(f"wrote {make_data(args.make_data)}")
        return 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = None
    if args.data is not None:
        data = args.data.resolve()
        cfg = tr.RelayConfig(
            seed=1337,
            micro_batch=4,  # nanoGPT's batch_size
            grad_accum=2,  # per rank: nanoGPT's gradient_accumulation_steps / world size
            total_updates=40,  # max_iters
            warmup_updates=4,
            manifest=str(data / "train.jsonl"),
            data_root=str(data),
            save_every=10,
            params={
                "block_size": 64,
                "replacement": True,
                "n_layer": 2,
                "n_head": 2,
                "n_embd": 64,
                "learning_rate": 1e-3,
                "min_lr": 1e-4,
                "grad_clip": 1.0,
                "eval_interval": 5,
            },  # fmt: skip
        )
    try:
        with tr.Run.open(args.run_dir, cfg, overrides=parse_assignments(args.set)) as run:
            c, p = run.config, run.config.params
            torch.manual_seed(c.seed)
            model = nn.parallel.DistributedDataParallel(
                GPT(256, p["block_size"], p["n_embd"], p["n_layer"], p["n_head"])
            )
            opt = torch.optim.AdamW(model.parameters(), lr=p["learning_rate"], betas=(0.9, 0.95))
            floor = p["min_lr"] / p["learning_rate"]
            shape = tr.warmup_cosine(c.total_updates, c.warmup_updates)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: floor + (1 - floor) * shape(u))
            best = {"val_loss": 1e9}  # (no infinity: a stateful is stored as JSON)
            run.track(model=model, optimizer=opt, scheduler=sched, best=Best(best))
            windows = tr.TokenWindows(
                run.manifest.records, block_size=p["block_size"], replacement=p["replacement"]
            )
            train_bin = np.memmap(run.manifest.records[0]["path"], dtype=np.uint16, mode="r")
            for step in run.steps(run.dataloader(windows)):
                total, starts = 0.0, 0
                for _micro, (x, y, offsets) in step.micro_batches(model):
                    loss = model(x, y) / c.grad_accum
                    loss.backward()
                    total += loss.item()
                    starts += int(offsets.sum())
                torch.nn.utils.clip_grad_norm_(model.parameters(), p["grad_clip"])
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step.log(loss=total, lr=lr, window_sum=starts)
                if step.update % p["eval_interval"] == 0:
                    val = estimate_loss(model.module, train_bin, p["block_size"], c.seed, step.update)
                    step.log(val_loss=val)
                    step.save_now(val < best["val_loss"], reason=f"best val_loss {val:.4f}")
                    best["val_loss"] = min(best["val_loss"], val)
        return run.exit_code
    finally:
        dist.destroy_process_group()


class Best:
    """The best validation loss so far, resumable (a resume compares with the best before the stop)."""

    def __init__(self, d: dict[str, float]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, float]:
        return dict(self.d)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.d.update(state)


if __name__ == "__main__":
    sys.exit(main())
