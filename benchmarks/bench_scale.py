"""Run.open, `status` and `ledger` on a LingBot-sized run, each in a fresh process: wall time, CPU time, peak RSS.

    python benchmarks/bench_scale.py [--samples 495287] [--updates 20000] [--big-samples 10000000] [--out DIR]

The run is written without training, as the library writes it: the run is created by `Run.open` (manifest copied,
its index kept, contract last), then each of `--ranks` ranks' metric and exposure logs are written line by line as
`Run` writes them (the exposures from the run's own `GlobalOrder`), checkpoints are committed through
`checkpoint.commit` with a tiny model, and history.jsonl gets one segment per `--segment-updates` updates. The
newest checkpoint is 0.3-1.3 x `--save-every` updates older than the logs (a job killed after its last save), so
opening the run trims them as a real resume does.

Measured (each in its own process, peak RSS of that process; `import torchrelay` included):
- open:        `Run.open` of the existing run (rank 0: contract, manifest digest + its index, checkpoint, trim, history)
- open_cold:   the same with the manifest's index removed (every line read: a run made before the index existed)
- import_only: `import torchrelay; torchrelay.Run` (torch and DCP), which every open above includes
- open_rank:   what every other rank does: the manifest from the index, given rank 0's digest, and the order
- status:      `torchrelay status RUN`
- ledger:      `torchrelay ledger RUN` (proves every exposure exactly once)
- prover_<N>, ledger_full, ledger_proven: after the open, each checkpoint proven in turn by the background prover's
               command (`python -m torchrelay.ledger.prover RUN N`), then `ledger --full` and `ledger` (from the proof)
- big_create, big_open, big_open_rank: the same for a manifest of `--big-samples` samples (10 M)
`--only create` measures only the big manifest: its pass alone (`Manifest.load`, numpy only; with `--one-process`
also without reader processes: one core), with the reader processes' count and the largest one's peak RSS, then
creating a run from it, reopening it and a rank; no training run is written.
Goals (issue 11): each <= 5 s and <= 1 GB at 495,287 samples / 20,000 updates; a 10 M-sample manifest opens in
<= 15 s with <= 1.5 GB per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE.parent / "tests"))  # the run writer and the measure are shared with the suite

import scale_run  # noqa: E402
from scale_run import _HWM, _config, cli, lay_out, make_run, measure, write_manifest  # noqa: E402

_OPEN = (
    _HWM
    + """
import sys, time
from pathlib import Path
t0 = time.perf_counter()
import torchrelay as tr
run = tr.Run.open(sys.argv[1], code_dir=sys.argv[2])
print("start_update", run.start_update, "samples", len(run.manifest))
run.close()
print("seconds", round(time.perf_counter() - t0, 2), "hwm_kib", _hwm())
"""
)
_IMPORT = (
    _HWM
    + """
import time
t0 = time.perf_counter()
import torchrelay as tr
tr.Run
print("seconds", round(time.perf_counter() - t0, 2), "hwm_kib", _hwm())
"""
)
_RANK = (
    _HWM
    + """
import sys, time
t0 = time.perf_counter()
from pathlib import Path
from torchrelay.data.order import GlobalOrder
from torchrelay.manifest import Manifest
from torchrelay.readers import RunDir, stored_config
rd = RunDir(sys.argv[1])
cfg = stored_config(rd)
m = Manifest.load(rd.manifest_path, cfg.data_root, index=rd.manifest_index_path, sha256=sys.argv[2])
assert m.indexed, "the index was not used"
order = GlobalOrder(num_samples=len(m), seed=cfg.seed, global_batch=1024, kind=cfg.sampler)
order.global_batch_indices(0)
print("samples", len(m), "seconds", round(time.perf_counter() - t0, 2), "hwm_kib", _hwm())
"""
)
# The manifest's reader processes (torchrelay.manifest.readers): the library starts one per core this process may
# use (its affinity, as under taskset or Slurm), so $BENCH_CORES narrows the affinity, not the library. In a scan
# they are the process's only children, waited for, so RUSAGE_CHILDREN's peak RSS is the largest reader's (a
# create has other children: its readers are the scan's, the same pass).
_READERS = """
import os, resource
if os.environ.get("BENCH_CORES"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: int(os.environ["BENCH_CORES"])])


def _readers():
    from torchrelay.manifest.readers import reader_count
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return f"readers {reader_count() if peak else 0} reader_peak_kib {peak}"
"""
_SCAN = (
    _HWM
    + _READERS
    + """
import sys, time
t0 = time.perf_counter()
import torchrelay.manifest as M
m = M.Manifest.load(sys.argv[1], sys.argv[2])
print("samples", len(m), m.fingerprint(), "seconds", round(time.perf_counter() - t0, 2),
      "hwm_kib", _hwm(), _readers())
"""
)
_CREATE = (
    _HWM
    + """
import sys, time
t0 = time.perf_counter()
import torchrelay as tr
cfg = tr.RelayConfig.from_dict(__import__("json").loads(sys.argv[3]))
run = tr.Run.open(sys.argv[1], cfg, code_dir=sys.argv[2])
print("samples", len(run.manifest))
run.close()
print("seconds", round(time.perf_counter() - t0, 2), "hwm_kib", _hwm())
"""
)


def measure_run(base: Path, run_dir: Path) -> dict[str, dict[str, Any]]:
    from torchrelay.manifest import Manifest
    from torchrelay.readers import RunDir, stored_config

    rd = RunDir(run_dir)
    code = str(base / "code")
    sha = Manifest.load(rd.manifest_path, stored_config(rd).data_root, index=rd.manifest_index_path).sha256()
    out: dict[str, dict[str, Any]] = {}
    # status and ledger first: opening trims the logs to the checkpoint
    out["status"] = measure(cli("status", str(run_dir)))
    out["ledger"] = measure(cli("ledger", str(run_dir)))
    out["open"] = measure([sys.executable, "-c", _OPEN, str(run_dir), code])
    out["import_only"] = measure([sys.executable, "-c", _IMPORT])  # what every open pays before it starts
    out["open_rank"] = measure([sys.executable, "-c", _RANK, str(run_dir), sha])
    index = rd.manifest_index_path
    kept = index.with_name(index.name + ".kept")
    os.replace(index, kept)
    try:
        out["open_cold"] = measure([sys.executable, "-c", _OPEN, str(run_dir), code])
    finally:
        os.replace(kept, index)
    return out


def measure_proven(run_dir: Path) -> dict[str, dict[str, Any]]:
    """`ledger` once the checkpoints are proven (the provers rank 0 starts after a commit, run here in turn, oldest
    first: each from the one before), against `ledger --full` on the same (trimmed) logs."""
    from torchrelay.paths.layout import parse_checkpoint_name
    from torchrelay.readers import RunDir

    out: dict[str, dict[str, Any]] = {}
    for ckpt in RunDir(run_dir).checkpoint_dirs():
        update = str(parse_checkpoint_name(ckpt.name))
        out[f"prover_{update}"] = measure(
            [sys.executable, "-m", "torchrelay.ledger.prover", str(run_dir), update]
        )
    out["ledger_full"] = measure(cli("ledger", "--full", str(run_dir)))
    out["ledger_proven"] = measure(cli("ledger", str(run_dir)))
    return out


def measure_big(base: Path, samples: int) -> dict[str, dict[str, Any]]:
    """A run created from a `samples`-sample manifest (every line read), reopened (index), another rank."""
    from torchrelay.manifest import Manifest
    from torchrelay.readers import RunDir

    manifest, code, run_dir = lay_out(base, samples)
    cfg = _config(manifest, 100, 32, 32).to_dict()
    out: dict[str, dict[str, Any]] = {}
    out["big_create"] = measure([sys.executable, "-c", _CREATE, str(run_dir), str(code), json.dumps(cfg)])
    rd = RunDir(run_dir)
    sha = Manifest.load(rd.manifest_path, "/data/lingbot", index=rd.manifest_index_path).sha256()
    out["big_open"] = measure([sys.executable, "-c", _OPEN, str(run_dir), str(code)])
    out["big_open_rank"] = measure([sys.executable, "-c", _RANK, str(run_dir), sha])
    out["big_manifest_mib"] = {"size": round(manifest.stat().st_size / 2**20, 1)}
    return out


def _readers_measure(args: list[str], cores: int | None = None) -> dict[str, Any]:
    """`measure`, with the count of the manifest's reader processes and the peak RSS of the largest."""
    out = measure(args, {"BENCH_CORES": str(cores)} if cores else None)
    words = out["out"].split()
    if "readers" in words:
        out["readers"] = int(words[words.index("readers") + 1])
        peak = int(words[words.index("reader_peak_kib") + 1])
        out["reader_peak_rss_mib"] = round(peak / 1024, 1) if peak else None
    return out


def measure_create(base: Path, samples: int, *, one_process: bool) -> dict[str, Any]:
    """`--only create`: the pass over every line of a `samples`-line manifest (Manifest.load in a fresh process,
    numpy only), then creating a run from it with `Run.open` (when torch is there), reopening it and a rank."""
    import importlib.util

    from torchrelay.manifest import Manifest

    base.mkdir(parents=True, exist_ok=True)
    manifest = base / "manifest.jsonl"
    t0 = time.perf_counter()
    write_manifest(manifest, samples)
    out: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)),
        "manifest_mib": round(manifest.stat().st_size / 2**20, 1),
        "write_s": round(time.perf_counter() - t0, 1),
    }
    scan = [sys.executable, "-c", _SCAN, str(manifest), "/data/lingbot"]
    out["scan"] = _readers_measure(scan)
    if one_process:
        out["scan_one_process"] = _readers_measure(scan, cores=1)
    if importlib.util.find_spec("torch") is None:
        out["create"] = "skipped: no torch here"
        return out
    code = base / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("# the synthetic run's script\n")
    run_dir = base / "run"
    cfg = _config(manifest, 100, 32, 32).to_dict()
    out["create"] = measure([sys.executable, "-c", _CREATE, str(run_dir), str(code), json.dumps(cfg)])
    data = run_dir / "data"
    sha = Manifest.load(data / "manifest.jsonl", "/data/lingbot", index=data / "manifest.index.npz").sha256()
    out["open"] = measure([sys.executable, "-c", _OPEN, str(run_dir), str(code)])
    out["open_rank"] = measure([sys.executable, "-c", _RANK, str(run_dir), sha])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=495_287)
    parser.add_argument("--updates", type=int, default=20_000)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=1000, help="updates between the 3 checkpoints")
    parser.add_argument("--big-samples", type=int, default=10_000_000, help="0: skip the big manifest")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to build the runs (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--only",
        choices=["create"],
        default=None,
        help="create: only the big manifest (--big-samples lines): its pass in a fresh process, creating a run "
        "from it, reopening it, a rank (no training run, no torch needed for the pass)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="with --only create: also the pass with no reader process (as before they existed)",
    )
    parser.add_argument(
        "--measured-src",
        default=None,
        help="the src/ folder the measured processes import (another checkout's, to compare; default: this one)",
    )
    args = parser.parse_args()
    if args.measured_src:
        scale_run.MEASURED_SRC = args.measured_src
    sys.path.insert(0, str(SRC))
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    if args.only == "create":
        try:
            created = {
                "samples": args.big_samples,
                **measure_create(base, args.big_samples, one_process=args.one_process),
            }
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        print(json.dumps(created, indent=1))
        return
    results: dict[str, Any] = {"samples": args.samples, "updates": args.updates, "ranks": args.ranks}
    try:
        t0 = time.perf_counter()
        every = args.save_every  # the newest checkpoint 0.3-1.3 x `every` older than the logs
        last_save = (
            args.updates - args.updates % every - (every if args.updates % every < every * 3 // 10 else 0)
        )
        run_dir = make_run(
            base / "lingbot",
            samples=args.samples,
            updates=args.updates,
            ranks=args.ranks,
            micro=args.micro,
            checkpoints=[last_save - 2 * every, last_save - every, last_save],
            segment_updates=max(1, args.updates // 10),
            total_updates=args.updates + 5000,
        )
        results["generate_s"] = round(time.perf_counter() - t0, 1)
        results["exposures"] = args.updates * 1024
        results["trimmed_from"] = last_save
        results.update(measure_run(base / "lingbot", run_dir))
        results.update(measure_proven(run_dir))  # after `open`, which trimmed the logs to the checkpoint
        if args.big_samples:
            results.update(measure_big(base / "big", args.big_samples))
        results["rusage_self_peak_rss_mib"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
        )
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
