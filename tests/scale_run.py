"""A run directory at scale, written without training as the library writes it, and the fresh-process measure of
a command's wall time, CPU time and peak RSS.

Shared by tests/test_scale.py, tests/test_manifest_readers.py and benchmarks/bench_scale.py (whose docstring says
how the run is written): the benchmark measures at LingBot's size what the tests bound at a small one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "src"
MEASURED_SRC = os.environ.get("BENCH_SCALE_SRC", str(SRC))  # the library the measured processes import


def write_manifest(path: Path, samples: int, root: str = "/data/lingbot") -> None:
    """A manifest shaped like a robot-episode corpus: id, a path under the data root, a length, a task.

    Each line is the text `json.dumps` writes for that record (formatted directly: 10 M lines in seconds)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 4000, samples).tolist()
    tasks = ["pick up the red cube", "open the drawer", "fold the towel", "stack the cups"]
    with open(path, "w") as f:
        for start in range(0, samples, 100_000):
            f.write(
                "".join(
                    f'{{"id": "ep{i:09d}", "path": "{root}/shard-{i // 1000:05d}/episode-{i:09d}.mp4", '
                    f'"length": {lengths[i]}, "task": "{tasks[i % 4]}"}}\n'
                    for i in range(start, min(start + 100_000, samples))
                )
            )


def lay_out(base: Path, samples: int) -> tuple[Path, Path, Path]:
    """A synthetic run's manifest of `samples` lines, its one-file code folder and where its run directory goes."""
    base.mkdir(parents=True, exist_ok=True)
    manifest = base / "manifest.jsonl"
    write_manifest(manifest, samples)
    code = base / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("# the synthetic run's script\n")
    return manifest, code, base / "run"


def _config(manifest: Path, total: int, micro: int, accum: int) -> Any:
    import torchrelay as tr

    return tr.RelayConfig(
        seed=7,
        micro_batch=micro,
        grad_accum=accum,
        total_updates=total,
        manifest=str(manifest),
        data_root="/data/lingbot",
        save_every=1000,
    )


def make_run(
    base: Path,
    *,
    samples: int,
    updates: int,
    ranks: int,
    micro: int,
    checkpoints: list[int],
    segment_updates: int,
    total_updates: int | None = None,
) -> Path:
    """A run directory as `ranks` ranks would have left it after `updates` updates (see the module docstring)."""
    import torch

    import torchrelay as tr
    from torchrelay.checkpoint import state as ckpt_state
    from torchrelay.checkpoint.commit import commit_checkpoint
    from torchrelay.checkpoint.retention import policy_for
    from torchrelay.paths.rundir import RunDir
    from torchrelay.records.history import new_id, read_history, write_history
    from torchrelay.records.train import exposure_line, exposure_widths

    manifest, code, run_dir = lay_out(base, samples)
    # Opened at world size 1 with the whole global batch in gradient accumulation; the logs below are those of
    # `ranks` ranks splitting the same global batches (the order does not depend on the world size).
    accum = 1024 // (micro * ranks)
    cfg = _config(manifest, total_updates or updates, micro * ranks, accum)
    run = tr.Run.open(run_dir, cfg, code_dir=code)
    order, batch = run.order, run.global_batch
    first_segment = run.segment.to_dict()
    run.close()
    train = run_dir / "train"
    widths = exposure_widths(cfg.total_updates, accum, samples)

    def line(u: int, k: int, ids: list[int]) -> str:  # ExposureLog's lines (padded)
        return exposure_line(u, k, ids, widths)

    step_s = 0.5
    t0 = time.time() - updates * step_s
    for r in range(ranks):
        with (
            open(train / f"metrics-rank{r}.jsonl", "w") as m,
            open(train / f"exposures-rank{r}.jsonl", "w") as e,
        ):
            for u in range(1, updates + 1):
                rec = {
                    "update": u,
                    "loss": round(2.0 / (1 + u / 5000), 6),
                    "lr": 3e-4,
                    "update_time": step_s,
                    "samples_per_s": round(batch / step_s, 3),
                    "time": round(t0 + u * step_s, 3),
                }
                m.write(json.dumps(rec, separators=(",", ":")) + "\n")
                ids = order.global_batch_indices(u - 1).reshape(accum, ranks, micro)[:, r, :]
                e.write("".join(line(u, k, ids[k].tolist()) for k in range(accum)))
    model = torch.nn.Linear(4, 4)
    contract_sha = json.loads((run_dir / "resume_contract.json").read_text())["sha256"]
    for u in checkpoints:
        loop = {
            "update": u,
            "samples_consumed": order.position(u),
            "epoch": u / order.updates_per_epoch,
            "world_size": 1,
            "global_batch": batch,
            "segment": first_segment["segment"],
        }

        def write(tmp: Path, hook: Any, loop: dict[str, Any] = loop) -> None:
            ckpt_state.save_state(
                tmp, rank=0, model=model, optimizer=None, statefuls={}, loop=loop, kill_hook=hook
            )

        commit_checkpoint(
            run_dir,
            u,
            write,
            rank=0,
            world_size=1,
            info={
                "contract_sha256": contract_sha,
                "segment": first_segment["segment"],
                "created": time.time(),
            },
            retention=policy_for(cfg),
        )
    history = read_history(run_dir)
    segments = []
    parent = None
    for first in range(1, updates + 1, segment_updates):
        last = min(first + segment_updates - 1, updates)
        seg = dict(first_segment)
        seg.update(
            segment=new_id(),
            parent=parent,
            job=str(1000 + len(segments)),
            hosts=[f"node{h:03d}" for h in range(max(1, ranks // 8))],
            world_size=ranks,
            first_update=first,
            last_update=last,
            resumed_from=first - 1 if first > 1 else None,
            ended="budget" if last < updates else "crash",
            exit_code=3 if last < updates else None,
            started=t0 + first * step_s,
            stopped=t0 + last * step_s,
        )
        parent = seg["segment"]
        segments.append(seg)
    write_history(RunDir(run_dir), history[:0] + segments)
    return run_dir


# ------------------------------------------------------------------------------ measuring, in fresh processes
# Each measured program prints its own high-water mark last: a child's rusage ru_maxrss would count the pages of
# the (large) benchmark process it was forked from, which Linux carries over exec.
_HWM = """
def _hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
"""


def measure(
    args: list[str], env: dict[str, str] | None = None, *, keep_stdout: bool = False
) -> dict[str, Any]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of one fresh process; its output's last line."""
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            args,
            stdout=out_f,
            stderr=err_f,
            text=True,
            env={**os.environ, "PYTHONPATH": MEASURED_SRC, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (Popen.wait would reap it first)
        wall = time.perf_counter() - t0
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    last = (out.strip().splitlines() or [""])[-1]
    words = last.split()
    hwm = int(words[words.index("hwm_kib") + 1]) if "hwm_kib" in words else None
    return {
        **({"stdout": out} if keep_stdout else {}),
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mib": round(hwm / 1024, 1) if hwm else None,
        "rc": proc.returncode,
        "out": last[:200],
        "err": err.strip()[-400:] if proc.returncode else "",
    }


_CLI = (
    _HWM
    + """
import sys
from torchrelay.cli import main
from torchrelay.paths.rundir import RunDir
code = main(sys.argv[1:])
print("hwm_kib", _hwm())
sys.exit(code)
"""
)


def cli(*argv: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        _CLI,
        *argv,
    ]
