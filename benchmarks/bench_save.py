"""Checkpoint save and load against their floors and the peers, on one state, in one process (issue 11).

The state: `--layers` x Linear(width, width) + AdamW (one step taken, so the optimizer holds its moments), under
DDP on one rank. Measured in the same run, in this order:
- floors: the copy of the state into host buffers allocated once (pinned on a GPU); a write+fsync of those bytes
  (one stream and --files streams); a cold read of them (pages dropped with posix_fadvise); SHA-256 on one thread
  and on --files threads;
- peers: torch.save + fsync; DCP save; DCP async_save on a gloo group of its own (blocked / done, two saves);
- torch_checkpointing (meta-pytorch, if installed; buffered writes): two async saves (blocked / done), a cold load;
- torchrelay: a launch as the loop runs it (Run.open + track, then update / `due` / `save`), every update timed
  from the first (the host buffers are reserved after it): each of `--saves` saves' stall, time until committed
  against the multi-stream write floor, the page cache's dirty and writeback bytes at its start, the updates
  around it and during its persist; then one async and one `async_save: false` save of the same state (same
  bytes?), with `--old-launch` a
  launch whose buffers come from cudaHostAlloc (before issue 22);
- load: DCP load, cold; torchrelay resume (Run.open + run.track: verification included), cold.

`--only load` saves the state once each way and measures the loads alone (about two minutes for the 14.5 GB
state on the GPU host): the cold read of the checkpoint's own files, the host->device copies (pageable and
pinned), DCP load cold, and the torchrelay resume cold and warm with where its time goes (read+hash, parse,
copy into the tensors, summed over the threads that do them).

    torchrun --standalone --nproc_per_node=1 benchmarks/bench_save.py --device cpu --layers 8 --width 1024
    PYTHONPATH=src torchrun --standalone --nproc_per_node=1 benchmarks/bench_save.py --device cuda \\
        --backend nccl --layers 72 --width 4096 --batch 256 --dir /root/bench [--only load] \\
        [--saves 5 --save-every 150 --old-launch --skip torch.save]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import hashlib
import inspect
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from benchlib import drop_cache
from torch.distributed.checkpoint.state_dict import get_state_dict

import torchrelay as tr
from torchrelay.checkpoint import host_buffers, host_stage
from torchrelay.config.tuning import SaveTuning
from torchrelay.run import saver

GB = 1e9


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def loop_sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def settle(what: str) -> float:
    """Sync after the benchmark deleted `what`, so that its discards (a file system mounted with `discard` sends
    them with the next journal commit: 5.6-5.7 s for 14.5 GB on the H200 host) are not paid inside the next
    launch's first save; seconds it took."""
    t0 = time.perf_counter()
    os.sync()
    took = time.perf_counter() - t0
    print(f"[bench] settled after deleting {what}: sync {took:.3f} s", flush=True)
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--files", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="")
    ap.add_argument("--only", choices=["load"], default=None, help="measure the loads alone")
    ap.add_argument(
        "--read-streams",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[16],
        help="--only load: the resume's reads in flight per rank, one cold resume for each (e.g. 16,32)",
    )
    ap.add_argument("--saves", type=int, default=5, help="torchrelay saves in the timed launch")
    ap.add_argument("--save-every", type=int, default=150, help="updates between them (more than a persist)")
    ap.add_argument("--old-launch", action="store_true", help="and a launch with cudaHostAlloc'd buffers")
    ap.add_argument(
        "--peers-after",
        action="store_true",
        help="the peers after torchrelay's launch, so that none of their objects or buffers is in its process yet",
    )
    ap.add_argument(
        "--quick", action="store_true", help="no sync save (nor the check that its bytes are the same)"
    )
    ap.add_argument(
        "--launch",
        action="append",
        default=[],
        help="a launch before the main one: NAME:SAVES[:KNOB=VALUE,...] over SaveTuning's fields, SAVE_EVERY "
        f"({', '.join(LAUNCH_KNOBS)}), e.g. 'before:6:pin_by_register=0,pin_pace=1' (repeatable)",
    )
    ap.add_argument(
        "--first-probe",
        type=float,
        default=0.0,
        help="before the first launch: the loop alone after this many seconds idle (after the floors)",
    )
    ap.add_argument(
        "--plain-updates",
        type=int,
        default=60,
        help="updates of --first-probe's plain loop (its mean is the floor of each launch's lost time)",
    )
    ap.add_argument(
        "--plain-probe",
        type=float,
        default=0.0,
        help="before the main launch: the loop alone after this many seconds idle (update 1's own cost)",
    )
    ap.add_argument(
        "--skip",
        type=lambda text: set(filter(None, text.split(","))),
        default=set(),
        help="peers left out: torch.save,dcp,dcp-async,torch_checkpointing",
    )
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    base, manifest, model, ddp, opt = make_state(args, "bench-save-")
    x = torch.randn(args.batch, args.width, device=dev)

    def update() -> float:
        # the loop's own stream, as a loop's `loss.item()` waits for it: copies a save left landing on a stream of
        # their own (SaveTuning.overlap_copy) are waited for by the step alone
        loop_sync(dev)
        t0 = time.perf_counter()
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loop_sync(dev)
        return time.perf_counter() - t0

    update()
    msd, osd = get_state_dict(ddp, opt)
    state = {"model": msd, "optim": osd}
    tensors = [t for t in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "cores": len(os.sched_getaffinity(0)),
        "layers": args.layers,
        "width": args.width,
        "dir": str(base),
    }
    print(f"[bench] state {nbytes / GB:.2f} GB in {len(tensors)} tensors; dir {base}", flush=True)
    if args.only == "load":
        loads_only(args, ddp, opt, state, tensors, base, manifest, out, nbytes)
        return

    # ---- floors
    pinned = dev == "cuda"
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

    def copy_all() -> None:
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t, non_blocking=pinned)
        sync(dev)

    copy_all()
    floor_copy = min(timed(copy_all, dev) for _ in range(2))
    views = [memoryview(h.view(-1).view(torch.uint8).numpy()) for h in host]

    def write_streams(n: int, sources: list[memoryview] | None = None, over: bool = False) -> float:
        """`n` files written at once, each fsynced; `over`: written over the files of the last call (no
        truncation: the blocks a retired checkpoint's spare files hold, checkpoint/recycle.py)."""
        folder = base / f"floor-{n}"
        folder.mkdir(exist_ok=over)
        parts: list[list[memoryview]] = [[] for _ in range(n)]
        for v in sorted(views if sources is None else sources, key=len, reverse=True):
            parts[min(range(n), key=lambda k: sum(len(p) for p in parts[k]))].append(v)

        def one(k: int) -> None:
            with open(folder / f"part-{k}", "r+b" if over else "wb") as f:
                for v in parts[k]:
                    f.write(v)
                f.flush()
                os.fsync(f.fileno())

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    disk_1 = write_streams(1)
    disk_n = write_streams(args.files)
    disk_over = write_streams(args.files, over=True)  # the floor of a save written over spare files
    out["disk_overwrite_streams_s"] = disk_over
    floor_write = min(disk_1, disk_n)
    shutil.rmtree(base / "floor-1")
    drop_cache(base / f"floor-{args.files}")

    def read_all(folder: Path, n: int) -> float:
        files = sorted(folder.iterdir())
        buf_size = 16 << 20

        def one(paths: list[Path]) -> None:
            buf = bytearray(buf_size)
            for p in paths:
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(files[k::n],)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    floor_read = read_all(base / f"floor-{args.files}", args.files)
    shutil.rmtree(base / f"floor-{args.files}")
    out["settle_after_floors_s"] = settle("the floors' files")

    def sha(n: int) -> float:
        chunks = [v[i : i + (64 << 20)] for v in views for i in range(0, len(v), 64 << 20)]

        def one(k: int) -> None:
            h = hashlib.sha256()
            for c in chunks[k::n]:
                h.update(c)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    sha_1, sha_n = sha(1), sha(args.files)
    views.clear()  # the host buffers go: the peers and torchrelay allocate their own
    host.clear()
    floors = {
        "host copy (buffers allocated once)": floor_copy,
        f"disk write+fsync (1 stream {nbytes / disk_1 / GB:.2f}, {args.files} streams {nbytes / disk_n / GB:.2f} GB/s)": floor_write,
        f"cold read ({args.files} streams)": floor_read,
        "SHA-256, 1 thread": sha_1,
        f"SHA-256, {args.files} threads": sha_n,
    }
    for k, v in floors.items():
        print(f"[bench] floor {k}: {v:.3f} s, {nbytes / v / GB:.2f} GB/s", flush=True)
    print(f"[bench] floor disk write+fsync over the same files: {disk_over:.3f} s", flush=True)

    # ---- peers
    peers: dict[str, float] = {}
    loads: dict[str, float] = {}

    def run_peers() -> None:
        """DCP and torch_checkpointing on the same state (before the launch, or after it: --peers-after)."""
        p = base / "peer.pt"

        def torch_save() -> None:
            with open(p, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        if "torch.save" not in args.skip:
            peers["torch.save + fsync"] = timed(torch_save, dev)
            p.unlink()
        dcp_dir = base / "dcp"
        if "dcp" not in args.skip:
            peers["DCP save"] = timed(lambda: dcp.save(state, checkpoint_id=str(dcp_dir)), dev)
            drop_cache(dcp_dir)
            loads["DCP load, cold"] = timed(lambda: dcp.load(state, checkpoint_id=str(dcp_dir)), dev)
            shutil.rmtree(dcp_dir)
        gloo = dist.new_group(backend="gloo")
        for i in (1, 2) if "dcp-async" not in args.skip else ():
            target = base / f"dcp-async-{i}"
            sync(dev)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=str(target), process_group=gloo)
            blocked = time.perf_counter() - t0
            fut.result()
            done = time.perf_counter() - t0
            peers[f"DCP async_save #{i}: caller blocked"] = blocked
            peers[f"DCP async_save #{i}: until done"] = done
            shutil.rmtree(target)

        if "torch_checkpointing" not in args.skip:
            torch_checkpointing_peer(state, base, dev, peers, loads)

    if not args.peers_after:
        run_peers()

    # ---- torchrelay
    relay: dict[str, float] = {}
    cfg = tr.RelayConfig(
        seed=0,
        micro_batch=1,
        total_updates=100000,
        save_every=args.save_every,
        manifest=str(manifest),
        keep=2,
    )
    # A launch as the loop runs it: the first update after Run.open + track (the host buffers are reserved after
    # it), `--saves` saves every `--save-every` updates, every update timed (bench_save's figure before issue 22
    # began after the buffers existed, and missed the 6-8 s the second update of a launch waited for them).
    from torchrelay.checkpoint.commit import wait_deletions

    plain_mean = None
    if args.first_probe:  # the loop alone right after the floors (a GPU idle that long): update 1's own cost
        out["first_probe"] = plain_probe(update, dev, args.first_probe, args.plain_updates)
        plain_mean = out["first_probe"]["mean_ms"] / 1e3
        print(f"[bench] plain loop before the launches: {json.dumps(out['first_probe'])}", flush=True)
    out["launches"] = {}
    for spec in args.launch:  # each a fresh Run: its buffers reserved again, its own knobs
        name, n_saves, knobs = parse_launch(spec)
        env = {k: v for k, v in knobs.items() if k.startswith("TORCHRELAY_")}
        env_before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        own = {k: v for k, v in knobs.items() if k not in env and k != "SAVE_EVERY"}
        try:
            cfg_v = cfg.replace(save_tuning=dataclasses.replace(cfg.save_tuning, **own))
            cfg_v = cfg_v.replace(save_every=knobs["SAVE_EVERY"]) if "SAVE_EVERY" in knobs else cfg_v
            run_v = tr.Run.open(base / f"run-{name}", cfg_v, code_dir=base / "code")
            run_v.track(model=ddp, optimizer=opt)
            var = Launch(run_v, update, dev)
            var.run(n_saves)
            out["launches"][name] = {"knobs": knobs, **var.report(floor_copy, disk_n, plain_mean, disk_over)}
            run_v._end_segment(var.done)
            run_v._saver.close()
            wait_deletions()
        finally:
            for k, was in env_before.items():
                if was is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = was
        shutil.rmtree(base / f"run-{name}", ignore_errors=True)
        out["launches"][name]["settle_after_s"] = settle(f"launch {name}'s run directory")
        print(f"[bench] launch {name}: {json.dumps(summary(out['launches'][name]))}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    if (
        args.plain_probe
    ):  # the loop alone after an idle as long as a launch's open: what update 1 costs by itself
        out["plain_probe"] = plain_probe(update, dev, args.plain_probe)
        print(
            f"[bench] plain loop after {args.plain_probe:g} s idle: {json.dumps(out['plain_probe'])}",
            flush=True,
        )
    t_open = time.perf_counter()
    run_a = tr.Run.open(base / "run-async", cfg, code_dir=base / "code")
    run_a.track(model=ddp, optimizer=opt)
    out["launch_open_s"] = round(time.perf_counter() - t_open, 3)
    launch = Launch(run_a, update, dev)
    launch.run(args.saves)
    out["launch"] = launch.report(floor_copy, disk_n, plain_mean, disk_over)
    print(f"[bench] launch (defaults): {json.dumps(summary(out['launch']))}", flush=True)
    if args.peers_after:  # in a process whose launch ran first, on memory no peer had touched
        run_peers()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    # The same state saved both ways (no update between): the tensor files and the RNG are the same bytes.
    last = launch.done
    relay["torchrelay async save (same state as the sync save): until committed"] = timed(
        lambda: (run_a._saver.save(last), run_a._saver.wait()), dev
    )
    wait_deletions()
    a_ckpt = base / "run-async" / f"checkpoint-{last}"
    same: bool | None = None
    if not args.quick:
        run_s = tr.Run.open(base / "run-sync", cfg.replace(async_save=False), code_dir=base / "code")
        run_s.track(model=ddp, optimizer=opt)
        relay["torchrelay sync save"] = timed(lambda: run_s._saver.save(last), dev)
        sync_ckpt = base / "run-sync" / f"checkpoint-{last}"
        names = sorted(str(f.relative_to(sync_ckpt)) for f in sync_ckpt.rglob("*") if f.is_file())
        same = names == sorted(str(f.relative_to(a_ckpt)) for f in a_ckpt.rglob("*") if f.is_file()) and all(
            _sha(sync_ckpt / rel) == _sha(a_ckpt / rel)
            for rel in names
            if rel.endswith(".distcp") or rel.startswith("rng/")
        )
        run_s._end_segment(last)
        shutil.rmtree(base / "run-sync")
    saved_bytes = tree_bytes(a_ckpt)
    run_a._end_segment(last)
    run_a._saver.close()
    out["sync_and_async_files_identical"] = same
    if args.old_launch:  # the same launch with the buffers from cudaHostAlloc (before issue 22), one save
        # torch keeps freed pinned blocks for reuse: the floors' and the peers' would serve this launch at once,
        # which is not what a fresh launch sees
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
        old_cfg = cfg.replace(
            save_every=40, save_tuning=dataclasses.replace(cfg.save_tuning, pin_by_register=False)
        )
        run_o = tr.Run.open(base / "run-old", old_cfg, code_dir=base / "code")
        run_o.track(model=ddp, optimizer=opt)
        old = Launch(run_o, update, dev)
        old.run(1)
        out["launch_cudaHostAlloc"] = old.report(floor_copy, disk_n)
        run_o._end_segment(old.done)
        run_o._saver.close()
        shutil.rmtree(base / "run-old")
    # the disk's floor again, after every save: a virtual disk's sustained rate may be below its burst rate
    again = [t.detach().cpu() for t in tensors]
    disk_after = write_streams(args.files, [memoryview(h.view(-1).view(torch.uint8).numpy()) for h in again])
    out["disk_overwrite_streams_after_s"] = write_streams(
        args.files, [memoryview(h.view(-1).view(torch.uint8).numpy()) for h in again], over=True
    )
    shutil.rmtree(base / f"floor-{args.files}")
    del again
    out["disk_write_streams_after_s"] = disk_after
    print(
        f"[bench] floor after the launches: write+fsync {args.files} streams {disk_after:.3f} s, over the same "
        f"files {out['disk_overwrite_streams_after_s']:.3f} s",
        flush=True,
    )
    # resume in this process, cold: Run.open verifies the inventory, run.track loads through DCP
    drop_cache(a_ckpt)
    sync(dev)
    t0 = time.perf_counter()
    run_r = tr.Run.open(base / "run-async", None, code_dir=base / "code")
    run_r.track(model=ddp, optimizer=opt)
    sync(dev)
    loads["torchrelay resume (open + track), cold"] = time.perf_counter() - t0
    run_r._end_segment(last)

    out.update(
        floors=floors,
        peers=peers,
        relay=relay,
        loads=loads,
        bytes=nbytes,
        checkpoint_bytes=saved_bytes,
        disk_write_streams_s=disk_n,
    )
    table(out, nbytes)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


# a launch's knobs: SaveTuning's fields, passed in the run's configuration (none patches the library)
LAUNCH_KNOBS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SaveTuning)}


def plain_probe(update: Callable[[], float], dev: str, idle: float, n: int = 60) -> dict[str, Any]:
    """The loop with no checkpointing after `idle` seconds of an idle GPU (a launch's Run.open leaves it idle
    that long): each of the first updates as a ratio to the median of `n`, and the mean update (the floor of a
    launch's time: what the loop takes without checkpointing, its own jitter included)."""
    sync(dev)
    time.sleep(idle)
    times = []
    last = time.perf_counter()
    for _ in range(n):
        update()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    med = statistics.median(times)
    return {
        "median_ms": round(med * 1e3, 2),
        "mean_ms": round(statistics.fmean(times) * 1e3, 3),
        "updates": n,
        "jitter_vs_median": round(statistics.fmean(times) / med, 4),
        "first_updates": [round(t / med, 3) for t in times[:4]],
        "over_1_1x": [i + 1 for i, t in enumerate(times) if t > 1.1 * med],
    }


def parse_launch(spec: str) -> tuple[str, int, dict[str, Any]]:
    """NAME:SAVES[:KNOB=VALUE,...] (VALUE an integer; 0/1 for the booleans; a TORCHRELAY_* knob is an environment
    variable set for that launch alone)."""
    name, saves, *rest = spec.split(":")
    knobs: dict[str, Any] = {}
    for part in filter(None, (rest[0] if rest else "").split(",")):
        key, _, value = part.partition("=")
        if key.startswith(
            "TORCHRELAY_"
        ):  # an environment variable for this launch (e.g. TORCHRELAY_PERSIST_WRITER)
            knobs[key] = value
            continue
        if key == "SAVE_EVERY":  # this launch's interval between saves (a first save before the buffers)
            knobs[key] = int(value)
            continue
        if key not in LAUNCH_KNOBS:
            raise SystemExit(f"--launch {spec!r}: {key!r} is not one of {', '.join(LAUNCH_KNOBS)}")
        current = LAUNCH_KNOBS[key]
        knobs[key] = (
            bool(int(value))
            if isinstance(current, bool)
            else float(value)
            if isinstance(current, float)
            else int(value)
        )
    return name, int(saves), knobs


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """A launch's figures in one line of the log (the full report is in the JSON)."""
    return {
        "median_ms": round(r["update_median_s"] * 1000, 1),
        "first": r["first_updates"],
        "ready_after": r["reserve_ready_update"],
        "over_1_1x_not_saving": r["over_1_1x_not_saving"][:30],
        "lost_s": round(r["lost_s"], 3),
        "lost_vs_saves_x_copy": round(r["lost_vs_saves_x_copy"], 2),
        "lost_vs_plain_x_copy": None
        if r.get("lost_vs_plain_x_copy") is None
        else round(r["lost_vs_plain_x_copy"], 2),
        "saves": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in save.items() if k not in ("around",)}
            for save in r["saves"]
        ],
        "gc_in_slow": r.get("gc_in_slow"),
        "reserve_steps": r.get("reserve_steps"),
        "gen2": r.get("gen2_detail"),
        "tracked_after": r.get("gc_tracked_after"),
        "frozen_at_start": r.get("frozen_at_start"),
        "first_dues": r.get("first_dues"),
        "first_due_s": r.get("first_due_s"),
    }


def _meminfo() -> dict[str, float]:
    """GB of page cache, dirty and under-writeback pages (Linux): what the disk still owes at a save's start."""
    got: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Cached", "Dirty", "Writeback", "MemFree", "MemTotal"):
                got[key] = int(rest.split()[0]) / 1e6
    return got


_PHASES: dict[str, float] | None = None  # the save in progress: seconds on the training thread, by phase
# (name, began, ended) of the persist's steps run on threads other than the training thread (persist_marks)
_MARKS: list[tuple[str, float, float]] = []


def _mark(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def marked(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if threading.current_thread() is not threading.main_thread():
                _MARKS.append((name, t, time.perf_counter()))

    return marked


@contextlib.contextmanager
def persist_marks() -> Any:
    """Record when each step of a persist ran on its thread (the write, the small files, the inventory, the
    renames' fsyncs, retention, the logs' fsync): a slow update names the steps it overlapped."""
    from torch.distributed.checkpoint import filesystem as dcp_filesystem

    from torchrelay.checkpoint import commit, dcp_save, storage, writer_process
    from torchrelay.checkpoint.state import save as state_save

    steps = [
        (saver, "_sync_logs", "logs_fsync"),
        (host_stage.HostStage, "finish_deferred", "finish_deferred"),
        (dcp_save.PlannedSave, "write", "dcp_write"),
        (dcp_filesystem._FileSystemWriter, "finish", "dcp_metadata"),
        (writer_process.WriterProcess, "write", "writer_wait"),
        (state_save, "write_bytes", "small_file"),
        (commit, "_complete_entries", "entries"),
        (commit, "write_inventory", "inventory"),
        (storage, "fsync_dir", "fsync_dir"),
        (commit, "retain", "retain"),
        (saver.Saver, "_committed", "committed_hook"),
        # the reservation's own work on its thread: a page fault pass, a registration (cudaHostRegister)
        (host_stage, "touch", "reserve_touch"),
        (host_buffers.Locked, "register_range", "reserve_register"),
    ]
    kept = []
    for owner, attr, name in steps:
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        new = _mark(name, getattr(owner, attr))
        setattr(owner, attr, staticmethod(new) if isinstance(old, staticmethod) else new)
        kept.append((owner, attr, old))
    try:
        yield
    finally:
        for owner, attr, old in kept:
            setattr(owner, attr, old)


def _phase(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if _PHASES is not None:
                _PHASES[name] = _PHASES.get(name, 0.0) + time.perf_counter() - t

    return timed_call


@contextlib.contextmanager
def stall_phases() -> Any:
    """Time each part of a save's stall on the training thread (the functions the Saver calls, wrapped for the
    launch's length): the state dict, the copies issued, the RNG, DCP's plan, the writer's job, the wait for the
    copies to land, the logs."""
    from torchrelay.checkpoint import dcp_save
    from torchrelay.checkpoint.state import rng
    from torchrelay.checkpoint.state import save as state_save
    from torchrelay.records.train import RankLog

    # (where, what, the phase it counts as): each replaced by a timed call of itself for the launch's length
    timed = [
        (state_save, "state_dicts", "state_dict"),
        (host_stage.HostStage, "copy_tree", "copies_issued"),
        (rng, "capture", "rng"),
        (state_save.Snapshot, "plan", "plan"),
        (dcp_save.PlannedSave, "prepare", "job"),
        (host_stage.HostStage, "synchronize", "copies_land"),
        (RankLog, "sync_later", "logs"),
        (saver.ckpt_state, "reserve", "reserve"),
        (saver.Saver, "_start_writer", "writer_start"),
        (gc, "collect", "gc_collect"),
    ]
    kept = []
    for owner, attr, name in timed:
        old = (
            owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        )  # a staticmethod stays one
        new = _phase(name, getattr(owner, attr))
        setattr(owner, attr, staticmethod(new) if isinstance(old, staticmethod) else new)
        kept.append((owner, attr, old))
    try:
        yield
    finally:
        for owner, attr, old in kept:
            setattr(owner, attr, old)


class Launch:
    """A training loop as torchrelay's runs it: update, `due`, `save` when due; every update timed (end to end,
    the save included in the update that holds it), and each save's stall and time until committed."""

    def __init__(self, run: Any, update: Callable[[], float], dev: str) -> None:
        self.saver, self.update, self.dev = run._saver, update, dev
        self.times: list[float] = []  # seconds from one update's end to the next's
        self.kind: list[str] = []  # "save" (held a save's stall), "persist" (a persist in flight), ""
        self.saves: list[dict[str, Any]] = []
        self.committed: dict[int, float] = {}
        self.done = 0
        self.reserve_ready_update: int | None = None
        self.ends: list[float] = []  # when each update ended (perf_counter)
        self.first_due_s = 0.0
        self.first_dues: list[dict[str, float]] = []  # the first 4 updates' due(): seconds, and ms by part
        self.gc_events: list[
            tuple[float, float, int, str]
        ] = []  # (start, end, generation, thread) of collections
        self._gc_open: dict[int, float] = {}
        # full collections: (seconds, thread, objects collected, objects frozen at the time): what a long one walked
        self.gen2_info: list[tuple[float, str, int, int]] = []

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._gc_open[ident] = time.perf_counter()
        elif ident in self._gc_open:
            if int(info.get("generation", -1)) == 2:
                began = self._gc_open[ident]
                self.gen2_info.append(
                    (
                        round(time.perf_counter() - began, 4),
                        threading.current_thread().name,
                        int(info.get("collected", -1)),
                        gc.get_freeze_count(),
                    )
                )
            self.gc_events.append(
                (
                    self._gc_open.pop(ident),
                    time.perf_counter(),
                    int(info.get("generation", -1)),
                    threading.current_thread().name,
                )
            )

    def run(self, saves: int, after: int = 20) -> None:
        # objects the process froze before the launch (not the Saver)
        self.frozen_at_start = gc.get_freeze_count()
        _MARKS.clear()
        gc.callbacks.append(self._on_gc)
        try:
            with stall_phases(), persist_marks():
                self._run(saves, after)
        finally:
            gc.callbacks.remove(self._on_gc)

    def _run(self, saves: int, after: int) -> None:
        target = len(self.saves) + saves
        extra = after
        last = time.perf_counter()
        while extra > 0:
            self.update()
            self.done += 1
            kind = "persist" if self.saver.persisting else ""
            global _PHASES
            if self.done <= 4:
                _PHASES = {}
            t_due = time.perf_counter()
            due = len(self.saves) < target and self.saver.due(self.done)
            if self.done == 1:
                self.first_due_s = time.perf_counter() - t_due  # the reservation's start, on this thread
            if (
                self.done <= 4
            ):  # what the first updates' due() did on this thread (freeze, reservation, writer)
                self.first_dues.append(
                    {
                        "s": round(time.perf_counter() - t_due, 4),
                        **{k: round(v * 1e3, 2) for k, v in _PHASES.items()},
                    }
                )
                _PHASES = None
            if due:
                info = {"update": self.done, "at": len(self.times), **_meminfo()}
                _PHASES = {}
                t0 = time.perf_counter()
                self.saver.save(self.done)
                info["stall_s"], info["t0"] = time.perf_counter() - t0, t0
                # copies left to the persist (SaveTuning.spill_to_device): buffers not obtained by this save
                info["deferred"] = self.saver._stage.deferred
                info["phases_ms"] = {k: round(v * 1e3, 2) for k, v in _PHASES.items()}
                _PHASES = None
                self.saves.append(info)
                kind = "save"
            now = time.perf_counter()
            self.times.append(now - last)
            self.ends.append(now)
            self.kind.append(kind)
            last = now
            stage = self.saver._stage
            if self.reserve_ready_update is None and self.saver._reserved and stage.ready:
                self.reserve_ready_update = self.done
            pending = [s for s in self.saves if s["update"] not in self.committed]
            if pending and not self.saver.persisting:
                self.saver.wait()
                for s in pending:
                    self.committed[s["update"]] = now - s["t0"]
            if len(self.saves) >= target and not self.saver.persisting:
                extra -= 1
        sync(self.dev)

    def report(
        self,
        floor_copy: float,
        floor_write: float,
        plain_mean: float | None = None,
        floor_over: float | None = None,
    ) -> dict[str, Any]:
        med = statistics.median(t for t, k in zip(self.times, self.kind, strict=True) if k != "save")
        ratios = [t / med for t in self.times]
        plain = [(i, r) for i, (r, k) in enumerate(zip(ratios, self.kind, strict=True)) if k != "save"]
        saves = []
        ends = [s["at"] for s in self.saves[1:]] + [len(ratios)]
        t0s = [s["t0"] for s in self.saves[1:]] + [float("inf")]
        for s, end, nxt in zip(self.saves, ends, t0s, strict=True):
            i = s["at"]
            during = [ratios[j] for j in range(i + 1, end) if self.kind[j] == "persist"]
            done_s = self.committed.get(s["update"], float("nan"))
            saves.append(
                {
                    "update": s["update"],
                    "stall_s": s["stall_s"],
                    "stall_vs_copy": s["stall_s"] / floor_copy,
                    "held_update_ratio": ratios[i],
                    "committed_s": done_s,
                    "persist_vs_write_floor": floor_write / done_s,
                    # against the same write over existing files (a save over a retired checkpoint's spare)
                    "persist_vs_overwrite_floor": floor_over / done_s if floor_over else None,
                    "updates_during_persist": len(during),
                    "max_during_persist": max(during, default=float("nan")),
                    "over_1_1x_during_persist": sum(r > 1.1 for r in during),
                    "around": [round(r, 3) for r in ratios[max(0, i - 2) : i + 12]],
                    "phases_ms": s.get("phases_ms"),
                    "deferred": s.get("deferred"),
                    # the persist's copies of them into their buffers, once obtained (HostStage.finish_deferred)
                    "finish_deferred_s": round(
                        sum(
                            e - b for name, b, e in _MARKS if name == "finish_deferred" and s["t0"] <= b < nxt
                        ),
                        4,
                    ),
                    "cached_gb": s.get("Cached"),
                    "dirty_gb": s.get("Dirty"),
                    "writeback_gb": s.get("Writeback"),
                }
            )
        lost = sum(self.times) - len(self.times) * med
        gc_in_slow = []  # the slow updates (not holding a save) and the collections that overlapped them
        for i, r in plain:
            if r <= 1.1:
                continue
            start, end = self.ends[i] - self.times[i], self.ends[i]
            hits = [
                (round(min(e, end) - max(b, start), 4), g, name)
                for b, e, g, name in self.gc_events
                if b < end and e > start and e - b > 0.002
            ]
            steps = [
                (name, round(min(e, end) - max(b, start), 4))
                for name, b, e in _MARKS
                if b < end and e > start
            ]
            gc_in_slow.append(
                {"update": i + 1, "x": round(r, 3), "kind": self.kind[i], "gc": hits, "persist_steps": steps}
            )
        reserve = {}  # the reservation's steps: how many, their total and longest seconds, the longest's update
        for step in ("reserve_touch", "reserve_register"):
            spans = [(e - b, b) for name, b, e in _MARKS if name == step]
            if spans:
                longest, began = max(spans)
                at = next((i + 1 for i, end in enumerate(self.ends) if end > began), None)
                reserve[step] = [len(spans), round(sum(d for d, _ in spans), 3), round(longest, 4), at]
        gen2 = [(round(e - b, 4), name) for b, e, g, name in self.gc_events if g == 2]
        tracked = collections.Counter(type(o).__name__ for o in gc.get_objects())  # the unfrozen ones
        return {
            "gen2_detail": self.gen2_info,
            "gc_tracked_after": {"frozen": gc.get_freeze_count(), "top": tracked.most_common(8)},
            "frozen_at_start": getattr(self, "frozen_at_start", None),
            "first_dues": self.first_dues,
            "gc_in_slow": gc_in_slow,
            "reserve_steps": reserve,
            "first_due_s": self.first_due_s,
            "gen2_collections": gen2,
            "update_median_s": med,
            "updates": len(self.times),
            "first_updates": [round(r, 3) for r in ratios[:6]],
            "reserve_ready_update": self.reserve_ready_update,
            "max_not_saving": max(r for _, r in plain),
            "over_1_1x_not_saving": [(i + 1, round(r, 3)) for i, r in plain if r > 1.1],
            "lost_s": lost,
            "lost_vs_saves_x_copy": lost / (len(self.saves) * floor_copy) if self.saves else float("nan"),
            # against the plain loop's mean update measured in the same call (its own jitter and update 1 in it):
            # what the loop took beyond what it takes without checkpointing
            "lost_vs_plain_s": None if plain_mean is None else sum(self.times) - len(self.times) * plain_mean,
            "lost_vs_plain_x_copy": None
            if plain_mean is None or not self.saves
            else (sum(self.times) - len(self.times) * plain_mean) / (len(self.saves) * floor_copy),
            "saves": saves,
            "ratios": [round(r, 3) for r in ratios],  # every update, x the median
        }


def torch_checkpointing_peer(
    state: dict[str, Any], base: Path, dev: str, peers: dict[str, float], loads: dict[str, float]
) -> None:
    """torch_checkpointing (meta-pytorch; torchtitan's new backend) as a peer: two async saves (blocked: until
    its staging is done, as `manager.lock()` around the optimizer step waits; done: the write future) and a cold
    load. 0.1.1's O_DIRECT writes fail with EINVAL on ext4: buffered I/O (`use_direct_io=False`)."""
    try:
        import torch_checkpointing as tc
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError:
        print("[bench] torch_checkpointing is not installed: its rows are skipped", flush=True)
        return
    mgr = tc.CheckpointManager(
        tc.CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    )
    payload = {"model": state["model"], "optim": state["optim"]}
    for i in (1, 2):
        target = base / f"tc-{i}"
        sync(dev)
        t0 = time.perf_counter()
        fut = mgr.save(str(target), payload)
        staging = getattr(mgr, "_staging_future", None)
        if staging is not None:
            staging.result()
        blocked = time.perf_counter() - t0
        if fut is not None:
            fut.result()
        done = time.perf_counter() - t0
        peers[f"torch_checkpointing save #{i}: caller blocked"] = blocked
        peers[f"torch_checkpointing save #{i}: until done"] = done
        print(f"[bench] torch_checkpointing #{i}: blocked {blocked:.3f} s, done {done:.3f} s", flush=True)
        if i == 2:
            shutil.rmtree(target)
    first = base / "tc-1"
    drop_cache(first)
    loads["torch_checkpointing load, cold"] = timed(lambda: mgr.load(str(first), into=payload), dev)
    mgr.close()
    shutil.rmtree(first)


def cold_read(files: list[Path], streams: int, direct: bool = False) -> float:
    """The floor of a load: every file read once, `streams` at a time, one thread each, in 16 MiB reads into a
    reused buffer, after the pages dropped. `direct`: by O_DIRECT (Linux), past the page cache, into a
    page-aligned buffer (a file's last block read whole)."""
    for f in files:
        drop_cache(f)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def one(paths: list[Path]) -> None:
        buf = mmap.mmap(-1, 16 << 20) if direct else bytearray(16 << 20)
        for p in paths:
            fd = os.open(p, flags)
            try:
                offset = 0
                while n := os.preadv(fd, [buf], offset):
                    offset += n
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(files[k::streams],)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def make_state(
    args: argparse.Namespace, prefix: str
) -> tuple[Path, Path, nn.Module, nn.Module, torch.optim.Optimizer]:
    """A fresh folder under --dir with a run's code folder and a 1,000-line manifest, and the benchmark's state:
    --layers x Linear(width, width) on --device under DDP, with AdamW (no step taken yet)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    (base / "code").mkdir()
    manifest = base / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": str(i)}) + "\n" for i in range(1000)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(args.device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    return base, manifest, model, ddp, opt


def save_once(
    base: Path,
    manifest: Path,
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    dev: str,
    tuning: SaveTuning | None = None,
) -> tuple[Path, list[Path], float]:
    """checkpoint-1 of base/run, saved inline by torchrelay: its folder, its tensor files, the seconds it took."""
    cfg = tr.RelayConfig(
        seed=0,
        micro_batch=1,
        total_updates=1000,
        save_every=1000,
        manifest=str(manifest),
        async_save=False,
        save_tuning=tuning or SaveTuning(),
    )
    run = tr.Run.open(base / "run", cfg, code_dir=base / "code")
    run.track(model=ddp, optimizer=opt)
    seconds = timed(lambda: run._saver.save(1), dev)
    run._end_segment(1)
    ckpt = base / "run" / "checkpoint-1"
    return ckpt, sorted((ckpt / "model").glob("*.distcp")), seconds


def load_with_stats(plain_load: Callable[..., set[str]], phases: dict[str, float]) -> Callable[..., set[str]]:
    """dcp_io.load that leaves in `phases` where its time went (its own timings) and its wall time."""
    with_stats = (
        "stats" in inspect.signature(plain_load).parameters
    )  # not in the code before 2026-11-30 19:00

    def load(*a: Any, **k: Any) -> set[str]:
        phases.clear()
        t0 = time.perf_counter()
        try:
            return plain_load(*a, **({"stats": phases} if with_stats else {}), **k)
        finally:
            phases["wall"] = time.perf_counter() - t0

    return load


def loads_only(
    args: argparse.Namespace,
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    tensors: list[torch.Tensor],
    base: Path,
    manifest: Path,
    out: dict[str, Any],
    nbytes: int,
) -> None:
    from torchrelay.checkpoint import dcp_io

    dev = args.device
    rows: dict[str, float] = {}
    # host->device (or host->host on CPU): the copy every load ends with, from pageable and from pinned memory
    for pinned in (False, True) if dev == "cuda" else (False,):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned).copy_(t) for t in tensors]
        t0 = time.perf_counter()
        with torch.no_grad():
            for h, t in zip(host, tensors, strict=True):
                t.copy_(h, non_blocking=pinned)
        sync(dev)
        rows[f"floor: copy into the tensors from {'pinned' if pinned else 'pageable'} host memory"] = (
            time.perf_counter() - t0
        )
        del host
    ckpt, files, t_save = save_once(base, manifest, ddp, opt, dev)
    print(
        f"[bench] torchrelay save {t_save:.1f} s: {len(files)} files, largest "
        f"{max(f.stat().st_size for f in files) / GB:.2f} GB",
        flush=True,
    )
    dcp_dir = base / "dcp"
    dcp.save(state, checkpoint_id=str(dcp_dir))
    rows[f"floor: cold read of the checkpoint's {len(files)} files, {args.files} streams"] = cold_read(
        files, args.files
    )
    drop_cache(dcp_dir)
    rows["DCP load, cold"] = timed(lambda: dcp.load(state, checkpoint_id=str(dcp_dir)), dev)
    shutil.rmtree(dcp_dir)

    phases: dict[str, float] = {}
    plain_load = dcp_io.load
    dcp_io.load = load_with_stats(plain_load, phases)  # type: ignore[assignment]  # the resume's breakdown
    breakdown: dict[str, dict[str, float]] = {}
    runs = [("cold", streams) for streams in args.read_streams] + [("warm", args.read_streams[0])]
    for how, streams in runs:
        if len(args.read_streams) > 1:
            how = f"{how}, {streams} reads in flight"
        if how.startswith("cold"):
            drop_cache(ckpt)
        sync(dev)
        t0 = time.perf_counter()
        # the reads in flight: a runtime field of the run's configuration (LoadTuning)
        tuned = {"load_tuning.read_streams": streams}
        run = tr.Run.open(base / "run", None, code_dir=base / "code", overrides=tuned)
        t_open = time.perf_counter() - t0
        run.track(model=ddp, optimizer=opt)
        sync(dev)
        rows[f"torchrelay resume (open + track), {how}"] = time.perf_counter() - t0
        run._end_segment(1)
        breakdown[how] = {"Run.open": t_open, **phases}
    dcp_io.load = plain_load  # type: ignore[assignment]
    out.update(loads=rows, breakdown=breakdown, bytes=nbytes, checkpoint_files=len(files))
    f_read = rows[next(k for k in rows if k.startswith("floor: cold read"))]
    lines = [
        f"state {nbytes / GB:.2f} GB, torch {out['torch']}, {out['device']}, {out['cores']} cores",
        "| what | s | GB/s | vs cold read | vs DCP load |",
        "|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        vs = "" if name.startswith("floor") else f"{f_read / s:.2f} (goal >= 0.85)"
        peer = "" if name.startswith("floor") else f"{s / rows['DCP load, cold']:.2f}x"
        lines.append(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {vs} | {peer} |")
    for how, b in breakdown.items():
        lines.append(
            f"resume {how}: Run.open {b['Run.open']:.2f} s; DCP load through torchrelay {b.get('wall', 0):.2f} s "
            f"wall, of thread time: read {b.get('read', 0):.2f} s, hash {b.get('hash', 0):.2f} s, parse "
            f"{b.get('parse', 0):.2f} s, copy into the tensors {b.get('copy', 0):.2f} s"
        )
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def table(out: dict[str, Any], nbytes: int) -> None:
    floors, peers, relay, loads = out["floors"], out["peers"], out["relay"], out["loads"]
    f_copy, f_write, f_read = list(floors.values())[:3]
    f_streams = out["disk_write_streams_s"]
    lines = [
        f"state {nbytes / GB:.2f} GB, torch {out['torch']}, {out['device']}, {out['cores']} cores",
        "| what | s | GB/s | vs floor |",
        "|---|---|---|---|",
    ]
    for name, s in floors.items():
        lines.append(f"| floor: {name} | {s:.3f} | {nbytes / s / GB:.2f} | |")
    for name, s in {**peers, **relay}.items():
        ratio = (
            f"{s / f_copy:.2f}x the host copy"
            if "blocked" in name
            else f"{f_streams / s:.2f} of the multi-stream disk write"
        )
        lines.append(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {ratio} |")
    for name, s in loads.items():
        lines.append(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {f_read / s:.2f} of the cold read |")
    lines.append(f"sync and async checkpoints hold identical files: {out['sync_and_async_files_identical']}")
    for key in ("launch", "launch_cudaHostAlloc"):
        if key not in out:
            continue
        r = out[key]
        lines += [
            f"{key}: {r['updates']} updates, median {r['update_median_s'] * 1000:.1f} ms; first updates "
            f"{r['first_updates']} x median; buffers ready after update {r['reserve_ready_update']}; not saving: "
            f"max {r['max_not_saving']:.2f}x, over 1.1x {r['over_1_1x_not_saving']}; lost {r['lost_s']:.3f} s = "
            f"{r['lost_vs_saves_x_copy']:.2f} x (saves x the copy floor)",
            f"reservation steps [count, total s, longest s, its update]: {r.get('reserve_steps')}; slow updates "
            f"and what overlapped them (first 12): {(r.get('gc_in_slow') or [])[:12]}",
            "| save at | stall s | vs copy | committed s | vs write floor | vs overwrite floor | updates in persist "
            "| max | > 1.1x | "
            "cached / dirty / writeback GB at start | updates around (x median, from 2 before) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in r["saves"]:
            lines.append(
                f"| {v['update']} | {v['stall_s']:.3f} | {v['stall_vs_copy']:.2f}x | {v['committed_s']:.3f} | "
                f"{v['persist_vs_write_floor']:.2f} | {v.get('persist_vs_overwrite_floor') or float('nan'):.2f} | "
                f"{v['updates_during_persist']} | "
                f"{v['max_during_persist']:.2f}x | {v['over_1_1x_during_persist']} | "
                f"{v['cached_gb'] or 0:.1f} / {v['dirty_gb'] or 0:.2f} / {v['writeback_gb'] or 0:.2f} | "
                f"{v['around']} |"
            )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
