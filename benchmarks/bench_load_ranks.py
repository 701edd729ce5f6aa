"""Issue 22 goal 4 with every rank of a host resuming at once: the verified resume of an FSDP2-sharded state on
N ranks of one host against the same ranks' cold read of the same files, at the same moment.

bench_load.py times one rank alone, where the resume's fixed costs (Run.open, the metadata check, DCP's plan, the
last part's hash and copies) leave the disk idle. A job of 8 ranks a host resumes them together: each rank's fixed
costs then fall while the others read. This benchmark measures that case, on the host as a whole.

The state (`--layers` x Linear(width, width), each layer and the root `fully_shard`ed, AdamW after one step) is
saved ONCE by torchrelay, each rank writing its own shards. Then `--repeat` rounds, each in this order (reversed
every other round): the floor, the verified resume, and the control, each after the checkpoint's pages were dropped:

- floor / control: every rank cold-reads the tensor files it wrote (`__RANK_*.distcp`, the ones its resume
  reads), `--streams` threads a rank, 16 MiB reads into a reused buffer (bench_save's cold read);
- resume: every rank `Run.open` + `run.track(model, optimizer)` (the verified load), its tensors zeroed before and
  checked `torch.equal` to the saved ones after.

Each is timed on the host: from the barrier every rank leaves to the last rank's end (CLOCK_MONOTONIC, one clock
for every process of the host). The resume's ratio is its round's floor over it (goal: >= 0.95); the control's
the same, so the disk's own spread is seen beside it.

    PYTHONPATH=src torchrun --standalone --nproc_per_node=8 benchmarks/bench_load_ranks.py --layers 72 \\
        --width 4096 --dir /root --repeat 6 --json $OUT/ranks.json
    PYTHONPATH=src torchrun --standalone --nproc_per_node=2 benchmarks/bench_load_ranks.py --layers 4 --width 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import BUILT_IN, KNOBS, parse_variant  # noqa: E402
from bench_save import GB, cold_read, load_with_stats  # noqa: E402
from benchlib import cpu_seconds, drop_cache  # noqa: E402

import torchrelay as tr  # noqa: E402
from torchrelay.checkpoint import dcp_io  # noqa: E402
from torchrelay.config.tuning import LoadTuning  # noqa: E402
from torchrelay.util import sha256_parts  # noqa: E402


def host_span(fn: Any) -> tuple[float, Any]:
    """(seconds from the barrier every rank leaves to the last rank's end, fn's result on this rank)."""
    dist.barrier()
    t0 = time.monotonic()
    result = fn()
    t1 = time.monotonic()
    spans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(spans, (t0, t1))
    return max(b for _, b in spans) - min(a for a, _ in spans), result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=16, help="threads of each rank's cold read")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="name:KNOB=VALUE,... over LoadTuning's defaults, or a bench_load.py built-in's name (repeatable; "
        "default: the defaults alone, as 'resume')",
    )
    args = ap.parse_args()
    variants: dict[str, dict[str, Any]] = {}
    for text in args.variant:
        name, knobs = (text, BUILT_IN[text]) if text in BUILT_IN else parse_variant(text)
        variants[name] = knobs
    variants = variants or {"resume": {}}
    defaults = dataclasses.asdict(LoadTuning())

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):  # each rank allocates its own shards only (72 x 4096^2 would be 4.8 GB a rank)
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    mesh = init_device_mesh("cpu", (world,))  # on the host: FSDP's default mesh would take the GPU
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step's state without a forward: a gradient of each rank's own shard
        local = p.to_local()
        p.grad = DTensor.from_local(
            torch.randn(local.shape, generator=gen), p.device_mesh, p.placements, run_check=False
        )
    opt.step()
    opt.zero_grad(set_to_none=True)

    def current() -> list[torch.Tensor]:
        """This rank's shards of every tensor a resume restores, in a fixed order."""
        out: list[torch.Tensor] = []
        for p in model.parameters():
            out.append(p.to_local())
            st = opt.state.get(p, {})
            out.extend(
                (st[k].to_local() if hasattr(st[k], "to_local") else st[k])
                for k in sorted(st)
                if isinstance(st[k], torch.Tensor)
            )
        return out

    holder: list[Any] = [None]
    if rank == 0:
        base = Path(tempfile.mkdtemp(prefix="bench-load-ranks-", dir=args.dir))
        (base / "code").mkdir()
        (base / "manifest.jsonl").write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(1000)))
        holder[0] = str(base)
    dist.broadcast_object_list(holder, src=0)
    base = Path(holder[0])
    cfg = tr.RelayConfig(
        seed=0,
        micro_batch=1,
        total_updates=1000,
        save_every=1000,
        manifest=str(base / "manifest.jsonl"),
        async_save=False,
    )
    run = tr.Run.open(base / "run", cfg, code_dir=base / "code")
    run.track(model=model, optimizer=opt)
    t_save, _ = host_span(lambda: run._saver.save(1))
    run._end_segment(1)
    ckpt = base / "run" / "checkpoint-1"
    mine = sorted((ckpt / "model").glob(f"__{rank}_*.distcp"))
    saved = [t.detach().clone() for t in current()]
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    totals: list[Any] = [None] * world
    dist.all_gather_object(totals, (nbytes, sum(f.stat().st_size for f in mine), len(mine)))
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "ranks": world,
        "cores": len(os.sched_getaffinity(0)),
        "state_bytes": sum(t[0] for t in totals),
        "file_bytes": sum(t[1] for t in totals),
        "files": sum(t[2] for t in totals),
        "rank_file_bytes": [t[1] for t in totals],
        "save_s": t_save,
        "part_bytes": sha256_parts.PART_BYTES,
    }
    if rank == 0:
        print(
            f"[ranks] {world} ranks, state {out['state_bytes'] / GB:.2f} GB, {out['files']} files "
            f"({min(out['rank_file_bytes']) / GB:.2f}-{max(out['rank_file_bytes']) / GB:.2f} GB a rank), "
            f"saved in {t_save:.2f} s, parts of {sha256_parts.PART_BYTES >> 20} MiB",
            flush=True,
        )

    def drop() -> None:
        for f in mine:
            drop_cache(f)
        if rank == 0:
            drop_cache(ckpt)
        dist.barrier()

    phases: dict[str, float] = {}
    plain_load = dcp_io.load

    def resume(knobs: dict[str, Any]) -> dict[str, Any]:
        tuned = {"load_tuning": {**defaults, **{k: v for k, v in knobs.items() if k in KNOBS}}}
        with torch.no_grad():
            for t in current():
                t.zero_()
        drop()
        used = cpu_seconds()
        opened: list[Any] = [None, 0.0]

        def go() -> None:
            t0 = time.monotonic()
            opened[0] = tr.Run.open(base / "run", None, code_dir=base / "code", overrides=tuned)
            opened[1] = time.monotonic() - t0
            opened[0].track(model=model, optimizer=opt)

        span, _ = host_span(go)
        cpu_s = cpu_seconds() - used
        opened[0]._end_segment(1)
        equal = all(torch.equal(a, b) for a, b in zip(current(), saved, strict=True))
        mine_row = {"cpu_s": cpu_s, "equal": equal, "open_s": opened[1], **phases}
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, mine_row)
        return {"s": span, "equal": all(r["equal"] for r in rows), "ranks": rows}

    def floor() -> float:
        drop()
        span, _ = host_span(lambda: cold_read(mine, args.streams))
        return span

    dcp_io.load = load_with_stats(plain_load, phases)  # type: ignore[assignment]
    rounds: list[dict[str, Any]] = []
    try:
        warm = resume({})  # imports and threads' first use: not counted
        out["warm_resume_s"] = warm["s"]
        for i in range(args.repeat):
            order = ["floor", *variants, "control"]
            if i % 2:  # a drift within a round falls on each row alike
                order.reverse()
            got: dict[str, Any] = {}
            for name in order:
                got[name] = resume(variants[name]) if name in variants else {"s": floor()}
            ref = got["floor"]["s"]
            for name in [*variants, "control"]:
                got[name]["vs_floor"] = ref / got[name]["s"]
            rounds.append(got)
            if rank == 0 and args.json:  # each round as it ends: a call cut short keeps the rounds it ran
                Path(args.json).write_text(json.dumps({**out, "rounds": rounds}, indent=1, default=str))
            if rank == 0:
                print(f"[ranks] round {i + 1}: floor {ref:.3f} s", flush=True)
                for name in [*variants, "control"]:
                    row = got[name]
                    line = f"[ranks]   {name}: {row['s']:.3f} s = {row['vs_floor']:.3f} of the floor"
                    if "ranks" in row:
                        ends = [r.get("at_reads_done", 0.0) for r in row["ranks"]]
                        idle = [r.get("read_idle", 0.0) for r in row["ranks"]]
                        read = [r.get("bytes_read", 0) / GB for r in row["ranks"]]
                        line += (
                            f" (equal {row['equal']}; a rank's reads done at {min(ends):.2f}-{max(ends):.2f} s, "
                            f"its readers idle {min(idle):.1f}-{max(idle):.1f} thread-s, read "
                            f"{min(read):.2f}-{max(read):.2f} GB)"
                        )
                    print(line, flush=True)
    finally:
        dcp_io.load = plain_load  # type: ignore[assignment]
    out["variants"] = variants
    out["rounds"] = rounds
    if rank == 0:
        out["summary"] = {}
        for name in [*variants, "control"]:
            got_ = [r[name]["vs_floor"] for r in rounds]
            out["summary"][name] = {
                "median": statistics.median(got_),
                "min": min(got_),
                "max": max(got_),
                "at_095": sum(v >= 0.95 for v in got_),
                "rounds": len(got_),
            }
            print(
                f"[ranks] {name} vs its round's floor: median {statistics.median(got_):.3f} "
                f"({min(got_):.3f}-{max(got_):.3f}), {out['summary'][name]['at_095']}/{len(got_)} at >= 0.95",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    ok = all(r[name]["equal"] for r in rounds for name in variants) and warm["equal"]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()
    if not ok:
        sys.exit("[ranks] a resume loaded a tensor that differs from the saved one")


if __name__ == "__main__":
    main()
