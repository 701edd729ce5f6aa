"""Why `verify` falls short of cores x one thread on big hosts: how SHA-256 scales with threads, and mapped vs read I/O.

1. the CPU's topology (lscpu): hardware threads share one core's SHA unit;
2. in-memory hashlib SHA-256, aggregate over 1 .. N threads (no I/O at all): the real ceiling of any verify;
3. `verify_bundle` on a warm bundle (its I/O: files >= 1 MiB hashed through a read-only mapping), and beside it,
   in turn, the same files hashed by this script on as many threads through the three I/O paths (a mapping, a
   pre-faulted mapping: MAP_POPULATE, plain reads into a per-thread buffer), so each path's figure stands beside
   the library's. The paths are this script's own code: a benchmark does not patch the library.

    .venv/bin/python benchmarks/bench_hash_scaling.py --gb 8 --files 64 --trials 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import hash_speed_one_thread, hash_speed_threads, machine, median, read_speed, warm, write_files

from torchrelay.handoff.verify import verify_bundle
from torchrelay.util.hashing import default_jobs, sha256_file
from torchrelay.util.sums import SUMS_NAME, SumEntry, write_sums


def topology() -> dict[str, str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)")
    return {
        k.strip(): v.strip()
        for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)
        if k.strip() in keep
    }


def _sha256(path: Path, mode: str) -> int:
    """Hash one file through one I/O path; its size."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if mode == "read":
            buf = bytearray(16 << 20)
            view = memoryview(buf)
            while n := f.readinto(buf):
                digest.update(view[:n])
            return size
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if mode == "populate" else 0)
        with mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) as mapped:
            digest.update(mapped)
    return size


def hash_files(paths: list[Path], jobs: int, mode: str) -> float:
    """Bytes/s hashing every file on `jobs` threads through one I/O path (`mapped`, `populate` or `read`)."""
    t = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        total = sum(pool.map(lambda p: _sha256(p, mode), paths))
    return total / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/torchrelay-bench-hash"))
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--files", type=int, default=50)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5, help="of each in-memory hashing figure")
    args = ap.parse_args()
    jobs = default_jobs()
    result: dict[str, object] = {"machine": machine(), "topology": topology(), "jobs": jobs}
    one = hash_speed_one_thread(args.seconds)
    counts = sorted({1, max(1, jobs // 4), max(1, jobs // 2), jobs})
    scaling = {n: hash_speed_threads(n, args.seconds) for n in counts}
    result["hash_one_Bps"] = one
    result["hash_threads_Bps"] = scaling
    for n, bps in scaling.items():
        print(
            f"in-memory SHA-256, {n:3d} threads: {bps / 1e9:6.2f} GB/s = {bps / one:5.1f} x one thread",
            flush=True,
        )

    bundle = args.dir / "bundle"
    shutil.rmtree(args.dir, ignore_errors=True)
    total = int(args.gb * 1e9)
    paths = write_files(bundle / "checkpoint-1" / "model", total, args.files)
    write_sums(
        bundle / SUMS_NAME, [SumEntry(p.relative_to(bundle).as_posix(), sha256_file(p)[0]) for p in paths]
    )
    try:
        warm(paths)
        read_bw = read_speed(paths, jobs)
        modes = ("verify_bundle", "mapped", "populate", "read")
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.trials):
            for mode in modes:
                if mode == "verify_bundle":
                    report = verify_bundle(bundle, jobs=jobs)
                    assert report.ok, report.problems()
                    runs[mode].append(report.sums.total_bytes / report.sums.seconds)
                else:
                    runs[mode].append(hash_files(paths, jobs, mode))
        result.update(read_Bps=read_bw, verify_Bps=runs)
        for mode, bws in runs.items():
            med = median(bws)
            print(
                f"{mode}: median {med / 1e9:.2f} GB/s = {med / (jobs * one):.2f} x (cores x one thread), "
                f"{med / scaling[jobs]:.2f} x in-memory {jobs}-thread hashing; trials "
                + ", ".join(f"{b / 1e9:.2f}" for b in bws),
                flush=True,
            )
        print(f"parallel read alone: {read_bw / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
