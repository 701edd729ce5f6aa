"""How to obtain page-locked staging memory without slowing the training loop (issue 22, goal 1).

One process, one GPU: a loop of updates (`--layers` x Linear(width, width) + AdamW, batch `--batch`) runs while the
host buffers of its state (parameters + both AdamW moments, the tensors a save copies) are obtained one way, then
the device->host copy into them is timed. Each update's time (update end to update end, whatever ran between) is
recorded; the ratios are to the median of the updates before the variant started.

Variants (`--variants a,b`, default all): `hostalloc-thread`, `torch.empty(..., pin_memory=True)` per tensor on a
thread (cudaHostAlloc: torchrelay's `HostStage.reserve` before issue 22); `fault-1-nice`, pageable memory first
touched by one thread at nice 10, never registered; `tensors-register`, torch.empty per tensor, touched, then one
`cudaHostRegister` per tensor on a thread without pause; `[nothing-][thp-]<C>-paced-<k>`, one buffer per tensor
(torch.empty, or an anonymous mapping advised MADV_HUGEPAGE with thp-) registered in pieces of C bytes (whole: one
call per tensor), each call followed by k-1 times its length asleep, on a thread at nice 10; with nothing- that
thread also allocates and touches each buffer just before registering it (the whole cost from nothing), else they
are touched before the loop; `whole-loop`, registered on the training thread between updates, up to 2 ms of calls
per update; `child-hostalloc`, another process page-locks as many bytes (cudaHostAlloc) while this one trains.
Probes first: one 2 GiB registration on a thread while this thread spins in Python, launches tiny kernels, or
waits for a 30 ms kernel; then whether one buffer can be registered in pieces.

    python3 benchmarks/bench_pin.py --layers 72 --width 4096 --batch 256 --json $OUT/pin.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

MiB = 1 << 20
HUGE = 2 * MiB
GB = 1e9


def sizes_arg(text: str) -> int:
    low = text.lower()
    scale = {"k": 1 << 10, "m": MiB, "g": 1 << 30}.get(low[-1:], 1)
    return int(float(low[:-1] if scale > 1 else low) * scale)


class Arena:
    """One anonymous mapping holding every buffer (each at a 2 MiB-aligned offset), registered chunk by chunk."""

    def __init__(self, shapes: list[tuple[torch.Size, torch.dtype]], huge: bool) -> None:
        offsets, off = [], 0
        for shape, dtype in shapes:
            offsets.append(off)
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            off += -(-n // HUGE) * HUGE
        self.size = off
        self.map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.skip = -base % HUGE  # the arena starts 2 MiB-aligned, so huge pages can back it
        self.base = base + self.skip
        if huge:
            self.map.madvise(mmap.MADV_HUGEPAGE, self.skip, self.size)
        raw = torch.frombuffer(self.map, dtype=torch.uint8)[self.skip : self.skip + self.size]
        self.raw = raw
        self.bufs = []
        for (shape, dtype), o in zip(shapes, offsets, strict=True):
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self.bufs.append(raw[o : o + n].view(dtype).view(shape))
        self.registered: list[tuple[int, int]] = []

    def fault(self, threads: int = 8, nice: int = 0) -> None:
        step = 64 * MiB

        def touch(a: int) -> None:
            if nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            self.raw[a : a + step].fill_(0)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(touch, range(0, self.size, step)))

    def chunks(self, chunk: int) -> list[tuple[int, int]]:
        return [(self.base + a, min(chunk, self.size - a)) for a in range(0, self.size, chunk)]

    def register(self, ptr: int, n: int) -> float:
        t0 = time.perf_counter()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, n, 0))
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister: error {err} at offset {ptr - self.base} of {self.size}, {n} bytes, "
                f"after {len(self.registered)} calls"
            )
        self.registered.append((ptr, n))
        return time.perf_counter() - t0

    def unregister(self) -> float:
        t0 = time.perf_counter()
        for ptr, _ in self.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.registered.clear()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=72)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--variants", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # child-hostalloc's process
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_pin.py: needs a CUDA GPU (it page-locks host memory beside a GPU loop); run it on a GPU host"
        )
    if args.child:
        torch.cuda.init()
        t0 = time.perf_counter()
        keep = [
            torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(args.child // (64 * MiB))
        ]
        print(json.dumps({"child_alloc_s": time.perf_counter() - t0, "n": len(keep)}), flush=True)
        return

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device="cuda")

    def update() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()

    update()
    tensors = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    shapes = [(t.shape, t.dtype) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    facts = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "bytes": nbytes,
        "tensors": len(tensors),
        "thp": thp.read_text().strip() if thp.exists() else "?",
    }
    print(f"[pin] {facts}", flush=True)
    # The machine's memory grows as it is first used (a VM): touch the bytes once so no variant pays for that.
    t0 = time.perf_counter()
    warm = Arena(shapes, huge=False)
    warm.fault()
    del warm
    facts["first_touch_s"] = time.perf_counter() - t0

    def probe(how: str) -> dict[str, float]:
        arena = Arena([(torch.Size([1 << 31]), torch.uint8)], huge=False)
        arena.fault()
        took: list[float] = []
        small = torch.zeros(16, device="cuda")
        big = torch.randn(8192, 8192, device="cuda")

        def chain() -> None:
            for _ in range(25):
                big @ big  # noqa: B018 - about 30 ms of work on the stream

        t0 = time.perf_counter()
        chain()
        torch.cuda.synchronize()
        alone = time.perf_counter() - t0
        th = threading.Thread(target=lambda: took.append(arena.register(arena.base, arena.size)))
        gap, last = 0.0, time.perf_counter()
        if how == "wait":
            chain()
            th.start()
            time.sleep(0.002)
            torch.cuda.synchronize()
            gap = time.perf_counter() - last
        else:
            th.start()
            while th.is_alive():
                if how == "launch":
                    small.add_(1)
                now = time.perf_counter()
                gap, last = max(gap, now - last), now
        th.join()
        torch.cuda.synchronize()
        arena.unregister()
        return {"register_s": took[0], "longest_gap_s": gap, "chain_alone_s": alone}

    for how in ("python", "launch", "wait"):
        facts[f"probe_{how}"] = probe(how)
        print(f"[pin] probe {how}: {facts[f'probe_{how}']}", flush=True)

    def copy_into(bufs: list[torch.Tensor]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t.detach(), non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def loop(obtain: Callable[[], None], between: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Updates before, while `obtain` runs on a thread (or `between` on the loop's thread until it returns
        False), and after."""
        before = []
        last = time.perf_counter()
        for _ in range(15):
            update()
            now = time.perf_counter()
            before.append(now - last)
            last = now
        med = statistics.median(before[3:])
        done = threading.Event()
        err: list[BaseException] = []

        def run() -> None:
            try:
                obtain()
            except BaseException as exc:  # noqa: BLE001 - reported below
                err.append(exc)
            finally:
                done.set()

        t_start = time.perf_counter()
        th = threading.Thread(target=run, daemon=True)
        th.start()
        during: list[float] = []
        last = time.perf_counter()
        busy = True
        while not done.is_set() or busy:
            busy = between() if between is not None and busy else False
            update()
            now = time.perf_counter()
            during.append(now - last)
            last = now
        ready = time.perf_counter() - t_start
        th.join()
        if err:
            raise err[0]
        after = []
        for _ in range(5):
            update()
            now = time.perf_counter()
            after.append(now - last)
            last = now
        ratios = [d / med for d in during]
        return {
            "ready_s": ready,
            "update_median_s": med,
            "updates_during": len(during),
            "max_ratio": max(ratios),
            "over_1_1x": sum(r > 1.1 for r in ratios),
            "lost_s": sum(during) - len(during) * med,
            "ratios": [round(r, 3) for r in ratios],
            "after_max_ratio": max(a / med for a in after),
        }

    results: dict[str, Any] = {}

    def hostalloc_thread() -> dict[str, Any]:
        bufs: list[torch.Tensor] = []
        r = loop(lambda: bufs.extend(torch.empty(s, dtype=d, pin_memory=True) for s, d in shapes))
        r["copy_s"] = copy_into(bufs)
        t0 = time.perf_counter()
        bufs.clear()
        torch.cuda.synchronize()
        empty = getattr(
            torch._C, "_host_emptyCache", None
        )  # gives cudaHostAlloc's blocks back (torch >= 2.5)
        if empty is not None:
            empty()
        r["free_s"] = time.perf_counter() - t0
        return r

    def fault_only(threads: int, nice: int, huge: bool) -> Callable[[], dict[str, Any]]:
        def variant() -> dict[str, Any]:
            arena = Arena(shapes, huge=huge)
            r = loop(lambda: arena.fault(threads, nice))
            r["copy_s"] = copy_into(arena.bufs)
            return r

        return variant

    def try_register(ptr: int, n: int) -> str:
        """cudaHostRegister's result, as text ("0": registered); torch raises some errors and returns others."""
        try:
            return str(int(torch.cuda.cudart().cudaHostRegister(ptr, n, 0)))
        except Exception as exc:  # noqa: BLE001 - reported
            return str(exc).splitlines()[0][:80]

    def pieces(ptr: int, n: int, chunk: int) -> list[tuple[int, int]]:
        """[ptr, ptr+n) cut at multiples of `chunk` of the address (0: whole)."""
        if not chunk:
            return [(ptr, n)]
        out, a = [], ptr
        while a < ptr + n:
            z = min(ptr + n, (a // chunk + 1) * chunk)
            out.append((a, z - a))
            a = z
        return out

    def diagnose() -> dict[str, Any]:
        """Whether one buffer can be registered in pieces (the arena's chunks failed with 'invalid argument')."""
        res: dict[str, Any] = {}
        b = torch.empty(256 * MiB, dtype=torch.uint8)
        b.zero_()
        got = [try_register(p, n) for p, n in pieces(b.data_ptr(), b.numel(), 64 * MiB)]
        res["torch.empty 256M in 64M pieces"] = got
        for (p, _), rc in zip(pieces(b.data_ptr(), b.numel(), 64 * MiB), got, strict=True):
            if rc == "0":
                torch.cuda.cudart().cudaHostUnregister(p)
        m = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.uint8)
        t.zero_()
        base = t.data_ptr()
        got = [try_register(base, 8 * MiB), try_register(base + 8 * MiB, 8 * MiB)]
        res["mmap 8M + next 8M"] = got
        for p, rc in zip((base, base + 8 * MiB), got, strict=True):
            if rc == "0":
                torch.cuda.cudart().cudaHostUnregister(p)
        res["mmap whole 64M"] = try_register(base, 64 * MiB)
        if res["mmap whole 64M"] == "0":
            torch.cuda.cudart().cudaHostUnregister(base)
        res["mmap from +4K, 8M"] = try_register(base + 4096, 8 * MiB)
        if res["mmap from +4K, 8M"] == "0":
            torch.cuda.cudart().cudaHostUnregister(base + 4096)
        del t
        return res

    facts["diagnose"] = diagnose()
    print(f"[pin] diagnose {facts['diagnose']}", flush=True)

    def per_tensor(
        chunk: int, pace: int, touched: bool, thp: bool = False, on_loop: bool = False
    ) -> Callable[[], dict[str, Any]]:
        """Buffers as a save would have them, one per tensor (torch.empty, or with `thp` an anonymous mapping
        advised MADV_HUGEPAGE), registered in pieces of `chunk` bytes (0: whole), each call followed by
        (pace - 1) times its length asleep at nice 10. `touched`: first touched before the loop; else the one
        background thread allocates, touches and registers each buffer in turn, from nothing."""

        def variant() -> dict[str, Any]:
            bufs: list[torch.Tensor] = []
            maps: list[mmap.mmap] = []
            calls: list[float] = []
            done: list[int] = []

            def new(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
                if not thp:
                    return torch.empty(shape, dtype=dtype)
                n = shape.numel() * torch.empty((), dtype=dtype).element_size()
                m = mmap.mmap(-1, -(-n // HUGE) * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                m.madvise(mmap.MADV_HUGEPAGE)
                maps.append(m)
                return torch.frombuffer(m, dtype=torch.uint8)[:n].view(dtype).view(shape)

            def register_one(b: torch.Tensor) -> None:
                for p, n in pieces(b.data_ptr(), b.numel() * b.element_size(), chunk):
                    t0 = time.perf_counter()
                    rc = try_register(p, n)
                    calls.append(time.perf_counter() - t0)
                    if rc != "0":
                        raise RuntimeError(f"cudaHostRegister: {rc} after {len(done)} calls")
                    done.append(p)
                    if pace > 1:
                        time.sleep((pace - 1) * calls[-1])

            if touched:
                bufs.extend(new(s, d) for s, d in shapes)
                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(lambda b: b.zero_(), bufs))

            def thread() -> None:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
                if touched:
                    for b in bufs:
                        register_one(b)
                    return
                for s, d in shapes:
                    b = new(s, d)
                    b.zero_()
                    bufs.append(b)
                    register_one(b)

            try:
                if on_loop:
                    left = list(bufs)

                    def between() -> bool:
                        t_end = time.perf_counter() + 0.002
                        while left and time.perf_counter() < t_end:
                            register_one(left.pop(0))
                        return bool(left)

                    r = loop(lambda: None, between)
                else:
                    r = loop(thread)
                r["register_calls"] = len(calls)
                r["register_s"] = sum(calls)
                r["register_max_call_s"] = max(calls)
                r["register_median_call_s"] = statistics.median(calls)
                r["register_gb_per_s"] = nbytes / sum(calls) / GB
                r["copy_s"] = copy_into(bufs)
                if chunk:  # the same copies cut at the pieces' edges: one cudaMemcpyAsync per registration
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for b, t in zip(bufs, tensors, strict=True):
                        fb, ft = b.view(-1).view(torch.uint8), t.detach().view(-1).view(torch.uint8)
                        a = 0
                        for _, n in pieces(b.data_ptr(), fb.numel(), chunk):
                            fb[a : a + n].copy_(ft[a : a + n], non_blocking=True)
                            a += n
                    torch.cuda.synchronize()
                    r["copy_split_s"] = time.perf_counter() - t0
                if thp:
                    r["anon_huge_gb"] = next(
                        int(line.split()[1]) / 1e6
                        for line in Path("/proc/meminfo").read_text().splitlines()
                        if line.startswith("AnonHugePages")
                    )
            finally:
                t0 = time.perf_counter()
                for p in done:
                    torch.cuda.cudart().cudaHostUnregister(p)
                un = time.perf_counter() - t0
            r["unregister_s"] = un
            return r

        return variant

    def tensors_register() -> dict[str, Any]:
        """torch.empty per tensor (pageable), touched, then one cudaHostRegister per tensor on a thread."""
        bufs = [torch.empty(s, dtype=d) for s, d in shapes]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda b: b.zero_(), bufs))
        done: list[int] = []
        calls: list[float] = []

        def thread() -> None:
            for b in bufs:
                t0 = time.perf_counter()
                err = int(torch.cuda.cudart().cudaHostRegister(b.data_ptr(), b.numel() * b.element_size(), 0))
                calls.append(time.perf_counter() - t0)
                if err:
                    raise RuntimeError(f"cudaHostRegister: error {err} at tensor {len(done)}")
                done.append(b.data_ptr())

        try:
            r = loop(thread)
            r["register_s"] = sum(calls)
            r["register_max_call_s"] = max(calls)
            r["register_gb_per_s"] = nbytes / sum(calls) / GB
            r["copy_s"] = copy_into(bufs)
        finally:
            for ptr in done:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        return r

    def child_hostalloc() -> dict[str, Any]:
        out: list[str] = []

        def obtain() -> None:
            p = subprocess.run(
                [sys.executable, __file__, "--child", str(nbytes)], capture_output=True, text=True, check=True
            )
            out.append(p.stdout.strip().splitlines()[-1])

        r = loop(obtain)
        r.update(json.loads(out[0]))
        return r

    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "hostalloc-thread": hostalloc_thread,
        "fault-1-nice": fault_only(1, 10, False),
        "tensors-register": tensors_register,
        "whole-paced-10": per_tensor(0, 10, True),
        "whole-paced-20": per_tensor(0, 20, True),
        "2M-paced-10": per_tensor(2 * MiB, 10, True),
        "8M-paced-10": per_tensor(8 * MiB, 10, True),
        "whole-loop": per_tensor(0, 1, True, on_loop=True),
        "thp-whole-paced-10": per_tensor(0, 10, True, thp=True),
        "nothing-whole-paced-10": per_tensor(0, 10, False),
        "nothing-thp-whole-paced-10": per_tensor(0, 10, False, thp=True),
        "nothing-8M-paced-10": per_tensor(8 * MiB, 10, False),
        "child-hostalloc": child_hostalloc,
    }
    chosen = [v for v in args.variants.split(",") if v] or list(variants)
    for name in chosen:
        try:
            r = variants[name]()
        except Exception as exc:  # noqa: BLE001 - one variant failing must not cost the others
            r = {"error": repr(exc)}
        results[name] = r
        gc.collect()
        short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "ratios"}
        print(f"[pin] {name}: {short}", flush=True)
    print(
        "| variant | ready s | updates | max | > 1.1x | lost s | copy s | split copy s | register GB/s | max call ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | {r['error']} |")
            continue
        print(
            f"| {name} | {r['ready_s']:.2f} | {r['updates_during']} | {r['max_ratio']:.2f}x | {r['over_1_1x']} | "
            f"{r['lost_s']:.3f} | {r.get('copy_s', float('nan')):.3f} | {r.get('copy_split_s', float('nan')):.3f} | {r.get('register_gb_per_s', float('nan')):.1f} | "
            f"{1000 * r.get('register_max_call_s', float('nan')):.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": facts, "results": results}, indent=1))


if __name__ == "__main__":
    main()
