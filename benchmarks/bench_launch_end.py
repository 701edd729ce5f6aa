"""A launch's end: rank 0's "stopped at update" line to torchrun's exit, with and without frozen heaps.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_launch_end.py --before-src /tmp/old/src --rounds 2

Each round launches the example (tests/helpers.py's 16-update config, 2 ranks, gloo) three times, one after the
other on one code repo and data: `unchanged` (the ranks import torchrelay from --before-src, torchrun is the console
script), `ranks` (this tree's torchrelay, whose Run.open freezes the heap at exit), `ranks+agent` (and torchrun with
the same exit handler, as tests/helpers.TORCHRUN runs it). CPU: user + sys of the launch's whole process tree.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import clean_env, make_code_repo, make_data, write_config  # noqa: E402

CONSOLE = [str(Path(sys.executable).with_name("torchrun"))]
FROZEN = [
    sys.executable,
    "-c",
    "import atexit, gc, sys; atexit.register(gc.freeze); from torch.distributed.run import main; sys.exit(main())",
]


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before-src", type=Path, required=True, help="src/ of the tree to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-launch-end-"))
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    config = write_config(base / "lm.yaml", manifest, root)
    variants = {
        "unchanged": (args.before_src.resolve(), CONSOLE),
        "ranks": (REPO / "src", CONSOLE),
        "ranks+agent": (REPO / "src", FROZEN),
    }
    seen: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    for i in range(args.rounds):
        for name, (src, head) in variants.items():
            cmd = [
                *head,
                "--standalone",
                "--nproc_per_node=2",
                "--monitor_interval=0.5",
                str(code / "train_lm.py"),
            ]
            cmd += ["--run-dir", str(base / f"run-{name}-{i}"), "--config", str(config)]
            load, started, cpu = os.getloadavg()[0], time.monotonic(), _cpu()
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=clean_env(PYTHONPATH=str(src)),
                cwd=code,
            )
            assert proc.stdout is not None
            stopped = None
            for line in proc.stdout:
                if "stopped at update" in line:
                    stopped = time.monotonic()
            proc.wait()
            ended = time.monotonic()
            if proc.returncode != 0 or stopped is None:
                print(f"{name}: the launch failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            seen[name].append((ended - started, ended - stopped, _cpu() - cpu))
            print(f"round {i} {name}: launch {ended - started:.1f} s, end {ended - stopped:.2f} s, "
                  f"CPU {seen[name][-1][2]:.1f} s, load {load:.1f}", flush=True)  # fmt: skip
    floor = sum(x[1] for x in seen["unchanged"]) / args.rounds
    for name, rows in seen.items():
        wall, end, cpu = (sum(r[k] for r in rows) / len(rows) for k in range(3))
        print(
            f"{name:12s} launch {wall:.1f} s  end {end:.2f} s ({end / floor:.2f} of unchanged)  CPU {cpu:.1f} s"
        )
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
