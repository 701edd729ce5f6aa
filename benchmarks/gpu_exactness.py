"""Bit-exact resume on GPUs: the example LM under torchrun with NCCL and deterministic CUDA kernels,
uninterrupted versus stopped twice (by request file, and with the loader's worker count changed).

    PYTHONPATH=src:tests python3 benchmarks/gpu_exactness.py --nproc 2 --out /tmp/gpu-exact [--parallel fsdp2]

Prints one JSON object: tensors compared, whether all are torch.equal, ledger verdict, update times.
GPU only (NCCL, CUDA kernels); the suite runs `--setup-only` on the CPU, and the same resume on gloo is
tests/test_exact_resume.py's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import EXAMPLES, launch, make_data, metrics, segments, write_config  # noqa: E402
from torchrelay.checkpoint.reader import load_tensors  # noqa: E402
from torchrelay.ledger.exposure import prove  # noqa: E402
from torchrelay.policy.stop import write_request  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-exact"))
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument(
        "--setup-only", action="store_true", help="write the code, data and config, then stop (no GPU needed)"
    )
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    code = args.out / "code"
    code.mkdir(parents=True)
    shutil.copyfile(EXAMPLES / "train_lm.py", code / "train_lm.py")
    root, manifest = make_data(args.out / "data", files=20)
    config = write_config(
        args.out / "lm.yaml",
        manifest,
        root,
        total_updates=args.updates,
        save_every=10,
        micro_batch=8,
        **{
            "params.device": "cuda",
            "params.parallel": args.parallel,
            "params.d_model": 256,
            "params.layers": 4,
            "params.heads": 8,
            "params.seq_len": 128,
        },
    )
    if args.setup_only:
        print(json.dumps({"code": str(code), "manifest": str(manifest), "config": str(config)}))
        return 0
    t0 = time.time()
    straight, stopped = args.out / "straight", args.out / "stopped"
    out = launch(code, straight, nproc=args.nproc, config=config, timeout=900)
    if out.returncode:
        print(out.stdout[-3000:], out.stderr[-5000:])
        return 1
    stopped.mkdir()
    write_request(stopped, at_update=13)
    launch(code, stopped, nproc=args.nproc, config=config, timeout=900)
    write_request(stopped, at_update=29)
    launch(code, stopped, nproc=args.nproc, sets={"num_workers": 2}, timeout=900)
    out = launch(code, stopped, nproc=args.nproc, timeout=900)
    if out.returncode:
        print(out.stdout[-3000:], out.stderr[-5000:])
        return 1
    a = load_tensors(straight / f"checkpoint-{args.updates}")
    b = load_tensors(stopped / f"checkpoint-{args.updates}")
    import torch

    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    times = [
        r.get("update_time")
        for r in (
            json.loads(x) for x in (straight / "train" / "metrics-rank0.jsonl").read_text().splitlines()
        )
    ]
    report = {
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nproc": args.nproc,
        "parallel": args.parallel,
        "updates": args.updates,
        "tensors": len(a),
        "bytes": sum(t.numel() * t.element_size() for t in a.values()),
        "all_torch_equal": equal,
        "metrics_equal": all(metrics(straight, r) == metrics(stopped, r) for r in range(args.nproc)),
        "segments": [(s["first_update"], s["last_update"], s["ended"]) for s in segments(stopped)],
        "ledger_ok": prove(stopped).ok,
        "update_time_median_s": statistics.median(t for t in times[2:] if t),
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(report, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
