"""What starting the loader's workers from a forkserver costs against forking them from the rank.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_loader_start.py --context forkserver --workers 2

One loader per process, as in a run: the time from `RelayLoader.start` to the first batch on each rank (the
slowest rank is reported), after `init_process_group` and a second gloo group, as a run has them. The dataset
holds `--records` manifest-like records, which a forkserver's worker receives pickled and a forked one inherits.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder


class Records(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.records = [
            {"path": f"/data/shard-{i // 1000}.bin", "offset": i * 4096, "length": 4096} for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), float(self.records[i]["offset"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", choices=("fork", "forkserver"), required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--records", type=int, default=10_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dist.new_group(backend="gloo")  # the run's agreement group: its threads are alive at fork time too
    rank, world = dist.get_rank(), dist.get_world_size()
    order = GlobalOrder(num_samples=args.records, seed=1, global_batch=8 * world)
    batches = RankBatches(order, 0, 100, rank, world, 8, 1)
    loader = RelayLoader(Records(args.records), None, args.workers, multiprocessing_context=args.context)
    dist.barrier()
    t0 = time.perf_counter()
    it = loader.start(batches, seed=1, context=args.context)
    next(it)
    first = time.perf_counter() - t0
    for _ in range(args.workers):  # every worker has delivered a batch
        next(it)
    all_up = time.perf_counter() - t0
    del it
    out: list[object] = [None] * world
    dist.all_gather_object(out, (first, all_up))
    if rank == 0:
        row = {
            "context": args.context,
            "workers": args.workers,
            "records": args.records,
            "first_batch_s": round(max(f for f, _ in out), 3),  # type: ignore[misc]
            "all_workers_s": round(max(a for _, a in out), 3),  # type: ignore[misc]
        }
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
