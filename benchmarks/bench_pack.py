"""Benchmark `pack` (hash while copying) against `cp -r` alone and `cp -r` + a separate `sha256sum` pass,
and `prepare --copy-mode hardlink` against `--copy-mode copy`, on a synthetic multi-GB run directory.

Each trial waits for an idle machine and starts after `sync`, so the page cache is warm and no
write-back of the previous trial is pending; the timed command's own write-back is not waited for
(the same for every contender).

    .venv/bin/python benchmarks/bench_pack.py --gb 3 --files 50
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import (
    drop_caches,
    median,
    run_cmd,
    timed,
    wait_quiet,
    warm,
    write_files,
)

from torchrelay.checkpoint.inventory import write_inventory
from torchrelay.config.relay import RelayConfig
from torchrelay.handoff.pack import HANDED_OFF, PackOptions, pack
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import build_contract, write_contract
from torchrelay.records.history import write_history
from torchrelay.util.hashing import default_jobs, sha256_file

UPDATE = 10


def make_run(run: Path, total: int, files: int) -> list[Path]:
    """A run directory whose checkpoint holds `files` big shards; everything else is small and real."""
    (run / "data").mkdir(parents=True)
    (run / "data" / "manifest.jsonl").write_text(
        "".join(json.dumps({"id": f"s{i}", "path": f"/data/s{i}.bin"}) + "\n" for i in range(64))
    )
    cfg = RelayConfig(
        seed=1, micro_batch=1, total_updates=100, manifest="data/manifest.jsonl", data_root="/data"
    )
    (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    write_contract(
        RunDir(run), build_contract(cfg.replace(manifest=str(run / "data/manifest.jsonl")), 1, None)
    )
    (run / "lineage.json").write_text(json.dumps({"lineage": "bench", "parent_lineage": None}))
    write_history(
        RunDir(run),
        [
            {
                "segment": "s1",
                "parent": None,
                "lineage": "bench",
                "world_size": 1,
                "first_update": 1,
                "last_update": UPDATE,
                "ended": "request",
                "started": time.time() - 60,
                "hosts": ["bench"],
            }
        ],
    )
    (run / "train").mkdir()
    with (
        open(run / "train" / "metrics-rank0.jsonl", "w") as m,
        open(run / "train" / "exposures-rank0.jsonl", "w") as e,
    ):
        for u in range(1, UPDATE + 1):
            m.write(json.dumps({"update": u, "loss": 1.0 / u, "lr": 1e-3}) + "\n")
            e.write(json.dumps({"u": u, "m": 0, "i": [u - 1]}) + "\n")
    ckpt = run / f"checkpoint-{UPDATE}"
    shards = write_files(ckpt / "model", total, files)
    (ckpt / "trainer_state.json").write_text(json.dumps({"format": 1, "loop": {"update": UPDATE}}))
    with ThreadPoolExecutor(default_jobs()) as pool:
        digests = list(pool.map(sha256_file, [*shards, ckpt / "trainer_state.json"]))
    entries = [
        {"path": p.relative_to(ckpt).as_posix(), "size": size, "sha256": d}
        for p, (d, size) in zip([*shards, ckpt / "trainer_state.json"], digests)
    ]
    write_inventory(ckpt, entries, update=UPDATE)
    return shards


def fresh(path: Path) -> None:
    """Remove the previous output and let its write-back and block discards finish before the next timing."""
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    time.sleep(3.0)
    subprocess.run(["sync"], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/torchrelay-bench-pack"))
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--files", type=int, default=50)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--cold-trials", type=int, default=2)
    ap.add_argument(
        "--quiet-wait", type=float, default=60.0, help="seconds to wait for an idle machine per step"
    )
    args = ap.parse_args()
    base = args.dir
    shutil.rmtree(base, ignore_errors=True)
    run, out = base / "run", base / "out"
    total = int(args.gb * 1e9)
    print(
        f"writing a run with {args.files} checkpoint files, {total / 1e9:.2f} GB, under {run} ...", flush=True
    )
    shards = make_run(run, total, args.files)
    marker = run / f"checkpoint-{UPDATE}" / HANDED_OFF
    results: dict[str, list[float]] = {
        k: [] for k in ("cp", "pack", "cp+sha256sum", "cp+sha256sum-P", "pack-link")
    }
    synced: dict[str, list[float]] = {k: [] for k in results}
    try:
        warm(shards)
        jobs = default_jobs()
        sums = f"cp -r {run} {out} && cd {out} && find . -type f -print0 | xargs -0 sha256sum > /dev/null"
        sums_p = f"cp -r {run} {out} && cd {out} && find . -type f -print0 | xargs -0 -n 4 -P {jobs} sha256sum > /dev/null"

        def do_pack(link: bool) -> float:
            seconds = timed(lambda: pack(run, out, PackOptions(link=link)))
            marker.unlink()
            return seconds

        contenders = {
            "cp": lambda: run_cmd(["cp", "-r", str(run), str(out)]),
            "pack": lambda: do_pack(False),
            "cp+sha256sum": lambda: run_cmd(sums),
            "cp+sha256sum-P": lambda: run_cmd(sums_p),
            "pack-link": lambda: do_pack(True),
        }
        names = list(contenders)
        for i in range(args.trials):
            # rotate the order: deleting the previous contender's copy (ext4 here discards freed blocks)
            # weighs on whoever runs next, so nobody may always come second
            for name in names[i % len(names) :] + names[: i % len(names)]:
                fresh(out)
                wait_quiet(args.quiet_wait)
                t0 = time.perf_counter()
                results[name].append(contenders[name]())
                subprocess.run(["sync"], check=True)
                synced[name].append(time.perf_counter() - t0)
            print(f"trial {i}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in results.items()), flush=True)
        # cold page cache (a real multi-GB checkpoint does not fit in RAM): caches dropped before each contender
        cold: dict[str, list[float]] = {"cp": [], "pack": [], "cp+sha256sum": []}
        if drop_caches():
            for _ in range(args.cold_trials):
                for name in cold:
                    fresh(out)
                    wait_quiet(args.quiet_wait)
                    drop_caches()
                    if name == "cp":
                        cold[name].append(run_cmd(["cp", "-r", str(run), str(out)]))
                    elif name == "pack":
                        cold[name].append(timed(lambda: pack(run, out, PackOptions())))
                        marker.unlink()
                    else:
                        cold[name].append(
                            run_cmd(
                                f"cp -r {run} {out} && cd {out} && find . -type f -print0 | xargs -0 sha256sum > /dev/null"
                            )
                        )
                print("cold: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in cold.items()), flush=True)
            warm(shards)
        # prepare: from a packed bundle, copy vs hardlink (same filesystem)
        fresh(out)
        pack(run, out, PackOptions())
        marker.unlink()
        warm([p for p in out.rglob("*") if p.is_file()])
        prep: dict[str, list[float]] = {"copy": [], "hardlink": []}
        for _ in range(args.trials):
            for mode in ("copy", "hardlink"):
                target = base / f"prepared-{mode}"
                fresh(target)
                wait_quiet(args.quiet_wait)
                prep[mode].append(
                    timed(
                        lambda m=mode, t=target: prepare(
                            out, PrepareOptions(run_dir=t, copy_mode=m), say=lambda s: None
                        )
                    )
                )
                shutil.rmtree(target)
        med = {k: median(v) for k, v in results.items()}
        gb = total / 1e9
        lines = [
            f"run: {gb:.2f} GB in {args.files} checkpoint files + small files; warm page cache; {args.trials} trials (medians; all in raw)",
            f"cp -r alone: {med['cp']:.2f} s ({gb / med['cp']:.2f} GB/s)",
            f"torchrelay pack (hash while copying, SHA256SUMS, README, progress): {med['pack']:.2f} s "
            f"({gb / med['pack']:.2f} GB/s) = **{med['pack'] / med['cp']:.2f} x cp -r** (goal <= 1.10)",
            f"until the bytes are on disk (command + sync): cp -r {median(synced['cp']):.2f} s, pack {median(synced['pack']):.2f} s "
            f"= **{median(synced['pack']) / median(synced['cp']):.2f} x cp -r**, cp -r + sha256sum {median(synced['cp+sha256sum']):.2f} s, "
            f"pack --link {median(synced['pack-link']):.2f} s",
            f"cp -r + separate sha256sum pass: {med['cp+sha256sum']:.2f} s = {med['cp+sha256sum'] / med['pack']:.2f} x pack's time; "
            f"with {default_jobs()} parallel sha256sum: {med['cp+sha256sum-P']:.2f} s",
            f"pack --link (hardlinks, hashing in place): {med['pack-link']:.2f} s",
            (
                f"cold cache: cp -r {median(cold['cp']):.2f} s, pack {median(cold['pack']):.2f} s "
                f"= **{median(cold['pack']) / median(cold['cp']):.2f} x cp -r**, cp -r + sha256sum {median(cold['cp+sha256sum']):.2f} s"
                if cold["cp"]
                else "cold cache: not measured (cannot drop the page cache here)"
            ),
            f"prepare --copy-mode copy: median {median(prep['copy']):.2f} s; --copy-mode hardlink: median "
            f"{median(prep['hardlink']):.2f} s (both verify every byte first, then copy/link and re-hash)",
        ]
        print("\n".join(lines))
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "bytes": total,
                        "files": args.files,
                        **results,
                        "synced": synced,
                        "cold": cold,
                        "prepare": prep,
                    },
                    indent=1,
                )
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["sync"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
