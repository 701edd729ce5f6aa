"""Updates during a persist: the DCP files written by a thread of the training process, or by a writer process.

A real torchrelay loop (Run.open, track, run.steps over run.dataloader, async_save) on a stack of --layers x
Linear(width, width) + AdamW (3 tensors of width^2 floats per layer: --layers 72 --width 4096 is the H200 host's
14.5 GB state). Each variant runs its own launch, alternating within one process, `--rounds` times, so that the
two see the same machine: `thread` (TORCHRELAY_PERSIST_WRITER=thread, the persist's writers share the training
thread's interpreter) and `process` (the default: a writer process per rank, checkpoint/writer_process.py). Every
update is timed from its start to the next one's, its loss read back (`.item()`, as a loop that logs does: the GPU's
work is in the time); updates that held a save's stall are counted apart. Reported per launch: the median update
outside saves, and of the updates while a persist was in flight their worst and median as multiples of it and how
many took over 1.1x; the stall (the update that saved) as a multiple too; each persist's seconds (one still in
flight when the next save began, which waited for it, or at the end is counted, untimed).

CPU: `PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_persist_process.py --json out.json`
GPU: `PYTHONPATH=src python3 benchmarks/bench_persist_process.py --device cuda --layers 72 --width 4096 \
      --saves 3 --save-every 40 --rounds 2 --dir /path/on/local/disk --json out.json`
"""

from __future__ import annotations

import argparse
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
from torch import nn

import torchrelay as tr
from torchrelay.config import envvars

VARIANTS = ("thread", "process")


def build_state(layers: int, width: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def launch(variant: str, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One segment of a run with `variant`'s writer: every update timed, every persist's seconds."""
    os.environ[envvars.PERSIST_WRITER.name] = variant
    total = args.saves * args.save_every + args.tail
    manifest = base / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(total + 8)))
    cfg = tr.RelayConfig(
        seed=0, micro_batch=1, total_updates=total, save_every=args.save_every, manifest=str(manifest), keep=2
    )
    model, opt = build_state(args.layers, args.width, args.device)
    x = torch.randn(args.batch, args.width, device=args.device)
    run = tr.Run.open(base / f"run-{variant}", cfg, code_dir=base / "code")
    saver = run._saver
    times: list[float] = []
    kinds: list[str] = []  # "save": the update held a save's stall; "persist": one was in flight; ""
    persists: list[float] = []
    untimed = 0  # persists still in flight when the next save began (it waited for them) or at the end
    last_saved, started = saver.last, None
    writer_pid = None
    try:
        run.track(model=model, optimizer=opt)
        loader = run.dataloader(list(range(len(run.manifest))))
        prev = None
        for step in run.steps(loader):
            now = time.perf_counter()
            saved = saver.last != last_saved
            last_saved = saver.last
            if (
                prev is not None
            ):  # the previous update, from its start to this one's: `due` and `save` included
                times.append(now - prev[0])
                kinds.append("save" if saved else prev[1])
            persisting = saver.persisting
            if saved:
                untimed += started is not None
                started = now
            elif started is not None and not persisting:
                persists.append(now - started)  # committed during the update before this one
                started = None
            prev = (now, "persist" if persisting else "")
            for _, _batch in step.micro_batches(model):
                loss = model(x).square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            if saver._writer is not None:
                writer_pid = saver._writer.pid
    finally:
        run.close()
        os.environ.pop(envvars.PERSIST_WRITER.name, None)
    untimed += started is not None
    return {
        "times": times,
        "kinds": kinds,
        "persists": persists,
        "untimed": untimed,
        "writer_pid": writer_pid,
    }


def summarize(variant: str, got: dict[str, Any]) -> dict[str, Any]:
    times, kinds = got["times"], got["kinds"]
    med = statistics.median(t for t, k in zip(times, kinds, strict=True) if k == "")
    during = [t / med for t, k in zip(times, kinds, strict=True) if k == "persist"]
    stalls = [t / med for t, k in zip(times, kinds, strict=True) if k == "save"]
    return {
        "variant": variant,
        "writer_process": got["writer_pid"] is not None,
        "updates": len(times),
        "update_median_ms": round(med * 1000, 3),
        "updates_during_persist": len(during),
        "worst_during_persist_x": round(max(during, default=float("nan")), 3),
        "median_during_persist_x": round(statistics.median(during), 3) if during else None,
        "over_1_1x_during_persist": sum(r > 1.1 for r in during),
        "stall_x": [round(s, 2) for s in stalls],
        "persist_s": [round(s, 3) for s in got["persists"]],
        "persists_untimed": got["untimed"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=72)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=40)
    ap.add_argument("--tail", type=int, default=20, help="updates after the last save")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="thread,process")
    ap.add_argument("--dir", default=None, help="where the runs are written (a local disk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    out: dict[str, Any] = {
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "state_bytes": args.layers * 3 * (args.width * args.width + args.width) * 4,
    }
    base = Path(tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir))
    rows = []
    try:
        for r in range(args.rounds):
            for v in variants:
                folder = base / f"r{r}-{v}"
                (folder / "code").mkdir(parents=True)
                row = summarize(v, launch(v, folder, args))
                row["round"] = r
                rows.append(row)
                print(f"[bench] {json.dumps(row)}", flush=True)
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out["rows"] = rows
    out["load_after"] = os.getloadavg()
    print(f"[bench] load {out['load_before']} -> {out['load_after']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
