"""How a disk serves a checkpoint's successive saves (issue 22 goal 2): the same bytes written again and again, into
new files, into the blocks a deleted checkpoint freed, or over the files of a retired one, each round timed as the
persist's floor is (16 streams, 16 MiB writes, one fsync per file).

A persist is compared with a write floor measured once, in one state of the disk (bench_save.py). Whether the
disk's speed depends on where the blocks land is what this measures: a virtual disk may serve blocks its host has
never backed slower than blocks written before, and a guest file system chooses which blocks a new file gets.

Steps run in the order given (`--steps`), each `MODE:SET`:
- `new:A`     write set A as new files (O_TRUNC, as DCP's writer does; A must not exist);
- `over:A`    write set A again over its existing files, without truncating (each block overwritten in place);
- `recycle:A:B` rename set A's files to set B's names, then write over them without truncating (retention's reuse);
- `del:A`     delete set A and sync (its blocks go back to the file system, its discards sent, where mounted so);
- `rm:A`      delete set A and go on at once (as retention's deletion does: the discards go with the next commit);
- `fall:A`    new files whose blocks are reserved first (posix_fallocate), then written;
- `kick:A`    new files, writeback started every 64 MiB as the persist does (SaveTuning.kick_bytes);
- `drop`      drop the page cache of every set still on disk (fadvise DONTNEED, no root needed).

`python benchmarks/bench_disk_rounds.py --dir /root/disk --gb 14.5 --steps new:A,new:B,over:A,del:A,new:C,...`
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import MiB, drop_cache, machine  # noqa: E402

from torchrelay.util.meminfo import meminfo_kib  # noqa: E402

GB = 1e9
PIECE = 16 * MiB
KICK = 64 * MiB


def meminfo() -> dict[str, int]:
    """MiB of the page cache's fields that tell a write's context (Linux; empty elsewhere)."""
    kib = meminfo_kib("MemFree", "Cached", "Dirty", "Writeback", "MemAvailable") or {}
    return {key: value // 1024 for key, value in kib.items()}


def disk_free_gb(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / GB


def write_set(folder: Path, sizes: list[int], block: bytes, mode: str) -> float:
    """Write one set (a file per stream, all at once), fsync each; seconds until the last fsync returned."""
    view = memoryview(block)

    def one(k: int) -> None:
        path = folder / f"part-{k:02d}"
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if mode in ("new", "fall", "kick"):
            flags |= os.O_TRUNC
        fd = os.open(path, flags, 0o644)
        try:
            if mode == "fall":
                os.posix_fallocate(fd, 0, sizes[k])
            done, kicked = 0, 0
            rot = (k * 7919 * 4096) % len(view)
            while done < sizes[k]:
                start = (rot + done) % len(view)
                n = min(PIECE, sizes[k] - done, len(view) - start)
                os.write(fd, view[start : start + n])
                done += n
                if mode == "kick" and done - kicked >= KICK:
                    os.posix_fadvise(fd, kicked, done - kicked, os.POSIX_FADV_DONTNEED)
                    kicked = done
            os.ftruncate(fd, sizes[k])
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="a folder on the disk to measure (the sets go in a new folder in it, removed at the end)",
    )
    ap.add_argument("--gb", type=float, default=14.5, help="bytes of one set, in GB (a checkpoint's size)")
    ap.add_argument("--files", type=int, default=16, help="files (streams) of one set")
    ap.add_argument("--steps", required=True, help="comma-separated MODE:SET steps (module docstring)")
    ap.add_argument("--json", type=Path, default=None, help="write the rounds here too")
    args = ap.parse_args(argv)
    total = int(args.gb * GB)
    sizes = [total // args.files] * args.files
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-disk-rounds-", dir=args.dir))  # removed at the end, not --dir
    block = os.urandom(64 * MiB)
    print(f"[disk] {machine()}", flush=True)
    print(
        f"[disk] {args.files} files of {sizes[0] / MiB:.0f} MiB, {total / GB:.2f} GB a set; free {disk_free_gb(root):.1f} GB",
        flush=True,
    )
    rounds = []
    try:
        for step in args.steps.split(","):
            mode, *names = step.split(":")
            if mode == "drop":
                for folder in sorted(p for p in root.iterdir() if p.is_dir()):
                    drop_cache(folder)
                print("[disk] drop: page cache of every set dropped", flush=True)
                continue
            folder = root / names[0]
            if mode in ("del", "rm"):
                t0 = time.perf_counter()
                shutil.rmtree(folder)
                if mode == "del":
                    os.sync()
                print(f"[disk] {mode} {names[0]}: {time.perf_counter() - t0:.3f} s", flush=True)
                continue
            if mode == "recycle":
                target = root / names[1]
                folder.rename(target)
                folder, mode = target, "over"
            elif mode in ("new", "fall", "kick"):
                folder.mkdir()
            elif mode != "over":
                raise SystemExit(f"bench_disk_rounds: unknown step {step!r}")
            before = meminfo()
            free = disk_free_gb(root)
            if mode != "over" and free < total / GB + 2:
                print(f"[disk] {step}: skipped, {free:.1f} GB free", flush=True)
                folder.rmdir()
                continue
            s = write_set(folder, sizes, block, mode)
            rounds.append(
                {
                    "step": step,
                    "s": s,
                    "GBps": total / s / GB,
                    "free_gb_before": free,
                    "mem_mib_before": before,
                }
            )
            print(
                f"[disk] {step:12s} {s:7.3f} s  {total / s / GB:5.2f} GB/s  free before {free:5.1f} GB  "
                f"cached {before.get('Cached', 0) / 1024:5.1f} GiB dirty {before.get('Dirty', 0)} MiB",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if rounds:
        best = min(r["s"] for r in rounds)
        print("\n| step | s | GB/s | vs the fastest round |\n|---|---|---|---|")
        for r in rounds:
            print(f"| {r['step']} | {r['s']:.3f} | {r['GBps']:.2f} | {best / r['s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "gb": args.gb, "files": args.files}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
