"""What the loop adds per update on 2 gloo ranks, with and without an exchange per micro-batch (issue 22, task 2).

    OMP_NUM_THREADS=1 python benchmarks/bench_micro_collective.py --before SRC [--updates 300] [--repeats 3]

A real run (`Run.open`, `run.steps`, `step.micro_batches(model)`), under torchrun with 2 ranks on gloo, of small
updates: a DDP Linear(8, 1), `--accum` micro-batches of 1 sample each, an in-memory dataset, no save in between.
Each launch trains `--updates` updates and reports, over the updates after the first 10, the median of the
loop's own `update_time` (metrics-rank0: from the Step handed out to the script's return, micro-batches and their
reads included) and rank 0's CPU and wall seconds per update (the loop's boundaries included). The library under test (`--after`, default this checkout's src/) and `--before` (an export of another
commit's src/) run alternately, `--repeats` times each; the figure is the ratio of their medians, and the
difference per update and per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(out: Path, updates: int, accum: int) -> None:
    """Inside torchrun: one run of `updates` small updates."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import torchrelay as tr

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    manifest = out / "manifest.jsonl"
    if dist.get_rank() == 0:
        manifest.write_text(
            "".join(json.dumps({"id": f"s{i}", "path": f"s{i}.bin"}) + "\n" for i in range(4096))
        )
    dist.barrier()
    cfg = tr.RelayConfig(
        seed=1,
        micro_batch=1,
        grad_accum=accum,
        total_updates=updates,
        manifest=str(manifest),
        data_root=str(out),
        save_every=updates,
    )

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((8,), float(i % 7))

    with tr.Run.open(out / "run", cfg, code_dir=out) as run:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run.track(model=model, optimizer=opt)
        marks = {}
        for step in run.steps(run.dataloader(Samples())):
            if step.update in (11, updates):  # the loop's CPU and wall over the updates after the first 10
                marks[step.update] = (time.process_time(), time.perf_counter())
            for _, batch in step.micro_batches(model):
                model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
    if dist.get_rank() == 0:
        (cpu0, wall0), (cpu1, wall1) = marks[11], marks[updates]
        n = updates - 11
        (out / "loop.json").write_text(
            json.dumps({"cpu_s": (cpu1 - cpu0) / n, "wall_s": (wall1 - wall0) / n})
        )


def launch(src: Path, updates: int, accum: int) -> dict[str, float]:
    """One 2-rank launch of the library at `src`: the median update_time, and rank 0's CPU and wall seconds per
    update over the updates after the first 10 (the loop's boundaries included)."""
    with tempfile.TemporaryDirectory(prefix="bench-micro-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, "--child", tmp]
        cmd += ["--updates", str(updates), "--accum", str(accum)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise SystemExit(f"launch failed ({src}):\n{done.stderr[-3000:]}")
        lines = (Path(tmp) / "run" / "train" / "metrics-rank0.jsonl").read_text().splitlines()
        times = [json.loads(line)["update_time"] for line in lines][10:]
        loop = json.loads((Path(tmp) / "loop.json").read_text())
        return {"median": statistics.median(times), "cpu": loop["cpu_s"], "wall": loop["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="src/ of the library to compare with")
    parser.add_argument("--after", type=Path, default=ROOT / "src")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=Path)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.updates, args.accum)
        return
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    started = time.time()
    loads = []
    for _ in range(args.repeats):
        for name, src in (("before", args.before), ("after", args.after)):
            loads.append(os.getloadavg()[0])
            got[name].append(launch(src, args.updates, args.accum))
            print(name, {k: round(v * 1000, 3) for k, v in got[name][-1].items()}, "ms", flush=True)
    out: dict[str, object] = {"updates": args.updates, "accum": args.accum}
    for key in ("median", "cpu", "wall"):
        before = statistics.median(g[key] for g in got["before"])
        after = statistics.median(g[key] for g in got["after"])
        out[key] = {
            "before_ms": [round(g[key] * 1000, 3) for g in got["before"]],
            "after_ms": [round(g[key] * 1000, 3) for g in got["after"]],
            "ratio_after_to_before": round(after / before, 3),
            "saved_per_micro_batch_ms": round((before - after) * 1000 / args.accum, 3),
        }
    out["load_average_at_starts"] = [round(x, 1) for x in loads]
    out["seconds"] = round(time.time() - started, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
