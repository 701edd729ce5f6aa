"""The memory tier: what a memory checkpoint costs the loop, and what it saves a restart.

    python benchmarks/bench_memory_tier.py --d-model 512 --layers 8 --updates 30 --json out.json
    PYTHONPATH=src python3 benchmarks/bench_memory_tier.py --device cuda --d-model 1536 --layers 24 \
        --updates 40 --every 10 --pace 0.5

One process (world size 1, gloo or NCCL) of examples/train_lm.py, each measurement a fresh run directory:
- the loop's gap between two updates (the `time` of update k minus that of k-1 minus k's `update_time`, from the
  run's own metrics log): a plain loop (no save), a memory checkpoint every `--every` updates (`memory_every`), a
  durable checkpoint as often (`save_every`); stall per save = the median gap after a saved update minus the
  plain loop's gap; blocked per save = the gaps from a saved update to the next save, minus as many of the plain
  loop's (the stall, and the next save's wait for this one to commit); lost per save = the mean interval between
  updates minus the plain one, times `--every` (a copy the next update's step waits for is in it); the share of
  intervals over 1.1x their median, per loop; the device->host copy floor of the state's bytes;
- restart to the first update after a SIGKILL: from the memory tier, and from the durable tier (a checkpoint of
  the same state on disk, its pages dropped first), each from the relaunch's process start (imports included, the same for both) to the
  `time` its first update logged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from benchlib import drop_cache

HERE = Path(__file__).resolve()
EXAMPLES = HERE.parents[1] / "examples"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRELAY_", "SLURM_"))}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = HERE.parents[1] / "src"
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _config(out: Path, args: argparse.Namespace) -> Path:
    sys.path.insert(0, str(EXAMPLES))
    import prepare_data  # type: ignore[import-not-found]

    root, manifest = prepare_data.build(out / "data", 12, 256)
    cfg = yaml.safe_load((EXAMPLES / "lm.yaml").read_text())
    cfg.update(manifest=str(manifest), data_root=str(root), total_updates=args.updates, warmup_updates=1)
    cfg.update(micro_batch=2, grad_accum=1, save_every=args.updates)
    cfg["params"].update(d_model=args.d_model, layers=args.layers, heads=4, seq_len=32, dropout=0.0)
    cfg["params"]["device"] = args.device
    path = out / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cmd(run: Path, config: Path | None, sets: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, str(EXAMPLES / "train_lm.py"), "--run-dir", str(run)]
    cmd += ["--config", str(config)] if config else []
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def _metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "train" / "metrics-rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by the kill
            out.append(json.loads(line))
    return out


def gaps(run: Path) -> dict[int, float]:
    """The loop's time before each update beyond the update itself, by update: a save of update u is in u+1's (the
    loop saves after logging u), the wait for the save before to commit in u's (the loop waits before logging a
    saving update). The first update's gap, holding the warm-up's start, is left out."""
    rows = _metrics(run)
    gap = {
        b["update"]: b["time"] - a["time"] - b["update_time"]
        for a, b in zip(rows, rows[1:], strict=False)
        if b["update"] == a["update"] + 1
    }
    gap.pop(min(gap), None)
    return gap


def intervals(run: Path) -> list[float]:
    """Seconds from each update's log line to the next one's: the update, the loop around it and a save's stall
    (on a GPU the loss's `.item()` waits for the device each update, so a copy the step waits for is in it)."""
    rows = _metrics(run)
    return [
        b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False) if b["update"] == a["update"] + 1
    ][1:]


def _loop(out: Path, config: Path, name: str, sets: dict[str, Any], every: int) -> dict[str, float]:
    run = out / name
    done = subprocess.run(_cmd(run, config, sets), env=_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
    times = intervals(run)
    median = statistics.median(times)
    gap = gaps(run)
    # per save of update u: the loop's time beyond its updates from u's log line to the next save's (the stall of
    # u, and the wait of the next save for u to commit); the saves whose window was all timed
    windows = [
        [gap[v] for v in range(u + 1, u + every + 1)]
        for u in range(every, max(gap) + 1, every)
        if all(v in gap for v in range(u + 1, u + every + 1))
    ]
    return {
        "gap_s": statistics.median(gap.values()),
        "stall_per_save_s": statistics.median(w[0] for w in windows) if windows else 0.0,
        "window_gaps_s": statistics.median(sum(w) for w in windows) if windows else 0.0,
        "interval_median_s": median,
        "interval_mean_s": statistics.fmean(times),
        "slow_share": sum(t > 1.1 * median for t in times) / len(times),
        "updates_timed": len(times),
        "saves_timed": len(windows),
    }


def _killed_then_restarted(
    out: Path, config: Path, name: str, sets: dict[str, Any], at: int, tier: str
) -> float:
    """SIGKILL the run once `at` is saved in `tier`; relaunch; seconds from the relaunch to its first update."""
    run = out / name
    proc = subprocess.Popen(
        _cmd(run, config, sets | {"params.min_update_s": 0.5}), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 1800
    while time.time() < deadline and proc.poll() is None:
        if _saved(run, at, tier):
            break
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _saved(run, at, tier), f"{name}: checkpoint-{at} not saved in the {tier} tier before the kill"
    if tier == "durable":
        _forget_memory(run)
        drop_cache(run)  # a resume after a crash reads the checkpoint cold, from the disk
    started = time.time()
    # the first launch was paced (a runtime param: no bit changes) so that the kill lands mid-run; this one is not
    relaunch = _cmd(run, None, {"params.min_update_s": 0})
    done = subprocess.run(relaunch, env=_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} relaunch: exit {done.returncode}: {done.stderr[-2000:]}")
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines() if x.strip()]
    assert history[-1].get("resumed_tier") == tier, history[-1]
    first = history[-1]["first_update"]
    return next(r["time"] for r in _metrics(run) if r["update"] == first) - started


def _memory_root(run: Path) -> Path:
    from torchrelay.checkpoint.tiers import memory_root
    from torchrelay.paths.rundir import RunDir

    return memory_root(json.loads((run / "lineage.json").read_text())["lineage"], RunDir(run))


def _saved(run: Path, at: int, tier: str) -> bool:
    if not (run / "lineage.json").exists():
        return False
    where = _memory_root(run) if tier == "memory" else run
    return any(
        int(p.parent.name.split("-")[1]) >= at
        for p in where.glob("checkpoint-*/COMPLETE.json")
        if p.is_file()
    )


def _forget_memory(run: Path) -> None:
    if (run / "lineage.json").exists():
        shutil.rmtree(_memory_root(run), ignore_errors=True)


def copy_floor(nbytes: int, device: str) -> float:
    """The device->host copy of `nbytes` into page-locked buffers allocated beforehand (on the CPU a memcpy into a
    buffer touched beforehand): the least a save can block the loop without overlapping it. Median of 3."""
    import torch

    pinned = device == "cuda"
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
    dst.zero_()
    times = []
    for _ in range(4):
        if pinned:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--every", type=int, default=1, help="updates between saves (memory_every, save_every)")
    p.add_argument(
        "--pace", type=float, default=0.0,
        help="seconds an update takes at least in the timed loops (params.min_update_s: no bit changes), so that "
        "a save's persist ends before the next save is due",
    )  # fmt: skip
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="bench-memory-", dir=args.dir))
    try:
        config = _config(out, args)
        every = args.every
        paced = {"params.min_update_s": args.pace} if args.pace else {}
        result: dict[str, Any] = {"device": args.device, "every": every, "pace_s": args.pace, "phase_s": {}}

        def phase(name: str, run: Any) -> Any:
            """Run one measurement; its wall time and the figures so far printed and written (a run cut short by
            a time limit keeps what it measured)."""
            t0 = time.perf_counter()
            got = run()
            result["phase_s"][name] = round(time.perf_counter() - t0, 1)
            print(f"[bench] {name}: {json.dumps(got)} ({result['phase_s'][name]} s)", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
            return got

        loops = result["loops"] = {}
        loops["plain"] = plain = phase("plain", lambda: _loop(out, config, "plain", paced, every))
        loops["memory"] = memory = phase(
            "memory", lambda: _loop(out, config, "memory", paced | {"memory_every": every}, every)
        )
        loops["durable"] = durable = phase(
            "durable", lambda: _loop(out, config, "durable", paced | {"save_every": every}, every)
        )
        state_bytes = sum(
            f.stat().st_size
            for f in (out / "durable" / f"checkpoint-{args.updates}").rglob("*")
            if f.is_file()
        )
        result |= {
            "state_bytes": state_bytes,
            "copy_floor_s": copy_floor(state_bytes, args.device),
            "gap_plain_s": plain["gap_s"],
            # the save call's stall (in the gap after the saved update), and all the loop lost to a save beyond
            # its updates (the stall, and the next save's wait for this one to commit), each against the plain loop
            "stall_per_memory_save_s": memory["stall_per_save_s"] - plain["gap_s"],
            "stall_per_durable_save_s": durable["stall_per_save_s"] - plain["gap_s"],
            "blocked_per_memory_save_s": memory["window_gaps_s"] - every * plain["gap_s"],
            "blocked_per_durable_save_s": durable["window_gaps_s"] - every * plain["gap_s"],
            # what a save costs the loop in all, its next update's wait for the copies included (per save)
            "lost_per_memory_save_s": (memory["interval_mean_s"] - plain["interval_mean_s"]) * every,
            "lost_per_durable_save_s": (durable["interval_mean_s"] - plain["interval_mean_s"]) * every,
        }
        at = max(2, args.updates // 2 // every * every)
        result["restart_to_first_update_memory_s"] = phase(
            "restart from memory",
            lambda: _killed_then_restarted(
                out, config, "restart-memory", {"memory_every": every}, at, "memory"
            ),
        )
        result["restart_to_first_update_disk_s"] = phase(
            "restart from disk",
            lambda: _killed_then_restarted(out, config, "restart-disk", {"save_every": at}, at, "durable"),
        )
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        for run in out.glob("*"):
            _forget_memory(run)
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
