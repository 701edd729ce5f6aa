"""The verified resume against the cold read of the checkpoint's own files, one variant of the load at a time
(issue 11: >= 0.85 of the cold-read floor, and faster than DCP's unverified load).

The state (`--layers` x Linear(width, width) + AdamW after one step, DDP on one rank) is saved ONCE by torchrelay;
then, in this process: the cold read of the checkpoint's tensor files (`--streams` threads, pages dropped with
posix_fadvise: bench_save's floor), DCP save + cold load of the same state (unless --no-dcp), one warm resume that
is not counted (imports, CUDA streams), and a cold resume (Run.open + run.track) for each variant of
LoadTuning's fields (config/tuning.py). Before each resume every tensor of the model and optimizer is zeroed; after it each
must be `torch.equal` to its value at the save. Each row prints the wall time, its ratio to the cold read and to
DCP load, and the load's own timings (seconds summed over the threads that spend them).

    PYTHONPATH=src torchrun --standalone --nproc_per_node=1 benchmarks/bench_load.py --device cuda \\
        --backend nccl --layers 72 --width 4096 --dir /root --json $OUT/load.json
    PYTHONPATH=src torchrun --standalone --nproc_per_node=1 benchmarks/bench_load.py --device cpu \\
        --backend gloo --layers 4 --width 512 --file-bytes 1000000 --variant 'one file:load_buffer=1'

A variant is `name:KNOB=VALUE,KNOB=VALUE` over LoadTuning's defaults (VALUE: an integer, with K, M or G for
powers of 1024, or true/false); `--variants a,b` runs only those of the built-in ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_save  # noqa: E402
from bench_save import (  # noqa: E402
    GB,
    drop_cache,
    load_with_stats,
    make_state,
    save_once,
    sync,
    timed,
)
from benchlib import cpu_seconds, drop_caches  # noqa: E402

import torchrelay as tr  # noqa: E402
from torchrelay.checkpoint import dcp_io, load_memory  # noqa: E402
from torchrelay.config.tuning import LoadTuning, SaveTuning  # noqa: E402
from torchrelay.util import sha256_parts  # noqa: E402
from torchrelay.util.meminfo import meminfo_kib  # noqa: E402

DROP_ALL = False  # --drop-all: the whole page cache dropped before each cold read and each cold resume


def _memory() -> dict[str, float]:
    """GB free and GB of page cache now: a page cache holding what ran before (bench_save's checkpoints) leaves
    the reads and the load's new memory to reclaim it first."""
    got = meminfo_kib("MemFree", "Cached") or {}
    return {k: round(v * 1024 / GB, 2) for k, v in got.items()}


def _drop_all() -> None:
    """--drop-all: every page of the host's page cache dropped (root), not only the checkpoint files'."""
    if DROP_ALL and not drop_caches():
        raise SystemExit("--drop-all: could not drop the page cache (needs root)")


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU seconds so far by kind (/proc/stat, every core): `steal` is time the hypervisor gave
    this machine's cores to something else, `iowait` idle time with a read outstanding."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    got = {k: int(v) / tick for k, v in zip(names, fields)}
    return {
        "busy": got["user"] + got["nice"] + got["system"] + got["irq"] + got["softirq"],
        "iowait": got["iowait"],
        "steal": got["steal"],
        "irq": got["irq"] + got["softirq"],
    }


def cpu_delta(before: dict[str, float]) -> dict[str, float]:
    now = machine_cpu()
    return {f"machine_{k}_s": round(now[k] - before[k], 2) for k in before if k in now}


class SideWork:
    """The load's CPU work without its reads, beside a cold read (--busy-floor): `hashers` threads hash and
    `copiers` threads copy into the device 16 MiB pieces of a host buffer, each kind paced to `rate` bytes a second
    and `total` bytes at most (a verified load hashes every byte it reads once and copies it once, at the read's
    speed)."""

    PIECE = 16 << 20

    def __init__(self, rate: float, total: int, hashers: int, copiers: int, dev: str) -> None:
        self.rate, self.total, self.dev = rate, total, dev
        self.src = torch.ones(256 << 20, dtype=torch.uint8)  # pageable, as the load's slabs
        self.done = {"hash": 0, "copy": 0}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = 0.0
        self.threads = [threading.Thread(target=self._hash, daemon=True) for _ in range(hashers)]
        self.threads += [threading.Thread(target=self._copy, daemon=True) for _ in range(copiers)]

    def _next(self, kind: str) -> int | None:
        """The offset of the next piece of `kind` once the pace allows it; None once stopped or all done."""
        while not self.stop.is_set():
            with self.lock:
                if self.done[kind] >= self.total:
                    return None
                if self.done[kind] + self.PIECE <= self.rate * (time.perf_counter() - self.t0):
                    offset = self.done[kind] % (self.src.numel() - self.PIECE)
                    self.done[kind] += self.PIECE
                    return offset
            time.sleep(0.001)
        return None

    def _hash(self) -> None:
        while (offset := self._next("hash")) is not None:
            hashlib.sha256(self.src[offset : offset + self.PIECE].numpy())

    def _copy(self) -> None:
        dst = torch.empty(self.PIECE, dtype=torch.uint8, device=self.dev)
        while (offset := self._next("copy")) is not None:
            dst.copy_(self.src[offset : offset + self.PIECE])

    def __enter__(self) -> SideWork:
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def cold_read(files: list[Path], streams: int, direct: bool = False) -> float:
    """bench_save's floor (each file's pages dropped, then read), after _drop_all."""
    _drop_all()
    return bench_save.cold_read(files, streams, direct)


def pattern_read(files: list[Path], streams: int, at_once: int, chunk: int = 16 << 20) -> float:
    """The cold read in the load's own pattern, nothing else: `streams` threads share the `chunk`-sized reads of
    the first `at_once` files not yet fully asked for, the one served longest ago next (verified_read's
    `_next`), each into its thread's reused buffer — no slab, no hash, no copy. Beside the floor (a thread per
    file, front to back) it says whether the disk serves the load's pattern slower than the floor's."""
    _drop_all()
    for f in files:
        drop_cache(f)
    lock = threading.Lock()
    pending = [[f, f.stat().st_size, 0, 0] for f in files]  # path, size, next offset, last served
    turn = [0]
    fds: list[int] = []

    def take() -> tuple[int, int, int] | None:
        with lock:
            if not pending:
                return None
            job = min(pending[:at_once], key=lambda g: g[3])
            if job[2] == 0:
                job.append(os.open(job[0], os.O_RDONLY))
                fds.append(job[4])
            offset = job[2]
            job[2] += chunk
            job[3] = turn[0]
            turn[0] += 1
            if job[2] >= job[1]:
                pending.remove(job)
            return job[4], offset, min(chunk, job[1] - offset)

    def one() -> None:
        buf = bytearray(chunk)
        while (job := take()) is not None:
            fd, offset, want = job
            view = memoryview(buf)[:want]
            got = 0
            while got < want and (n := os.preadv(fd, [view[got:]], offset + got)):
                got += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return took


# A variant's knobs: LoadTuning's fields, passed in the resume's configuration (none patches the library).
KNOBS = tuple(f.name for f in dataclasses.fields(LoadTuning))
# Set by the benchmark itself: SWITCH_INTERVAL, the interpreter's GIL switch interval during the resume (seconds).
BENCH_KNOBS = ("SWITCH_INTERVAL",)
CONTROL = "cold-read"  # --control-floor's row: a cold read measured where a variant would be
# The threads share the chunks of the first files, within 4 GiB; or a thread per file, the budget from MemAvailable.
SHARED_CHUNKS = {"per_file_reader": False, "load_buffer": 4 << 30}
PER_FILE = {"per_file_reader": True, "load_buffer": 0}
# Each over LoadTuning's defaults (names without commas: --variants takes a list). "before": a fresh buffer per
# file, the earliest file's chunks first. "default": a thread per file where the buffer holds a file for each
# thread, else shared chunks.
BUILT_IN: dict[str, dict[str, Any]] = {
    "before": {**SHARED_CHUNKS, "files_at_once": 1, "reuse_slabs": False},
    "shared-chunks": SHARED_CHUNKS,
    "default": {},
    "per-file": PER_FILE,
    "per-file-4GiB": {**PER_FILE, "load_buffer": 4 << 30},  # the fallback when memory is short
    "per-file-8-hash": {**PER_FILE, "hash_threads": 8},
    "per-file-readers-hash": {**PER_FILE, "hash_threads": 0},  # each file's reading thread hashes it
    "per-file-8-streams": {**PER_FILE, "read_streams": 8},
    "parse-4": {"parse_threads": 4},
    "at-once-8": {"files_at_once": 8, "load_buffer": 8 << 30},  # shared chunks of 8 files at once
    "whole-files": {"use_parts": False},  # each file hashed in order, used once all of it matched
    "free-before-return": {"free_later": False},
    "streams-32": {"read_streams": 32},  # more reads in flight (the disk's queue)
    "chunk-64": {"chunk_bytes": 64 << 20},  # fewer, longer reads
    "hash-8": {"hash_threads": 8},
    "pool-hashes-last": {"readers_hash_last": False},  # the last parts queued for the hash threads
}


def parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if "." in low and low[-1:].isdigit():
        return float(low)
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(low[-1:], 1)
    return int(float(low[:-1] if scale > 1 else low) * scale)


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, spec = text.partition(":")
    knobs: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in KNOBS + BENCH_KNOBS:
            raise SystemExit(f"--variant {text!r}: {key!r} is not one of {', '.join(KNOBS + BENCH_KNOBS)}")
        knobs[key.strip()] = parse_value(value)
    return name.strip(), knobs


def torch_checkpointing_load(
    ddp: Any, opt: Any, base: Path, dev: str, current: Any, saved: list[torch.Tensor]
) -> float | None:
    """torch_checkpointing (meta-pytorch) as a peer: one save (waited for), then its cold load into the zeroed
    model and optimizer, checked equal; None when it is not installed. Buffered writes: 0.1.1's O_DIRECT fails
    with EINVAL on ext4."""
    try:
        import torch_checkpointing as tc
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError:
        print("[load] torch_checkpointing is not installed: its row is skipped", flush=True)
        return None
    msd, osd = get_state_dict(ddp, opt)
    payload = {"model": msd, "optim": osd}
    mgr = tc.CheckpointManager(
        tc.CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    )
    target = base / "tc"
    fut = mgr.save(str(target), payload)
    if fut is not None:
        fut.result()
    with torch.no_grad():
        for t in current():
            t.zero_()
    drop_cache(target)
    seconds = timed(lambda: mgr.load(str(target), into=payload), dev)
    mgr.close()
    shutil.rmtree(target)
    equal = all(torch.equal(a, b) for a, b in zip(current(), saved, strict=True))
    print(f"[load] torch_checkpointing load, cold: {seconds:.3f} s, equal {equal}", flush=True)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16, help="threads of the cold-read floor")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--no-dcp", action="store_true", help="skip DCP save + cold load (about 30 s on the GPU host)"
    )
    ap.add_argument(
        "--variants", default="", help="comma-separated names of built-in variants (default: all)"
    )
    ap.add_argument("--no-tc", action="store_true", help="skip torch_checkpointing's save + cold load")
    ap.add_argument("--variant", action="append", default=[], help="name:KNOB=VALUE,... (repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of cold resumes, the variants alternating")
    ap.add_argument(
        "--file-bytes", type=int, default=0, help="SaveTuning.file_bytes for the save (0: default)"
    )
    ap.add_argument(
        "--warm",
        default="",
        help="comma-separated variants resumed once each with the files in the page cache",
    )
    ap.add_argument(
        "--direct-floor",
        action="store_true",
        help="the O_DIRECT cold read too, beside each cold read (Linux)",
    )
    ap.add_argument(
        "--pattern-floor",
        action="store_true",
        help="the cold read in the default load's pattern too (shared chunks of its first files), each round",
    )
    ap.add_argument(
        "--busy-floor",
        action="store_true",
        help="the cold read again with the load's hashing and copying beside it (in-memory, paced), each round",
    )
    ap.add_argument(
        "--control-floor",
        action="store_true",
        help=f"a cold read among each round's variants too, as {CONTROL!r}: the disk's own spread against the "
        "round's mean",
    )
    ap.add_argument(
        "--bracket",
        action="store_true",
        help="the cold read again at the end of each round: each variant also against the mean of its round's two",
    )
    ap.add_argument(
        "--drop-all",
        action="store_true",
        help="drop the host's whole page cache (root) before each cold read and cold resume, not only the files'",
    )
    args = ap.parse_args()
    global DROP_ALL
    DROP_ALL = args.drop_all

    variants = dict(BUILT_IN)
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in BUILT_IN]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; built in: {list(BUILT_IN)}")
        variants = {n: BUILT_IN[n] for n in names}
    if args.variant and not args.variants:
        variants = {}
    variants.update(parse_variant(v) for v in args.variant)
    defaults = dataclasses.asdict(LoadTuning())

    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29517"),
    ):
        os.environ.setdefault(key, value)  # run without torchrun: one rank
    dist.init_process_group(args.backend)
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(0)
    base, manifest, model, ddp, opt = make_state(args, "bench-load-")
    ddp(torch.randn(args.batch, args.width, device=dev)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(dev)

    def current() -> list[torch.Tensor]:
        """Every tensor a resume restores, in a fixed order (the optimizer's are new objects after a load)."""
        out: list[torch.Tensor] = []
        for p in model.parameters():
            out.append(p)
            st = opt.state.get(p, {})
            out.extend(st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor))
        return out

    nbytes = sum(t.numel() * t.element_size() for t in current())
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "cores": len(os.sched_getaffinity(0)),
        "bytes": nbytes,
        "defaults": defaults,
        "variants": variants,
    }
    print(f"[load] state {nbytes / GB:.2f} GB in {len(current())} tensors; dir {base}", flush=True)

    save_tuning = SaveTuning(file_bytes=args.file_bytes) if args.file_bytes else SaveTuning()
    out["part_bytes"] = sha256_parts.PART_BYTES
    ckpt, files, t_save = save_once(base, manifest, ddp, opt, dev, save_tuning)
    saved = [t.detach().clone() for t in current()]  # on the device: torch.equal runs there
    sizes = [f.stat().st_size for f in files]
    print(
        f"[load] torchrelay save {t_save:.1f} s: {len(files)} tensor files, largest {max(sizes) / GB:.3f} GB",
        flush=True,
    )
    floor = cold_read(files, args.streams)
    print(
        f"[load] floor: cold read of the {len(files)} files, {args.streams} streams: {floor:.3f} s",
        flush=True,
    )
    out.update(files=len(files), largest_file=max(sizes), cold_read_s=floor, save_s=t_save)

    dcp_s = None
    if not args.no_dcp:
        msd, osd = get_state_dict(ddp, opt)
        dcp_dir = base / "dcp"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir))
        drop_cache(dcp_dir)
        dcp_s = timed(lambda: dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir)), dev)
        shutil.rmtree(dcp_dir)
        del msd, osd
        print(f"[load] DCP load, cold: {dcp_s:.3f} s", flush=True)
    out["dcp_load_s"] = dcp_s
    tc_s = None if args.no_tc else torch_checkpointing_load(ddp, opt, base, dev, current, saved)
    out["torch_checkpointing_load_s"] = tc_s

    phases: dict[str, float] = {}
    plain_load = dcp_io.load
    switch_interval = sys.getswitchinterval()

    def tuning_of(knobs: dict[str, Any]) -> LoadTuning:
        """LoadTuning's defaults, `knobs` over them; the switch interval of the interpreter set as they say."""
        sys.setswitchinterval(float(knobs.get("SWITCH_INTERVAL", 0)) or switch_interval)
        return LoadTuning(**{k: v for k, v in knobs.items() if k not in BENCH_KNOBS})

    def resume(knobs: dict[str, Any], cold: bool) -> dict[str, Any]:
        tuning = tuning_of(knobs)
        with torch.no_grad():
            for t in current():
                t.zero_()
        if cold:
            drop_cache(ckpt)
            _drop_all()
        memory = _memory()
        sync(dev)
        used = cpu_seconds()
        machine_before = machine_cpu()
        t0 = time.perf_counter()
        r = tr.Run.open(
            base / "run", None, code_dir=base / "code", overrides={"load_tuning": dataclasses.asdict(tuning)}
        )
        t_open = time.perf_counter() - t0
        try:
            r.track(model=ddp, optimizer=opt)
            sync(dev)
        except BaseException as exc:
            r.close(exc)  # the segment ends (error) and the run is free for the next variant
            raise
        wall = time.perf_counter() - t0
        cpu_s = cpu_seconds() - used
        machine = cpu_delta(machine_before)
        r._end_segment(1)
        now = current()
        wrong = [i for i, (a, b) in enumerate(zip(now, saved, strict=False)) if not torch.equal(a, b)]
        equal = len(now) == len(saved) and not wrong
        return {
            "s": wall,
            "cpu_s": cpu_s,
            "memory_at_start": memory,
            "open_s": t_open,
            "equal": equal,
            "unequal": wrong[:5],
            **machine,
            **phases,
        }

    dcp_io.load = load_with_stats(plain_load, phases)  # type: ignore[assignment]  # the resume's breakdown
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        row = resume({}, cold=False)  # imports, streams, the CUDA context of each thread: not counted
        print(f"[load] warm-up resume (warm, default): {row['s']:.3f} s, equal {row['equal']}", flush=True)
        out["warm_default"] = row
        for name in filter(None, (n.strip() for n in args.warm.split(","))):
            knobs = variants.get(name, BUILT_IN.get(name))
            if knobs is None:
                raise SystemExit(f"--warm {name!r}: not a variant; built in: {list(BUILT_IN)}")
            for f in files:
                f.read_bytes()  # in the page cache, as after a save on this host
            row = resume(knobs, cold=False)
            print(f"[load] {name} (warm): {row['s']:.3f} s, equal {row['equal']}", flush=True)
            rows.append((f"{name} (warm)", {"knobs": knobs, **row}))
        for i in range(args.repeat):  # the variants alternate: a drift of the disk falls on all of them
            # the floor again in each round, beside its variants: this disk's rate moved by up to a fifth within
            # one call (2026-12-02), more than the variants differ
            out.setdefault("round_floors_memory", []).append(_memory())
            used = cpu_seconds()
            machine_before = machine_cpu()
            round_floor = cold_read(files, args.streams)
            out.setdefault("round_floors_s", []).append(round_floor)
            out.setdefault("round_floors_cpu_s", []).append(cpu_seconds() - used)
            out.setdefault("round_floors_machine", []).append(cpu_delta(machine_before))
            print(
                f"[load] round {i + 1}: cold read {round_floor:.3f} s, "
                f"{out['round_floors_cpu_s'][-1]:.2f} CPU s, machine {out['round_floors_machine'][-1]}",
                flush=True,
            )
            if args.busy_floor:
                machine_before = machine_cpu()
                hashers, copiers = defaults["hash_threads"], defaults["parse_threads"]
                with SideWork(nbytes / round_floor, nbytes, hashers, copiers, dev) as side:
                    busy = cold_read(files, args.streams)
                out.setdefault("round_busy_floors_s", []).append(busy)
                out.setdefault("round_busy_floors_machine", []).append(cpu_delta(machine_before))
                out.setdefault("round_busy_side_gb", []).append(
                    {k: round(v / GB, 2) for k, v in side.done.items()}
                )
                print(
                    f"[load] round {i + 1}: cold read with the load's hashing and copying beside it {busy:.3f} s "
                    f"= {round_floor / busy:.2f} of the floor's speed (side work {out['round_busy_side_gb'][-1]} "
                    f"GB), machine {out['round_busy_floors_machine'][-1]}",
                    flush=True,
                )
            direct_floor = None
            if args.direct_floor:
                direct_floor = cold_read(files, args.streams, direct=True)
                out.setdefault("round_direct_floors_s", []).append(direct_floor)
                print(f"[load] round {i + 1}: cold read by O_DIRECT {direct_floor:.3f} s", flush=True)
            if args.pattern_floor:
                tuning = tuning_of({})  # the default load's knobs, not the last variant's
                at_once = load_memory.files_at_once(tuning, max(sizes), load_memory.load_budget(tuning))
                pattern = pattern_read(files, tuning.read_streams, at_once, tuning.chunk_bytes)
                out.setdefault("round_pattern_floors_s", []).append(pattern)
                out["pattern_at_once"] = at_once
                print(
                    f"[load] round {i + 1}: cold read in the load's pattern ({at_once} files at once) "
                    f"{pattern:.3f} s = {round_floor / pattern:.2f} of the floor's speed",
                    flush=True,
                )
            order: list[tuple[str, dict[str, Any] | None]] = list(variants.items())
            if args.control_floor:  # the cold read in a variant's place: how far the disk alone strays
                order.insert(len(order) // 2, (CONTROL, None))
            if i % 2:  # every other round in reverse: a drift within a round falls on each variant alike
                order.reverse()
            for name, knobs in order:
                label = name if args.repeat == 1 else f"{name} #{i + 1}"
                try:
                    if knobs is None:
                        row = {"s": cold_read(files, args.streams), "cpu_s": 0.0, "equal": True}
                    else:
                        row = resume(knobs, cold=True)
                except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
                    row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    print(f"[load] {label}: FAILED {row['error']}", flush=True)
                else:
                    row["round_floor_s"] = round_floor
                    row["round_direct_floor_s"] = direct_floor
                    also = f", {direct_floor / row['s']:.2f} of its O_DIRECT one" if direct_floor else ""
                    print(
                        f"[load] {label}: machine steal {row.get('machine_steal_s')} s, iowait "
                        f"{row.get('machine_iowait_s')} s, busy {row.get('machine_busy_s')} s",
                        flush=True,
                    )
                    print(
                        f"[load] {label}: {row['s']:.3f} s ({row['cpu_s']:.2f} CPU s), "
                        f"{floor / row['s']:.2f} of cold read, "
                        f"{round_floor / row['s']:.2f} of its round's{also}, equal {row['equal']}, "
                        f"{row.get('bytes_direct', 0) / GB:.2f} GB by O_DIRECT",
                        flush=True,
                    )
                rows.append((label, {"knobs": knobs, **row}))
            if args.bracket:  # the disk's drift within the round: the floor after its variants too
                machine_before = machine_cpu()
                end_floor = cold_read(files, args.streams)
                out.setdefault("round_end_floors_machine", []).append(cpu_delta(machine_before))
                out.setdefault("round_end_floors_s", []).append(end_floor)
                mean = (round_floor + end_floor) / 2
                print(
                    f"[load] round {i + 1}: cold read again {end_floor:.3f} s (mean {mean:.3f})", flush=True
                )
                for label, row in rows:
                    if row.get("round_floor_s") == round_floor and "s" in row:
                        row["round_mean_floor_s"] = mean
                        print(
                            f"[load]   {label}: {mean / row['s']:.2f} of the round's mean cold read",
                            flush=True,
                        )
    finally:
        dcp_io.load = plain_load  # type: ignore[assignment]
        tuning_of({})  # the interpreter's switch interval back
    out["rows"] = dict(rows)
    floor_after = cold_read(files, args.streams)  # the disk may drift over a run: the floor again, last
    out["cold_read_after_s"] = floor_after
    print(f"[load] floor again after the resumes: {floor_after:.3f} s", flush=True)

    lines = [
        f"state {nbytes / GB:.2f} GB in {len(files)} files (largest {max(sizes) / GB:.2f} GB), torch "
        f"{out['torch']}, {out['device']}, {out['cores']} cores; cold read {floor:.3f} s "
        f"({nbytes / floor / GB:.2f} GB/s; after the resumes {floor_after:.3f} s)"
        + (f"; DCP load cold {dcp_s:.3f} s" if dcp_s else "")
        + (
            f"; torch_checkpointing load cold {tc_s:.3f} s = {floor / tc_s:.2f} of the cold read"
            if tc_s
            else ""
        ),
        "| variant | s | vs cold read (goal >= 0.95) | vs its round's cold read | vs its round's O_DIRECT read | "
        "vs DCP load | equal | load wall | read | read idle | "
        "hash | parse | copy | alloc | first read at | reads done at | copies done at | load ends at | "
        "metadata check | DCP plan | DCP after reads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error'][:200]} |")
            continue
        vs_dcp = f"{r['s'] / dcp_s:.2f}x" if dcp_s else ""
        cols = " | ".join(
            f"{r.get(k, 0.0):.2f}"
            for k in (
                *("wall", "read", "read_idle", "hash", "parse", "copy", "alloc"),
                *("at_first_read", "at_reads_done", "at_copies_done", "at_end"),
                *("span_check", "span_plan", "span_after_reads"),
            )
        )
        vs_round = f"{r['round_floor_s'] / r['s']:.2f}" if "round_floor_s" in r else ""
        vs_direct = f"{r['round_direct_floor_s'] / r['s']:.2f}" if r.get("round_direct_floor_s") else ""
        lines.append(
            f"| {label} | {r['s']:.3f} | {floor / r['s']:.2f} | {vs_round} | {vs_direct} | {vs_dcp} | "
            f"{r['equal']} | {cols} |"
        )
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    shutil.rmtree(base, ignore_errors=True)
    ok = all(r.get("equal") for _, r in rows) and out["warm_default"]["equal"]
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        sys.exit("[load] a variant failed or loaded a tensor that differs from the saved one")


if __name__ == "__main__":
    main()
