"""Checkpoint save and load time against the bytes written, through the whole commit protocol
(DCP shards, RNG, trainer state, fsyncs, SHA-256 inventory, rename) — and a plain `torch.save` of the same
state by rank 0 alone as the peer.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checkpoint.py [--sizes 10,50,200] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import torchrelay as tr


def model_of(million: int) -> nn.Module:
    width = 1024
    layers = max(1, round(million * 1e6 / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,50,200", help="model sizes in millions of parameters")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir) if rank == 0 else ""]
    dist.broadcast_object_list(box)
    base = Path(box[0])
    manifest = base / "manifest.jsonl"
    if rank == 0:
        (base / "code").mkdir()
        manifest.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(1000)))
    dist.barrier()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(model_of(size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        cfg = tr.RelayConfig(seed=0, micro_batch=1, total_updates=10, manifest=str(manifest), keep=2)
        run = tr.Run.open(base / f"run-{size}", cfg, code_dir=base / "code")
        run.track(model=model, optimizer=opt)
        dist.barrier()
        t0 = time.perf_counter()
        path = run._saver.save(1)
        run._saver.wait()  # until committed (a background save returns once the state is staged)
        save_s = time.perf_counter() - t0
        nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        # load: a fresh Run resumes from that checkpoint (includes the inventory's SHA-256 verification)
        run._end_segment(1)
        dist.barrier()
        t0 = time.perf_counter()
        run2 = tr.Run.open(base / f"run-{size}", None, code_dir=base / "code")
        run2.track(model=model, optimizer=opt)
        dist.barrier()
        load_s = time.perf_counter() - t0
        run2._end_segment(1)
        peer_s = None
        if rank == 0:
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            t0 = time.perf_counter()
            with open(base / "peer.pt", "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            peer_s = time.perf_counter() - t0
            (base / "peer.pt").unlink()
            results.append(
                {
                    "params_million": sum(p.numel() for p in model.parameters()) / 1e6,
                    "bytes": nbytes,
                    "save_s": round(save_s, 3),
                    "load_s": round(load_s, 3),
                    "save_GBps": round(nbytes / save_s / 1e9, 3),
                    "load_GBps": round(nbytes / load_s / 1e9, 3),
                    "peer_torch_save_fsync_s": round(peer_s, 3),
                }
            )
        shutil.rmtree(base / f"run-{size}", ignore_errors=True) if rank == 0 else None
        dist.barrier()
    if rank == 0:
        print(
            json.dumps(
                {"world_size": world, "backend": args.backend, "dir": str(base), "results": results}, indent=1
            )
        )
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
