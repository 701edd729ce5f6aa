"""What torchrelay adds to one update when no save is due: the boundary (stop agreement, request-file check),
the Step object, metric and exposure logging — measured against the same loop over a plain DataLoader.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_step_overhead.py [--updates 3000] [--backend gloo]

Two figures: the whole loop against a plain loop over the same batches (with --work-ms of simulated update work,
a sleep, as a GPU-bound update leaves the CPU waiting), and the time spent inside torchrelay between the end of
one update's body and the start of the next (the boundary: agreement, request check, logging, Step). The goal
is <= 0.5 % of a 100 ms update, i.e. <= 500 us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import torchrelay as tr
from torchrelay.data.loader import RankBatches
from torchrelay.data.order import GlobalOrder


class Ones(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=3000)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=0.0, help="simulated update work (sleep) per update")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(tempfile.mkdtemp(prefix="bench-overhead-")) if rank == 0 else None
    box = [str(base)]
    dist.broadcast_object_list(box)
    base = Path(box[0])
    manifest = base / "manifest.jsonl"
    if rank == 0:
        manifest.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(100_000)))
    dist.barrier()
    cfg = tr.RelayConfig(
        seed=0,
        micro_batch=4,
        grad_accum=2,
        total_updates=args.updates,
        manifest=str(manifest),
        save_every=10**9,
    )
    plain_times, relay_times, agree_times, boundary_times = [], [], [], []
    # Both loops end each update with a small all-reduce, as DDP's gradient sync does: it keeps the ranks in
    # step, so a rank's drift is not charged to torchrelay's agreement.
    grad = torch.zeros(1024, device="cuda" if args.backend == "nccl" else "cpu")
    for rep in range(args.repeats):
        # --- plain: the same batches through a plain DataLoader, no torchrelay in the loop
        # the run's order, built as Run.open builds it (a run opened and left would end in error)
        order = GlobalOrder(
            num_samples=100_000, seed=cfg.seed, global_batch=cfg.global_batch_for(world), kind=cfg.sampler
        )
        batches = RankBatches(order, 0, args.updates, rank, world, 4, 2)
        loader = DataLoader(Ones(), batch_sampler=batches, num_workers=0)
        it = iter(loader)
        dist.barrier()
        t0 = time.perf_counter()
        for _u in range(args.updates):
            for _m in range(2):
                next(it)
            if args.work_ms:
                time.sleep(args.work_ms / 1e3)
            dist.all_reduce(grad)  # the gradient sync every data-parallel update has
        plain_times.append((time.perf_counter() - t0) / args.updates)
        dist.barrier()
        # --- torchrelay: run.steps with logging, agreement and request-file checks
        with tr.Run.open(base / f"relay-{rep}", cfg) as run:
            run.track()
            loader2 = run.dataloader(Ones())
            dist.barrier()
            t0 = time.perf_counter()
            between, body_end = [], None
            for step in run.steps(loader2):
                body_start = time.perf_counter()
                if body_end is not None:
                    between.append(body_start - body_end)
                for _m, _b in step.micro_batches():
                    pass
                if args.work_ms:
                    time.sleep(args.work_ms / 1e3)
                dist.all_reduce(grad)
                step.log(loss=1.0, lr=0.1)
                if step.update == args.updates - 1:
                    t_end = time.perf_counter()
                body_end = time.perf_counter()
            relay_times.append((t_end - t0) / (args.updates - 1))
            boundary_times.append(statistics.mean(between))
        # --- the agreement alone
        t = torch.zeros(1, dtype=torch.int32, device="cuda" if args.backend == "nccl" else "cpu")
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.updates):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            int(t.item())
        agree_times.append((time.perf_counter() - t0) / args.updates)
    if rank == 0:
        plain = statistics.median(plain_times) * 1e6
        relay = statistics.median(relay_times) * 1e6
        agree = statistics.median(agree_times) * 1e6
        overhead = relay - plain
        boundary = statistics.median(boundary_times) * 1e6
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "world_size": world,
                    "updates": args.updates,
                    "repeats": args.repeats,
                    "work_ms": args.work_ms,
                    "boundary_us_per_update": round(boundary, 1),
                    "boundary_of_100ms_percent": round(boundary / 1e5 * 100, 3),
                    "plain_loop_us_per_update": round(plain, 1),
                    "torchrelay_loop_us_per_update": round(relay, 1),
                    "overhead_us_per_update": round(overhead, 1),
                    "of_100ms_update_percent": round(overhead / 1e5 * 100, 3),
                    "stop_agreement_allreduce_us": round(agree, 1),
                },
                indent=1,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
