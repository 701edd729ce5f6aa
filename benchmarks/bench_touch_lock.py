"""Does obtaining page-locked buffers hold up the training thread's own memory calls? (issue 22, goal 1)

The reservation faults in and registers (cudaHostRegister) gigabytes of host memory on a background thread. A
page fault holds the process's mmap lock for reading, a registration pins pages under it, and a thread that maps
or unmaps memory (glibc's malloc above its mmap threshold, Python's arenas, a CPU tensor) needs it for writing:
it waits for the fault or pin in progress. On a VM whose memory was never touched each fault is slow (the host
backs the page), which would explain single slow updates while the buffers were obtained on a fresh machine
(1.33x, 1.66x; RESULTS.md, issue 22 sixth round).

For each way of obtaining the buffers, on memory no earlier way used (every mapping is kept to the end), the main
thread maps 1 MiB, writes it and unmaps it every millisecond while the background obtains --gb of 64 MiB buffers:

- none: nothing in the background (the main thread's own floor)
- private: anonymous private mappings, huge pages advised, faulted in by one thread (a torch fill), registered
- memfd-touch: a memfd each, faulted in through the mapping by 4 threads, registered (the shared stage today)
- memfd-fallocate: a memfd each, its pages allocated by fallocate (a file operation: no mapping, no mmap lock),
  then mapped and registered

    PYTHONPATH=src python3 benchmarks/bench_touch_lock.py --gb 14 --json /tmp/touch.json

Reported: the main thread's map/write/unmap latency (median, p99, max, how many over 2 and 10 ms) and the
background's seconds (touch or fallocate, registration). `--pieces K` registers each buffer in K parts and copies
into them (on the H200 host such copies failed with a CUDA error: a buffer must be one registration). The figures:
benchmarks/RESULTS.md, issue 22 seventh round.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

BUF = 64 << 20
PAGE = mmap.PAGESIZE


PIECES = 1  # registrations per buffer (--pieces): each a contiguous share of it


def _register(t: torch.Tensor, size: int) -> float:
    t0 = time.perf_counter()
    if torch.cuda.is_available():
        share = size // PIECES
        for i in range(PIECES):
            rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr() + i * share, share, 0))
            if rc != 0:
                raise SystemExit(f"cudaHostRegister returned {rc}")
    return time.perf_counter() - t0


def _copy_speed(kept: list[Any]) -> dict[str, float]:
    """Copies of a 64 MiB device tensor into 32 of the mode's buffers (non_blocking): the issue's seconds on the
    main thread and the copies' GB/s (a buffer registered in pieces might be copied as pageable memory)."""
    bufs = [x for x in kept if isinstance(x, torch.Tensor)][:32]
    if not bufs or not torch.cuda.is_available():
        return {}
    src = torch.ones(BUF, dtype=torch.uint8, device="cuda")
    best = {"issue_s": 1e9, "gbps": 0.0}
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in bufs:
            b.copy_(src, non_blocking=True)
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        best = {
            "issue_s": min(best["issue_s"], issued),
            "gbps": max(best["gbps"], len(bufs) * BUF / total / 1e9),
        }
    return {k: round(v, 4) for k, v in best.items()}


def _obtain(mode: str, n: int, kept: list[Any], spent: dict[str, float]) -> None:
    os.nice(10)
    pool = ThreadPoolExecutor(4) if mode == "memfd-touch" else None
    for _ in range(n):
        t0 = time.perf_counter()
        if mode == "private":
            m = mmap.mmap(-1, BUF, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            t = torch.frombuffer(m, dtype=torch.uint8)
            t[::PAGE].fill_(0)
        else:
            fd = os.memfd_create("touch-lock", os.MFD_CLOEXEC)
            os.ftruncate(fd, BUF)
            if mode == "memfd-fallocate":
                os.posix_fallocate(fd, 0, BUF)
            m = mmap.mmap(fd, BUF, flags=mmap.MAP_SHARED)
            t = torch.frombuffer(m, dtype=torch.uint8)
            if mode == "memfd-touch":
                assert pool is not None
                parts = [t[i : i + BUF // 4] for i in range(0, BUF, BUF // 4)]
                list(pool.map(lambda part: part[::PAGE].fill_(0), parts))
            kept.append(fd)
        spent["obtain_s"] += time.perf_counter() - t0
        spent["register_s"] += _register(t, BUF)
        kept += [m, t]
    if pool is not None:
        pool.shutdown()


def run(mode: str, gb: float, floor_s: float) -> dict[str, Any]:
    n = int(gb * (1 << 30)) // BUF
    kept: list[Any] = []
    spent = {"obtain_s": 0.0, "register_s": 0.0}
    bg = None if mode == "none" else threading.Thread(target=_obtain, args=(mode, n, kept, spent))
    lat: list[float] = []
    launch: list[float] = []  # a kernel launch's own time on the main thread (CUDA only)
    x = torch.zeros(1 << 16, device="cuda") if torch.cuda.is_available() else None
    t_start = time.perf_counter()
    if bg is not None:
        bg.start()
    while (bg is not None and bg.is_alive()) or (bg is None and time.perf_counter() - t_start < floor_s):
        t0 = time.perf_counter()
        m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[:: PAGE * 16] = b"\1" * len(range(0, 1 << 20, PAGE * 16))
        m.close()
        lat.append(time.perf_counter() - t0)
        if x is not None:
            t0 = time.perf_counter()
            x.add_(1.0)
            launch.append(time.perf_counter() - t0)
        time.sleep(0.001)
    wall = time.perf_counter() - t_start
    lat_ms = sorted(x * 1000 for x in lat)
    return {
        "mode": mode,
        "buffers": n,
        "wall_s": round(wall, 2),
        **{k: round(v, 2) for k, v in spent.items()},
        "calls": len(lat_ms),
        "median_ms": round(statistics.median(lat_ms), 4),
        "p99_ms": round(lat_ms[int(0.99 * (len(lat_ms) - 1))], 3),
        "max_ms": round(lat_ms[-1], 2),
        "over_2ms": sum(x > 2 for x in lat_ms),
        "over_10ms": sum(x > 10 for x in lat_ms),
        "launch_max_ms": round(max(launch) * 1000, 2) if launch else None,
        "launch_over_2ms": sum(x > 0.002 for x in launch),
        "copy": _copy_speed(kept),
        "_kept": kept,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=14.0)
    ap.add_argument("--modes", default="none,private,memfd-touch,memfd-fallocate")
    ap.add_argument("--json", default="")
    ap.add_argument("--pieces", type=int, default=1, help="registrations per 64 MiB buffer")
    ap.add_argument("--floor-seconds", type=float, default=5.0, help="how long mode none measures")
    args = ap.parse_args()
    global PIECES
    PIECES = args.pieces
    if torch.cuda.is_available():
        torch.cuda.init()
    out, kept = [], []
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        print(json.dumps({"pieces": PIECES, "shmem_enabled": f.read().strip()}), flush=True)
    for mode in args.modes.split(","):
        r = run(mode, args.gb, args.floor_seconds)
        kept.append(r.pop("_kept"))  # memory no later mode reuses
        print(json.dumps(r), flush=True)
        out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
