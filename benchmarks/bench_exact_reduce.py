"""What `elastic: exact` costs against DDP's own reduction: update time and peak memory, the same model and batches.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/bench_exact_reduce.py --updates 20

One MLP (--width, 4 layers), `--accum` micro-batches an update, through `Step.micro_batches` exactly as a training
loop does: DDP syncing in the last micro-step (the default) against every micro-batch's gradient taken apart and
summed in the canonical tree (run/exact_reduce.py). Each mode runs in a fresh process pair (the peak RSS is the
process's), alternating, `--repeats` times; rank 0 prints the median update time and the peak RSS above the
model's own parameters, gradients and Adam state, as ratios of exact to default.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from torchrelay.run.exact_reduce import ExactReduction  # noqa: E402
from torchrelay.run.loop import Step  # noqa: E402


def one_mode(args: argparse.Namespace) -> None:
    """Inside torchrun: train `--updates` updates in one mode; rank 0 prints one JSON line."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    net = nn.Sequential(
        nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.Linear(w, 1)
    )
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.micro_batch, w, generator=gen) for _ in range(args.accum)]
    exact = ExactReduction(rank, world, args.accum) if args.mode == "exact" else None
    times = []
    base_rss = 0
    for update in range(args.updates + 2):
        it = iter(([i], b) for i, b in enumerate(batches))
        dist.barrier()
        t0 = time.perf_counter()
        step = Step(update + 1, it, args.accum, exact)
        for _micro, x in step.micro_batches(model):
            (model(x).square().mean() / args.accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if update == 1:  # after the first update every buffer of the default mode exists
            base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if update >= 2:
            times.append(dt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "mode": args.mode,
                    "update_ms": 1000 * statistics.median(times),
                    "peak_rss_mib": peak / 1024,
                    "rss_growth_mib": (peak - base_rss) / 1024,
                    "param_mib": params / 2**20,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mode", choices=("default", "exact"), default=None, help="internal: one mode per launch"
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    if args.mode is not None:
        one_mode(args)
        return 0
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    rows: dict[str, list[dict]] = {"default": [], "exact": []}
    for _ in range(args.repeats):
        for mode in ("default", "exact"):
            cmd = [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", __file__, "--mode", mode]
            cmd += ["--updates", str(args.updates), "--width", str(args.width), "--accum", str(args.accum)]
            cmd += ["--micro-batch", str(args.micro_batch)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            rows[mode].append(json.loads(line.removeprefix("RESULT ")))
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"} for m, rs in rows.items()
    }
    d, e = med["default"], med["exact"]
    print(
        f"{args.nproc} rank(s), grad_accum {args.accum}, micro_batch {args.micro_batch}, width {args.width}:"
    )
    print(f"  parameters {d['param_mib']:.1f} MiB (gradients as much, Adam state twice)")
    for mode, r in med.items():
        print(
            f"  {mode:8s} update {r['update_ms']:8.2f} ms   peak RSS {r['peak_rss_mib']:7.1f} MiB   "
            f"growth after update 2 {r['rss_growth_mib']:6.1f} MiB"
        )
    print(
        f"  exact / default: update time {e['update_ms'] / d['update_ms']:.2f}x, peak RSS "
        f"{e['peak_rss_mib'] / d['peak_rss_mib']:.2f}x (+{e['peak_rss_mib'] - d['peak_rss_mib']:.1f} MiB = "
        f"{(e['peak_rss_mib'] - d['peak_rss_mib']) / d['param_mib']:.1f} x the gradient)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
