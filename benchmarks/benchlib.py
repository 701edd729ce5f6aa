"""Shared pieces of the handoff benchmarks: a synthetic multi-GB run, timing, machine facts."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"nproc {os.cpu_count()}, {cpu}, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def print_stamped(result: dict[str, object]) -> None:
    """A benchmark's result as JSON with when, where (host, cores, load) and by which command it was measured."""
    result.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.node()} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
        command=" ".join(["python", *sys.argv]),
    )
    print(json.dumps(result, indent=1))


def write_files(folder: Path, total_bytes: int, count: int, prefix: str = "shard") -> list[Path]:
    """`count` files of pseudo-random bytes adding up to `total_bytes` (a 64 MiB random block, rotated per file)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 * MiB)
    sizes = [total_bytes // count] * count
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"{prefix}-{i:03d}.bin"
        rot = (i * 7919 * 4096) % len(block)
        data = block[rot:] + block[:rot]
        with open(path, "wb") as f:
            f.write(i.to_bytes(8, "little"))  # every file distinct
            left = size - 8
            while left > 0:
                n = min(left, len(data))
                f.write(data[:n])
                left -= n
        paths.append(path)
    return paths


def warm(paths: list[Path]) -> None:
    """Read every file once so the page cache holds it."""
    buf = bytearray(8 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cache(root: Path) -> None:
    """Cold-ish: ask the kernel to drop the (clean, fsynced) pages of every file under root (or of root, a file);
    no root needed, unlike `drop_caches`."""
    for path in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds() -> float:
    """This process's user + system CPU seconds so far, every thread's (the kernel's work for its reads included):
    what a run costs a host whose cores are few."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drop_caches() -> bool:
    """Drop the page cache (root only); True when it worked."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def hash_speed_one_thread(seconds: float = 2.0) -> float:
    """Bytes/s of hashlib SHA-256 on one thread, in-memory 1 MiB blocks (no I/O)."""
    data = memoryview(os.urandom(MiB))
    h = hashlib.sha256()
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        h.update(data)
        n += MiB
    return n / (time.perf_counter() - t)


def hash_speed_threads(threads: int, seconds: float = 2.0) -> float:
    """Aggregate bytes/s of `threads` threads hashing in memory at once (checks that the cores really scale)."""
    results = [0.0] * threads

    def work(i: int) -> None:
        results[i] = hash_speed_one_thread(seconds)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(results)


def read_speed(paths: list[Path], threads: int) -> float:
    """Bytes/s reading the files (into reused buffers, no hashing) with `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    def read(p: Path) -> int:
        buf = bytearray(MiB)
        n = 0
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - t)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_cmd(cmd: list[str] | str, cwd: Path | None = None) -> float:
    """Wall seconds of a shell command (which must succeed)."""
    t = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds` (other processes: this one sleeps meanwhile)."""
    t0, i0 = _cpu_times()
    time.sleep(seconds)
    t1, i1 = _cpu_times()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(max_wait: float = 20.0, threshold: float = 0.10) -> float:
    """Wait (up to max_wait s) until the machine is idle: other people's tests share these cores.

    Returns the busy fraction last seen, which goes into the results so a noisy figure is marked as such."""
    deadline = time.time() + max_wait
    busy = busy_fraction()
    while busy > threshold and time.time() < deadline:
        time.sleep(2.0)
        busy = busy_fraction()
    return busy
