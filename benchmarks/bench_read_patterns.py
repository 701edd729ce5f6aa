"""How this host's disk serves the read patterns a load can take, each a cold read of the same files (pages dropped
before each), alternating over rounds: the cold-read floor (a thread per file, reused 16 MiB buffer) against
the verified reader's patterns (16 threads sharing the chunks of a few files at once; reads into memory touched
for the first time; O_DIRECT in several request sizes). No torch: the files are written here (random bytes,
benchlib.write_files).

    python3 benchmarks/bench_read_patterns.py --dir /root --gb 14.5 --count 16 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import MiB, cpu_seconds, drop_cache, write_files


def per_file(
    files: list[Path], streams: int, chunk: int, direct: bool, fresh: bool, hashed: bool = False
) -> None:
    """A thread per file (files[k::streams]), front to back, `chunk` bytes a read, into one reused buffer or
    (fresh) into a mapping of the file's size touched for the first time; `hashed`: each read's bytes hashed
    (SHA-256) by the thread that read them, the least a verified read does."""

    def one(paths: list[Path]) -> None:
        buf = mmap.mmap(-1, chunk)
        for p in paths:
            digest = hashlib.sha256() if hashed else None
            size = p.stat().st_size
            room = mmap.mmap(-1, -(-size // 4096) * 4096) if fresh else None
            fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                off = 0
                while off < size:
                    view = memoryview(room)[off : off + chunk] if room is not None else memoryview(buf)
                    n = os.preadv(fd, [view], off)
                    if not n:
                        break
                    if digest is not None:
                        digest.update(view[:n])
                    off += n
            finally:
                os.close(fd)
                if room is not None:
                    room.close()

    threads = [threading.Thread(target=one, args=(files[k::streams],)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def shared(files: list[Path], streams: int, chunk: int, direct: bool, at_once: int) -> None:
    """`streams` threads share the chunks of the first `at_once` files not yet fully asked for, round robin (the
    verified reader's default pattern), each into a reused buffer."""
    lock = threading.Lock()
    queue = [
        [p, p.stat().st_size, 0, os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))] for p in files
    ]
    fds = [q[3] for q in queue]
    turn = [0]

    def take() -> tuple[int, int] | None:
        with lock:
            live = queue[:at_once]
            if not live:
                return None
            q = live[turn[0] % len(live)]
            turn[0] += 1
            off = q[2]
            q[2] += chunk
            if q[2] >= q[1]:
                queue.remove(q)
            return q[3], off

    def one() -> None:
        buf = mmap.mmap(-1, chunk)
        while (job := take()) is not None:
            os.preadv(job[0], [buf], job[1])

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds:
        os.close(fd)


PATTERNS: dict[str, Callable[[list[Path]], None]] = {
    "floor: per file, 16 streams, 16 MiB, reused buffer": lambda f: per_file(f, 16, 16 * MiB, False, False),
    "floor, each read hashed by its thread": lambda f: per_file(f, 16, 16 * MiB, False, False, True),
    "per file, into fresh memory": lambda f: per_file(f, 16, 16 * MiB, False, True),
    "shared chunks of 4 files, 16 threads": lambda f: shared(f, 16, 16 * MiB, False, 4),
    "shared chunks of 16 files, 16 threads": lambda f: shared(f, 16, 16 * MiB, False, 16),
    "per file, 1 MiB reads": lambda f: per_file(f, 16, 1 * MiB, False, False),
    "O_DIRECT per file, 16 MiB": lambda f: per_file(f, 16, 16 * MiB, True, False),
    "O_DIRECT per file, 4 MiB": lambda f: per_file(f, 16, 4 * MiB, True, False),
    "O_DIRECT per file, 1 MiB": lambda f: per_file(f, 16, 1 * MiB, True, False),
    "O_DIRECT shared chunks of 4 files, 4 MiB": lambda f: shared(f, 16, 4 * MiB, True, 4),
    "O_DIRECT shared chunks of 16 files, 32 threads, 4 MiB": lambda f: shared(f, 32, 4 * MiB, True, 16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated prefixes of the patterns to run")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="read-patterns-", dir=args.dir))
    size = int(args.gb * (1 << 30) / args.count) // 4096 * 4096 + 123  # no multiple of a block
    t0 = time.perf_counter()
    files = write_files(base, size * args.count, args.count)
    drop_cache(base)  # written out (fsync) before the first pattern
    total = size * args.count
    print(
        f"[read] {args.count} files of {size / (1 << 30):.3f} GiB written in {time.perf_counter() - t0:.1f} s"
    )
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    patterns = {k: v for k, v in PATTERNS.items() if not only or any(k.startswith(o) for o in only)}
    times: dict[str, list[float]] = {k: [] for k in patterns}
    cpu: dict[str, list[float]] = {k: [] for k in patterns}  # this process's, every thread's
    for r in range(args.rounds):
        for name, fn in patterns.items():
            drop_cache(base)
            used = cpu_seconds()
            t = time.perf_counter()
            fn(files)
            dt = time.perf_counter() - t
            cpu[name].append(cpu_seconds() - used)
            times[name].append(dt)
            print(
                f"[read] round {r + 1}: {name}: {dt:.3f} s, {total / dt / 1e9:.2f} GB/s, {cpu[name][-1]:.2f} CPU s",
                flush=True,
            )
    floor = list(times.values())[0]
    print(f"{os.cpu_count()} cores")
    print("| pattern | s (each round) | median GB/s | vs the floor, same round (each) | CPU s (each round) |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        vs = ", ".join(f"{a / b:.2f}" for a, b in zip(floor, ts))
        each = ", ".join(f"{t:.3f}" for t in ts)
        used = ", ".join(f"{c:.2f}" for c in cpu[name])
        print(f"| {name} | {each} | {total / statistics.median(ts) / 1e9:.2f} | {vs} | {used} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": total, "times": times, "cpu_s": cpu}, indent=1))
    for p in files:
        p.unlink()
    base.rmdir()


if __name__ == "__main__":
    main()
