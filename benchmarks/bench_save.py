"""Checkpoint save and load against their floors and the peers, on one state, in one process (issue 11).

The state: `--layers` x Linear(width, width) + AdamW (one step taken, so the optimizer holds its moments), under
DDP on one rank. Measured in the same run, in this order:
- floors: the copy of the state into host buffers allocated once (pinned on a GPU); a write+fsync of those bytes
  (one stream and --files streams); a cold read of them (pages dropped with posix_fadvise); SHA-256 on one thread
  and on --files threads;
- peers: torch.save + fsync; DCP save; DCP async_save on a gloo group of its own (blocked / done, two saves);
- torchrelay: a save with `async_save: false`, and two with the default (the loop's stall, and until committed),
  and the update time while a background persist runs against updates without one;
- load: DCP load, cold; torchrelay resume (Run.open + run.track: verification included), cold.

`--only load` saves the state once each way and measures the loads alone (about two minutes for the 14.5 GB
state on the GPU host): the cold read of the checkpoint's own files, the host->device copies (pageable and
pinned), DCP load cold, and the torchrelay resume cold and warm with where its time goes (read+hash, parse,
copy into the tensors, summed over the threads that do them).

    torchrun --standalone --nproc_per_node=1 benchmarks/bench_save.py --device cpu --layers 8 --width 1024
    PYTHONPATH=src torchrun --standalone --nproc_per_node=1 benchmarks/bench_save.py --device cuda \\
        --backend nccl --layers 72 --width 4096 --batch 256 --dir /root/bench [--only load]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
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
from torch.distributed.checkpoint.state_dict import get_state_dict

import torchrelay as tr

GB = 1e9


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def drop_cache(root: Path) -> None:
    """Cold-ish: ask the kernel to drop the (clean, fsynced) pages of every file under root."""
    for path in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    base, manifest, model, ddp, opt = make_state(args, "bench-save-")
    x = torch.randn(args.batch, args.width, device=dev)

    def update() -> float:
        sync(dev)
        t0 = time.perf_counter()
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync(dev)
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

    def write_streams(n: int) -> float:
        folder = base / f"floor-{n}"
        folder.mkdir()
        parts: list[list[memoryview]] = [[] for _ in range(n)]
        for v in sorted(views, key=len, reverse=True):
            parts[min(range(n), key=lambda k: sum(len(p) for p in parts[k]))].append(v)

        def one(k: int) -> None:
            with open(folder / f"part-{k}", "wb") as f:
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

    # ---- peers
    peers: dict[str, float] = {}
    loads: dict[str, float] = {}
    p = base / "peer.pt"

    def torch_save() -> None:
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    peers["torch.save + fsync"] = timed(torch_save, dev)
    p.unlink()
    dcp_dir = base / "dcp"
    peers["DCP save"] = timed(lambda: dcp.save(state, checkpoint_id=str(dcp_dir)), dev)
    drop_cache(dcp_dir)
    loads["DCP load, cold"] = timed(lambda: dcp.load(state, checkpoint_id=str(dcp_dir)), dev)
    shutil.rmtree(dcp_dir)
    gloo = dist.new_group(backend="gloo")
    for i in (1, 2):
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

    # ---- torchrelay
    relay: dict[str, float] = {}
    cfg = tr.RelayConfig(
        seed=0, micro_batch=1, total_updates=1000, save_every=1000, manifest=str(manifest), keep=2
    )
    run_a = tr.Run.open(base / "run-async", cfg, code_dir=base / "code")
    run_a.track(model=ddp, optimizer=opt)
    run_a._saver.due(1)  # the loop asks after its first update: the host buffers are allocated on a thread
    baseline = [update() for _ in range(20)]  # the first ones run while the host buffers are allocated
    run_s = tr.Run.open(base / "run-sync", cfg.replace(async_save=False), code_dir=base / "code")
    run_s.track(model=ddp, optimizer=opt)
    relay["torchrelay sync save"] = timed(lambda: run_s._saver.save(1), dev)
    sync_ckpt = base / "run-sync" / "checkpoint-1"
    during: list[float] = []
    same = None
    for i, u in enumerate((1, 2), start=1):
        sync(dev)
        t0 = time.perf_counter()
        run_a._saver.save(u)
        stall = time.perf_counter() - t0
        n = 0
        while run_a._saver.persisting:
            during.append(update())
            n += 1
        run_a._saver.wait()
        done = time.perf_counter() - t0
        relay[f"torchrelay async save #{i}: loop blocked"] = stall
        relay[f"torchrelay async save #{i}: until committed"] = done
        print(
            f"[bench] async save #{i}: stall {stall:.3f} s, committed {done:.3f} s, {n} updates ran",
            flush=True,
        )
        if i == 1:  # the same state saved both ways: the tensor files and the RNG are the same bytes
            a_ckpt = base / "run-async" / "checkpoint-1"
            names = sorted(str(f.relative_to(sync_ckpt)) for f in sync_ckpt.rglob("*") if f.is_file())
            same = names == sorted(
                str(f.relative_to(a_ckpt)) for f in a_ckpt.rglob("*") if f.is_file()
            ) and all(
                _sha(sync_ckpt / rel) == _sha(a_ckpt / rel)
                for rel in names
                if rel.endswith(".distcp") or rel.startswith("rng/")
            )
            run_s._end_segment(1)
            shutil.rmtree(base / "run-sync")
            shutil.rmtree(a_ckpt)  # the disk holds two states at most
    ckpt = base / "run-async" / "checkpoint-2"
    saved_bytes = tree_bytes(ckpt)
    run_a._end_segment(2)
    out["sync_and_async_files_identical"] = same
    # resume in this process, cold: Run.open verifies the inventory, run.track loads through DCP
    drop_cache(ckpt)
    sync(dev)
    t0 = time.perf_counter()
    run_r = tr.Run.open(base / "run-async", None, code_dir=base / "code")
    run_r.track(model=ddp, optimizer=opt)
    sync(dev)
    loads["torchrelay resume (open + track), cold"] = time.perf_counter() - t0
    run_r._end_segment(2)

    slow_med = statistics.median(during) / statistics.median(baseline) if during else float("nan")
    slow_max = max(during) / statistics.median(baseline) if during else float("nan")
    out.update(
        floors=floors,
        peers=peers,
        relay=relay,
        loads=loads,
        bytes=nbytes,
        checkpoint_bytes=saved_bytes,
        update_s=statistics.median(baseline),
        update_during_persist_median_ratio=slow_med,
        update_during_persist_max_ratio=slow_max,
        update_during_persist_p90_ratio=_quantile(during, 0.9) / statistics.median(baseline)
        if during
        else None,
        updates_during_persist_over_1_1x=sum(d > 1.1 * statistics.median(baseline) for d in during),
        updates_during_persist=len(during),
    )
    table(out, nbytes)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def cold_read(files: list[Path], streams: int) -> float:
    """The floor of a load: every file read once, `streams` at a time, one thread each, after the pages dropped."""
    for f in files:
        drop_cache(f)

    def one(paths: list[Path]) -> None:
        buf = bytearray(16 << 20)
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

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
    base: Path, manifest: Path, ddp: nn.Module, opt: torch.optim.Optimizer, dev: str
) -> tuple[Path, list[Path], float]:
    """checkpoint-1 of base/run, saved inline by torchrelay: its folder, its tensor files, the seconds it took."""
    cfg = tr.RelayConfig(
        seed=0, micro_batch=1, total_updates=1000, save_every=1000, manifest=str(manifest), async_save=False
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
        if hasattr(dcp_io, "READ_STREAMS"):
            dcp_io.READ_STREAMS = streams
        if len(args.read_streams) > 1:
            how = f"{how}, {streams} reads in flight"
        if how.startswith("cold"):
            drop_cache(ckpt)
        sync(dev)
        t0 = time.perf_counter()
        run = tr.Run.open(base / "run", None, code_dir=base / "code")
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
    peer_ref = {
        "torch.save": peers["torch.save + fsync"],
        "DCP save": peers["DCP save"],
        "DCP async done": peers["DCP async_save #2: until done"],
    }
    lines = [
        f"state {nbytes / GB:.2f} GB, torch {out['torch']}, {out['device']}, {out['cores']} cores; "
        f"update {out['update_s'] * 1000:.1f} ms",
        "| what | s | GB/s | vs floor | vs torch.save | vs DCP save | vs DCP async (done) |",
        "|---|---|---|---|---|---|---|",
    ]

    def line(name: str, s: float, floor: float | None, floor_name: str, peer: bool = True) -> None:
        ratio = f"{floor / s:.2f} of {floor_name}" if floor else ""
        cmp = " | ".join(f"{s / v:.2f}x" for v in peer_ref.values()) if peer else " | | "
        lines.append(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {ratio} | {cmp} |")

    for name, s in floors.items():
        lines.append(f"| floor: {name} | {s:.3f} | {nbytes / s / GB:.2f} | | | | |")
    for name, s in peers.items():
        line(name, s, None if "blocked" in name else f_write, "disk write")
    for name, s in relay.items():
        if "blocked" in name:
            lines.append(
                f"| {name} | {s:.3f} | | {s / f_copy:.2f}x the host copy (goal <= 1.5x) | "
                f"{s / peers['torch.save + fsync']:.2f}x | {s / peers['DCP save']:.2f}x | "
                f"{s / peers['DCP async_save #2: caller blocked']:.2f}x of DCP async blocked |"
            )
        else:
            line(name, s, f_write, "disk write (goal >= 0.85)")
    for name, s in loads.items():
        lines.append(
            f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {f_read / s:.2f} of cold read (goal >= 0.85) | | "
            f"{s / loads['DCP load, cold']:.2f}x DCP load | |"
        )
    lines.append(
        f"update while a persist runs: median {out['update_during_persist_median_ratio']:.2f}x, p90 "
        f"{out['update_during_persist_p90_ratio'] or float('nan'):.2f}x, max "
        f"{out['update_during_persist_max_ratio']:.2f}x a normal update; "
        f"{out['updates_during_persist_over_1_1x']} of {out['updates_during_persist']} updates over 1.1x (goal: none)"
    )
    lines.append(f"sync and async checkpoints hold identical files: {out['sync_and_async_files_identical']}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
