"""Train a tiny byte-level transformer LM on Python source, resumable bit for bit with torchrelay.

    torchrun --nproc_per_node=2 examples/train_lm.py --run-dir runs/lm --config examples/lm.yaml
    torchrun --nproc_per_node=2 examples/train_lm.py --run-dir runs/lm          # continues it

Everything torchrelay needs is in four calls: Run.open, run.track, run.dataloader, run.steps.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

# Deterministic cuBLAS needs this before CUDA starts; harmless on the CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

import torchrelay as tr  # noqa: E402
from torchrelay.config.relay import parse_assignments  # noqa: E402
from torchrelay.errors import RelayError  # noqa: E402
from torchrelay.readers import RunDir, stored_config  # noqa: E402
from torchrelay.util import kill_points  # noqa: E402


class ByteLM(nn.Module):
    def __init__(self, d_model: int, layers: int, heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class SourceBytes(torch.utils.data.Dataset):
    """Sample i = the bytes the manifest's line i names, padded to seq_len + 1."""

    def __init__(self, records, seq_len: int) -> None:
        self.records, self.seq_len = records, seq_len

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        rec = self.records[i]
        with open(rec["path"], "rb") as f:
            f.seek(rec["offset"])
            data = f.read(min(rec["length"], self.seq_len + 1))
        x = torch.zeros(self.seq_len + 1, dtype=torch.long)
        x[: len(data)] = torch.tensor(list(data), dtype=torch.long)
        return x, len(data)


def collate(items):
    xs = torch.stack([x for x, _ in items])
    lengths = torch.tensor([n for _, n in items])
    return xs, lengths


def lm_loss(model: nn.Module, xs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    inputs, targets = xs[:, :-1], xs[:, 1:]
    valid = torch.arange(targets.shape[1], device=xs.device)[None, :] < (lengths[:, None] - 1)
    logits = model(inputs)
    return F.cross_entropy(logits[valid], targets[valid])


def make_optimizers(model: nn.Module, p: dict) -> list[torch.optim.Optimizer]:
    """AdamW on everything, or (params.optimizer muon, LingBot's) torch.optim.Muon on the blocks' matrices and
    AdamW on the rest."""
    lr = p["lr"]
    if p.get("optimizer", "adamw") != "muon":
        return [torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=p["weight_decay"])]
    named = list(model.named_parameters())
    matrices = [t for n, t in named if t.ndim == 2 and ".blocks." in f".{n}"]
    rest = [t for n, t in named if not (t.ndim == 2 and ".blocks." in f".{n}")]
    muon = torch.optim.Muon(
        matrices, lr=p.get("muon_lr", lr), weight_decay=p["weight_decay"], adjust_lr_fn="match_rms_adamw"
    )
    return [muon, torch.optim.AdamW(rest, lr=lr, weight_decay=p["weight_decay"])]


def load_config(path: Path | None) -> tr.RelayConfig | None:
    if path is None:
        return None
    data = yaml.safe_load(path.read_text())
    base = path.parent
    for key in ("manifest", "data_root"):  # paths in the YAML are relative to the YAML file
        if data.get(key) and not os.path.isabs(data[key]):
            data[key] = str((base / data[key]).resolve())
    return tr.RelayConfig.from_dict(data, source=str(path))


def _device_of(args: argparse.Namespace) -> str:
    """params.device of the run (from --config for a new run, else the run directory's config.json)."""
    if any(item.startswith("params.device=") for item in args.set):
        return next(i.split("=", 1)[1] for i in args.set if i.startswith("params.device="))
    run_dir = os.environ.get("TORCHRELAY_RUN_DIR") or args.run_dir
    if run_dir and RunDir(run_dir).exists():
        try:  # read the guarded way (a link out of the run, a pipe, a hostile record: refused, never followed)
            return str(stored_config(RunDir(run_dir)).params.get("device", "cpu"))
        except RelayError:
            return "cpu"  # Run.open reads it again and refuses it in one line, on every rank
    if args.config is not None:
        return yaml.safe_load(args.config.read_text())["params"].get("device", "cpu")
    return "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=None, help="YAML config; needed to create a run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--kill-at",
        default=None,
        metavar="PHASE:UPDATE:RANK",
        help="crash tests: SIGKILL a rank inside a save",
    )
    args = parser.parse_args()
    kill_points.arm(args.kill_at)  # none unless a crash test asks (tests/test_exact_resume.py)

    torch.set_num_threads(1)  # two ranks share two cores; one thread each is also deterministic
    cuda = _device_of(args) == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True)  # bit-exact resume needs bit-exact kernels
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        with tr.Run.open(
            args.run_dir, load_config(args.config), overrides=parse_assignments(args.set)
        ) as run:
            p = run.config.params
            torch.manual_seed(run.config.seed)
            model: nn.Module = ByteLM(p["d_model"], p["layers"], p["heads"], p["seq_len"], p["dropout"]).to(
                device,
                getattr(torch, p.get("dtype", "float32")),  # float64: the layout-change test's precision
            )
            if p.get("parallel", "ddp") == "fsdp2":
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                # params.mixed bf16: LingBot's policy, bf16 compute with fp32 gradient reduction and fp32 shards
                mp = (
                    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    if p.get("mixed") == "bf16"
                    else MixedPrecisionPolicy()
                )
                for block in model.blocks.layers:
                    fully_shard(block, mp_policy=mp)
                fully_shard(model, mp_policy=mp)
            else:
                model = nn.parallel.DistributedDataParallel(
                    model, device_ids=[device.index] if cuda else None
                )
            cfg = run.config
            lr_shape = tr.warmup_cosine(cfg.total_updates, cfg.warmup_updates)
            opts = make_optimizers(model, p)
            scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_shape) for o in opts]
            opt = opts[0] if len(opts) == 1 else opts
            if len(scheds) == 1:
                run.track(model=model, optimizer=opt, scheduler=scheds[0])
            else:
                run.track(model=model, optimizer=opt, **{f"scheduler{i}": s for i, s in enumerate(scheds)})

            loader = run.dataloader(SourceBytes(run.manifest.records, p["seq_len"]), collate_fn=collate)
            pace = float(p.get("min_update_s", 0))
            for step in run.steps(loader):
                started = time.perf_counter()
                # A test hook: a transient fault, so in the first attempt of a torchrun job only (--max-restarts).
                first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                if step.update == p.get("crash_at_update") and first_attempt:
                    raise RuntimeError(f"crash_at_update={step.update} (test hook)")
                # A test hook: rank 0 stops answering at this update, as a rank stuck in a collective; a signal cannot
                # stop such a run, only a kill ends it (a Slurm requeue's SIGKILL after KillWait: tests/test_slurm.py).
                while step.update == p.get("hang_at_update") and run.rank == 0:
                    time.sleep(1)
                total = 0.0
                # Given the model, gradients are reduced only in the last micro-batch (DDP no_sync, FSDP2).
                for micro, (xs, lengths) in step.micro_batches(model):
                    if step.update == p.get("skip_update") and micro == 0 and run.rank == 0:
                        xs, lengths = xs[1:], lengths[1:]  # a test hook: one sample left out, a real change
                    xs, lengths = xs.to(device, non_blocking=True), lengths.to(device, non_blocking=True)
                    loss = lm_loss(model, xs, lengths) / cfg.grad_accum
                    if step.update == p.get("nan_at_update"):
                        loss = loss * math.nan
                    loss.backward()
                    total += loss.item()
                lr = scheds[0].get_last_lr()[0]
                for o, sch in zip(opts, scheds, strict=True):
                    for group in o.param_groups:  # a test hook: the learning rate scaled (a real change)
                        group["lr"] *= p.get("lr_scale", 1.0)
                    o.step()
                    sch.step()
                    o.zero_grad(set_to_none=True)
                step.log(loss=total, lr=lr)
                if pace > 0:  # a slower update, never a different one
                    time.sleep(max(0.0, pace - (time.perf_counter() - started)))
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
