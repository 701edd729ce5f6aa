"""Garbage collections during a persist: what they walk, how long they stop the loop, on which thread.

A real torchrelay loop (Run.open, track, run.steps over run.dataloader, async_save) on a state shaped like the H200
one (--layers x Linear(width, width) + AdamW: 144 parameters and 432 optimizer tensors at 72 layers), with torch
and (by default) transformers imported, as a Trainer's process has them. Each variant of the collector's handling
runs its own launch, alternating within one process, `--rounds` times; every collection is recorded through
gc.callbacks (generation, seconds, thread, objects a full collection walked), and every update of the training
thread is timed. The figures that do not depend on the machine's load: the objects a full collection walks and
how many full collections a persist saw; the seconds are this machine's.

Variants (`--variants`):
- `off`: the collector as the process has it (torchrelay before issue 22's GC work).
- `freeze`: SaveTuning.freeze_gc: the heap frozen after the segment's first update, unfrozen at close (kept).
- `defer`: no full collection during a persist (the generation-2 threshold raised while one is in flight, put back
  by the training thread after it): a candidate, not kept.
- `disable`: gc.disable() while a persist is in flight, enabled again by the training thread after it: a
  candidate, not kept.

`PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_persist_gc.py --json out.json`
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchrelay as tr
from torchrelay.config.tuning import SaveTuning

VARIANTS = ("off", "freeze", "defer", "disable")


class Recorder:
    """Every collection of the process while armed: (start, end, generation, thread, walked, collected, in a
    persist). `walked` (full collections only) is counted after the end is taken: the survivors plus the
    collected, what the collection traversed; the counting's own time is kept apart (`counting_s`)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.persisting = lambda: False
        self.update = 0  # the training thread's update in progress (0: before the first)
        self._open: dict[int, float] = {}
        self.counting_s = 0.0  # seconds the counting held the GIL since the loop last took it

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._open[ident] = time.perf_counter()
            return
        start = self._open.pop(ident, None)
        if start is None:
            return
        end = time.perf_counter()
        gen = int(info.get("generation", -1))
        walked = None
        if gen == 2:
            walked = len(gc.get_objects(generation=2)) + int(info.get("collected", 0))
            self.counting_s += time.perf_counter() - end
        self.events.append(
            {
                "start": start,
                "end": end,
                "s": end - start,
                "gen": gen,
                "thread": threading.current_thread().name,
                "collected": int(info.get("collected", 0)),
                "walked": walked,
                "persist": self.persisting(),
                "update": self.update,
            }
        )


def build_state(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def launch(variant: str, base: Path, args: argparse.Namespace, rec: Recorder) -> dict[str, Any]:
    """One segment of a run under `variant`: every update timed, every collection recorded."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    total = args.saves * args.save_every + args.tail
    manifest = base / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(total + 8)))
    cfg = tr.RelayConfig(
        seed=0,
        micro_batch=1,
        total_updates=total,
        save_every=args.save_every,
        manifest=str(manifest),
        keep=2,
        save_tuning=SaveTuning(freeze_gc=variant == "freeze"),
    )
    model, opt = build_state(args.layers, args.width)
    x = torch.randn(8, args.width)
    run = tr.Run.open(base / f"run-{variant}", cfg, code_dir=base / "code")
    saver = run._saver
    rec.persisting = lambda: saver.persisting
    times: list[float] = []
    kinds: list[str] = []  # "save": the update held a save's stall; "persist": one was in flight; ""
    deferred = False
    walks: list[int] = []  # at each persist's start: the objects any full collection during it would walk
    last_saved = saver.last
    rec.events.clear()
    try:
        run.track(model=model, optimizer=opt)
        loader = run.dataloader(list(range(len(run.manifest))))
        prev = None
        for step in run.steps(loader):
            now = time.perf_counter()
            # Counting the objects a full collection walked held the GIL too: taken off the update it fell in.
            counted, rec.counting_s = rec.counting_s, 0.0
            saved = saver.last != last_saved
            last_saved = saver.last
            # the previous update, from its start to this one's: `due` and `save` included
            if prev is not None:
                times.append(now - prev[0] - counted)
                kinds.append("save" if saved else prev[1])
            persisting = saver.persisting
            if saved:  # a persist has just started
                t0 = time.perf_counter()
                walks.append(len(gc.get_objects()))  # generations 0-2, what gc.freeze() leaves out excluded
                rec.counting_s += time.perf_counter() - t0
            if variant in ("defer", "disable"):
                if persisting and not deferred:  # the training thread's choice, as the Saver would make it
                    deferred = True
                    if variant == "defer":
                        gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
                    else:
                        gc.disable()
                elif not persisting and deferred:
                    deferred = False
                    gc.set_threshold(*thresholds)
                    if enabled:
                        gc.enable()
            prev = (now, "persist" if persisting else "")
            rec.update = step.update
            for _, _batch in step.micro_batches(model):
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        run.close()
        gc.set_threshold(*thresholds)
        if enabled:
            gc.enable()
    events = list(rec.events)
    rec.update = 0
    # what the freeze held until the close (and what any variant left uncollected), with the heap as it is now
    held = gc.collect()
    return {"times": times, "kinds": kinds, "events": events, "collected_after_close": held, "walks": walks}


def _role(thread: str) -> str:
    if thread == "MainThread":
        return "training"
    if thread.startswith("torchrelay-persist"):
        return "persist"
    return "reserve" if thread == "torchrelay-reserve" else "writer"


def summarize(variant: str, got: dict[str, Any]) -> dict[str, Any]:
    times, kinds, events = got["times"], got["kinds"], got["events"]
    med = statistics.median(t for t, k in zip(times, kinds, strict=True) if k != "save")
    during = [t / med for t, k in zip(times, kinds, strict=True) if k == "persist"]
    full = [e for e in events if e["gen"] == 2]
    full_p = [e for e in full if e["persist"]]
    by_thread: dict[str, dict[int, int]] = {}  # collections during persists, by thread, by generation
    for e in events:
        if e["persist"]:
            name = _role(e["thread"])
            counts = by_thread.setdefault(name, {0: 0, 1: 0, 2: 0})
            counts[e["gen"]] += 1
    return {
        "variant": variant,
        "updates": len(times),
        "update_median_ms": round(med * 1000, 2),
        "updates_during_persist": len(during),
        "worst_during_persist_x": round(max(during, default=float("nan")), 3),
        "median_during_persist_x": round(statistics.median(during), 3) if during else None,
        "over_1_1x_during_persist": sum(r > 1.1 for r in during),
        "collections_during_persist": {
            g: sum(e["gen"] == g and e["persist"] for e in events) for g in (0, 1, 2)
        },
        "pause_s_during_persist": {
            g: round(sum(e["s"] for e in events if e["gen"] == g and e["persist"]), 4) for g in (0, 1, 2)
        },
        # (update, seconds, objects walked, of which collected, thread)
        "full_during_persist": [
            (e["update"], round(e["s"], 4), e["walked"], e["collected"], e["thread"]) for e in full_p
        ],
        "full_outside_persist": [
            (e["update"], round(e["s"], 4), e["walked"], e["collected"], e["thread"])
            for e in full
            if not e["persist"]
        ],
        "by_thread_during_persist": by_thread,
        "collected_after_close": got["collected_after_close"],
        "full_walk_at_persist_start": got["walks"],
        "longest_pause_s": round(max((e["s"] for e in events), default=0.0), 4),
    }


def full_collection_cost() -> dict[str, Any]:
    """A full collection of this process's heap (torch, transformers when imported, the benchmark): its objects
    and seconds, three times; then the same after gc.freeze()."""
    out: dict[str, Any] = {"objects": len(gc.get_objects())}
    secs = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        secs.append(time.perf_counter() - t0)
    out["full_s"] = [round(s, 4) for s in secs]
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    out["frozen_full_s"] = round(time.perf_counter() - t0, 5)
    out["frozen_objects_walked"] = len(gc.get_objects())
    gc.unfreeze()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=72)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--tail", type=int, default=10, help="updates after the last save")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="off,freeze")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if not args.no_transformers:
        import transformers  # noqa: F401 - its modules are part of a Trainer's heap
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: F401

    out: dict[str, Any] = {"argv": sys.argv[1:], "load_before": os.getloadavg(), "cpus": os.cpu_count()}
    out["full_collection"] = full_collection_cost()
    print(f"[bench] full collection: {out['full_collection']}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="bench-gc-", dir=args.dir))
    (base / "code").mkdir()
    rec = Recorder()
    gc.callbacks.append(rec)
    rows = []
    try:
        for r in range(args.rounds):
            for v in variants:
                folder = base / f"r{r}-{v}"
                folder.mkdir()
                (folder / "code").mkdir()
                got = launch(v, folder, args, rec)
                row = summarize(v, got)
                row["round"] = r
                rows.append(row)
                print(f"[bench] {json.dumps(row)}", flush=True)
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        gc.callbacks.remove(rec)
        shutil.rmtree(base, ignore_errors=True)
    out["rows"] = rows
    out["load_after"] = os.getloadavg()
    print(f"[bench] load {out['load_before']} -> {out['load_after']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
