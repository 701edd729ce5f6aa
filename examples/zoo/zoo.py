"""The zoo: ordinary training features, written from the README as a new user would, each one a member.

    torchrun --nproc_per_node=2 examples/zoo/zoo.py --run-dir runs/zoo --member bn_ddp,dropout,ema
    torchrun --nproc_per_node=2 examples/zoo/zoo.py --run-dir runs/zoo --member all
    torchrelay audit --updates 12 --stop-at 2,10 -- torchrun --nproc_per_node=2 examples/zoo/zoo.py --member all

One script, one model: a small CNN on synthetic 8x8 images with a token branch, trained under DDP (gloo or
NCCL) with gradient accumulation. Each member switches one feature on; several compose into one run:

  bn_ddp          BatchNorm2d under DDP (running statistics differ by rank between two forwards)
  syncbn          SyncBatchNorm (CUDA only: torch has no CPU kernel for it)
  dropout         Dropout and Dropout2d (the global torch RNG, restored by torchrelay)
  ema             an EMA of the weights (torch.optim.swa_utils.AveragedModel), tracked as a stateful
  per_rank        a torch.Generator per rank for per-rank input noise, tracked as is
  adamw_groups    AdamW with two param groups (no decay for norms and biases), SequentialLR warmup -> cosine
  plateau         ReduceLROnPlateau on the loss averaged over ranks
  clip            gradient clipping by the global norm
  amp             bf16 autocast and a GradScaler (growth every 2 updates, so its state moves)
  tying           an embedding tied to the output layer of the token branch
  checkpointing   torch.utils.checkpoint (use_reentrant=False) around a block with Dropout2d: the recompute
                  replays the dropout mask from the preserved RNG state
  workers         2 DataLoader workers (persistent) with per-sample augmentation from tr.SampleContext, and an
                  evaluation DataLoader of the script's own with a persistent worker
  hf              a GPT-2 from transformers, built from a config (no download), on the token branch
  muon            torch.optim.Muon (adjust_lr_fn="match_rms_adamw", cosine LR) on the 2-D weights of the
                  classifier, AdamW on the rest (Muon takes matrices only): both optimizers tracked as one list
  cpu_adam        DeepSpeed's CPU Adam (deepspeed.ops.adam.DeepSpeedCPUAdam, adamw_mode) in AdamW's place, without
                  a DeepSpeed engine: a torch optimizer whose C++ op DeepSpeed compiles once (a C++ compiler needed)

Every run augments each sample from `ctx.generator()` (seeded from seed, sample, epoch), so the draws are
the same with any worker count and after any resume.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import torchrelay as tr  # noqa: E402
from torchrelay.config.relay import parse_assignments  # noqa: E402

MEMBERS = (
    "bn_ddp",
    "syncbn",
    "dropout",
    "ema",
    "per_rank",
    "adamw_groups",
    "plateau",
    "clip",
    "amp",
    "tying",
    "checkpointing",
    "workers",
    "hf",
    "muon",
    "cpu_adam",
)
CPU_MEMBERS = tuple(m for m in MEMBERS if m != "syncbn")
HERE = Path(__file__).resolve().parent
VOCAB, SEQ, WIDTH, CLASSES = 16, 8, 16, 4


class ZooData(torch.utils.data.Dataset):
    """Sample i: an 8x8 image and 8 tokens made from i, augmented from the sample's own generator per epoch."""

    wants_context = True  # dataset[ctx] with ctx = tr.SampleContext(index, epoch, update, seed)

    def __init__(self, records: tuple[dict, ...]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, ctx: tr.SampleContext) -> dict[str, torch.Tensor]:
        image, tokens, label = make_sample(self.records, ctx.index)
        gen = ctx.generator()  # same numbers in any worker, any process, after any resume
        if torch.rand((), generator=gen) < 0.5:
            image = image.flip(-1)
        image = image + 0.1 * torch.randn(image.shape, generator=gen)
        return {"image": image, "tokens": tokens, "label": label}


class EvalData(torch.utils.data.Dataset):
    """The first samples, without augmentation: what the evaluation loader reads."""

    def __init__(self, records: tuple[dict, ...], size: int) -> None:
        self.records, self.size = records, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        image, tokens, label = make_sample(self.records, i)
        return {"image": image, "tokens": tokens, "label": label}


def make_sample(records: tuple[dict, ...], i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + i)
    label = int(records[i]["label"])
    image = torch.randn(3, 8, 8, generator=gen) + label  # the class shifts the image: something to learn
    tokens = (torch.arange(SEQ) * (label + 1) + torch.randint(0, 3, (SEQ,), generator=gen)) % VOCAB
    return image, tokens, torch.tensor(label)


class ZooNet(nn.Module):
    """A CNN on the image and a small language model on the tokens; the members switch their parts on."""

    def __init__(self, members: set[str]) -> None:
        super().__init__()
        self.members = members
        p = 0.2 if "dropout" in members or "checkpointing" in members else 0.0
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8) if "bn_ddp" in members else nn.Identity(),
            nn.ReLU(),
        )
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout2d(p))
        self.sync_norm = nn.SyncBatchNorm(8) if "syncbn" in members else nn.Identity()
        self.fc = nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Dropout(p))
        self.classify = nn.Linear(WIDTH, CLASSES)
        if "tying" in members:
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.unembed = nn.Linear(WIDTH, VOCAB, bias=False)
            self.unembed.weight = self.embed.weight  # one tensor, two uses
        if "hf" in members:
            import transformers

            transformers.logging.set_verbosity_error()
            config = transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=WIDTH,
                n_layer=1,
                n_head=2,
                bos_token_id=0,
                eos_token_id=0,
            )
            self.gpt = transformers.GPT2LMHeadModel(config)  # built from a config: no download

    def forward(self, image: torch.Tensor, tokens: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        h = self.stem(image)
        if "checkpointing" in self.members:
            # Recomputed in backward; the Dropout2d mask is replayed from the RNG state checkpoint preserved.
            h = checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        h = self.sync_norm(h)
        feature = self.fc(h.mean(dim=(2, 3)))
        loss = F.cross_entropy(self.classify(feature), label)
        if "tying" in self.members:
            states = self.embed(tokens[:, :-1]) + feature[:, None, :]
            logits = self.unembed(states)
            loss = loss + F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        if "hf" in self.members:
            loss = loss + self.gpt(input_ids=tokens, labels=tokens).loss
        return loss


def parse_members(text: str) -> list[str]:
    chosen = list(CPU_MEMBERS) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(MEMBERS))
    if unknown:
        raise SystemExit(f"zoo: unknown member(s) {unknown}; choose from {', '.join(MEMBERS)} or 'all'")
    return sorted(set(chosen))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument(
        "--member", default="all", help="comma-separated members, or 'all' (every CPU member)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args()
    members = parse_members(args.member)
    on = set(members)

    cuda = torch.cuda.is_available() and os.environ.get("ZOO_DEVICE", "cuda") == "cuda"
    if "syncbn" in on and not cuda:
        raise SystemExit("zoo: member syncbn needs CUDA (torch's SyncBatchNorm has no CPU kernel)")
    if "cpu_adam" in on and cuda:
        raise SystemExit(
            "zoo: member cpu_adam steps CPU parameters (DeepSpeedCPUAdam); run it with ZOO_DEVICE=cpu"
        )
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()

    cfg = tr.RelayConfig(
        seed=1234,
        micro_batch=4,
        grad_accum=2,
        total_updates=12,
        warmup_updates=3,
        manifest=str(HERE / "samples.jsonl"),  # 64 samples, 16 per update: 4 updates per epoch
        num_workers=2 if "workers" in on else 0,
        save_every=3,
        params={"members": members, "lr": 3e-3, "weight_decay": 0.05},
    )
    try:
        # The same call creates the run or resumes it (the stored config, with this one's runtime fields).
        with tr.Run.open(args.run_dir, cfg, overrides=parse_assignments(args.set)) as run:
            cfg, p = run.config, run.config.params
            torch.manual_seed(cfg.seed)
            net = ZooNet(on).to(device)
            model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if cuda else None)

            # muon: the hidden matrices go to Muon (it takes 2-D parameters only); embeddings, the GPT-2 and every
            # other tensor stay with AdamW, as LingBot paired them.
            matrices = (
                [w for n, w in net.named_parameters() if w.ndim == 2 and n.startswith(("fc.", "classify."))]
                if "muon" in on
                else []
            )
            rest = [w for w in net.parameters() if all(w is not m for m in matrices)]
            adamw: type[torch.optim.Optimizer] = torch.optim.AdamW
            if "cpu_adam" in on:
                from deepspeed.ops.adam import DeepSpeedCPUAdam  # AdamW's update in C++ (adamw_mode=True)

                adamw = DeepSpeedCPUAdam
            if "adamw_groups" in on:
                no_decay = [w for n, w in net.named_parameters() if w.ndim < 2 or "norm" in n or "embed" in n]
                decay = [w for w in rest if all(w is not x for x in no_decay)]
                opt = adamw(
                    [
                        {"params": decay, "weight_decay": p["weight_decay"]},
                        {"params": [w for w in no_decay if any(w is r for r in rest)], "weight_decay": 0.0},
                    ],
                    lr=p["lr"],
                )
                warmup = torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=cfg.warmup_updates)
                cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
                    opt, T_max=cfg.total_updates - cfg.warmup_updates, eta_min=1e-4
                )
                sched = torch.optim.lr_scheduler.SequentialLR(
                    opt, [warmup, cosine], milestones=[cfg.warmup_updates]
                )
            else:
                opt = adamw(rest, lr=p["lr"], weight_decay=0.0)
                sched = None
            optimizers: list[torch.optim.Optimizer] = [opt]
            if matrices:
                muon = torch.optim.Muon(
                    matrices, lr=p["lr"], weight_decay=p["weight_decay"], adjust_lr_fn="match_rms_adamw"
                )
                optimizers.append(muon)
                muon_sched = torch.optim.lr_scheduler.CosineAnnealingLR(
                    muon, T_max=cfg.total_updates, eta_min=1e-4
                )

            state: dict[str, object] = {}
            if sched is not None:
                state["scheduler"] = sched
            if matrices:
                state["muon_scheduler"] = muon_sched
            if "plateau" in on:
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                    opt, factor=0.5, patience=1, threshold=0.0
                )
                state["plateau"] = plateau
            if "ema" in on:
                ema = torch.optim.swa_utils.AveragedModel(
                    net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
                )
                state["ema"] = ema
            scaler = torch.amp.GradScaler(
                device.type, init_scale=2.0**8, growth_interval=2, enabled="amp" in on
            )
            if "amp" in on:
                state["scaler"] = scaler
            if "per_rank" in on:
                noise = torch.Generator(device=device).manual_seed(cfg.seed + 1000 * rank)
                state["noise"] = noise  # differs by rank, and must come back per rank
            # Several optimizers are tracked as one list (DCP keeps each one's state by parameter name).
            run.track(model=model, optimizer=optimizers if len(optimizers) > 1 else opt, **state)

            loader = run.dataloader(ZooData(run.manifest.records), persistent_workers=True)
            evaluation = None
            if "workers" in on:
                # A loader of the script's own: a persistent worker, and its own generator so that starting it
                # (once per process) draws nothing from the global RNG that a resumed process would draw later.
                evaluation = torch.utils.data.DataLoader(
                    EvalData(run.manifest.records, 8),
                    batch_size=4,
                    num_workers=1,
                    persistent_workers=True,
                    generator=torch.Generator().manual_seed(cfg.seed),
                )
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled="amp" in on)

            for step in run.steps(loader):
                total = torch.zeros((), device=device)
                for _micro, batch in step.micro_batches(model):  # gradients sync in the last micro-batch
                    batch = {k: v.to(device) for k, v in batch.items()}
                    if "per_rank" in on:
                        shape = batch["image"].shape
                        batch["image"] = batch["image"] + 0.05 * torch.randn(
                            shape, generator=noise, device=device
                        )
                    with autocast:
                        loss = model(batch["image"], batch["tokens"], batch["label"]) / cfg.grad_accum
                    scaler.scale(loss).backward()
                    total += loss.detach().float()
                lr = opt.param_groups[0]["lr"]
                metrics = {"loss": total.item(), "lr": lr}
                if "clip" in on:
                    for o in optimizers:
                        scaler.unscale_(o)
                    metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
                for o in optimizers:
                    scaler.step(o)
                scaler.update()
                for o in optimizers:
                    o.zero_grad(set_to_none=True)
                if sched is not None:
                    sched.step()
                if matrices:
                    metrics["muon_lr"] = muon.param_groups[0]["lr"]
                    muon_sched.step()
                if "plateau" in on:
                    mean = total.clone()
                    dist.all_reduce(mean)  # every rank must step the plateau on the same number
                    plateau.step(float(mean) / dist.get_world_size())
                if "ema" in on:
                    ema.update_parameters(net)
                    metrics["ema_w"] = float(next(ema.parameters()).detach().double().sum())
                if "amp" in on:
                    metrics["scale"] = scaler.get_scale()
                if evaluation is not None and step.update % 3 == 0:
                    model.eval()
                    with torch.no_grad():
                        losses = [
                            model(b["image"].to(device), b["tokens"].to(device), b["label"].to(device))
                            for b in evaluation
                        ]
                    model.train()
                    metrics["eval_loss"] = float(torch.stack(losses).mean())
                step.log(**metrics)
        return run.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
