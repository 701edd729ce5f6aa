"""What `torchrelay certify` costs against the updates it replays: the example trained on 2 ranks, then K updates
replayed from a checkpoint (a copy of the run, one launch, the digests compared).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src:$PWD/tests python benchmarks/bench_certify.py --updates 16 --replay 1,4

Prints one JSON line per K: the replay's seconds, the training's median update time, and the replay per update
beyond a launch's fixed cost (the difference between the largest and the smallest K, over their difference).
tests/test_certify.py certifies at toy size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from helpers import TORCHRUN, launch, make_code_repo, make_data, write_config  # noqa: E402
from torchrelay.audit.certify import certify  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--updates", type=int, default=16, help="updates the training runs (a save at half)")
    parser.add_argument("--replay", default="1,4", help="the K to replay, comma-separated")
    args = parser.parse_args(argv)
    half = args.updates // 2
    with tempfile.TemporaryDirectory(prefix="bench-certify-") as tmp:
        base = Path(tmp)
        code = make_code_repo(base / "code")
        root, manifest = make_data(base / "data")
        config = write_config(base / "lm.yaml", manifest, root, total_updates=args.updates, save_every=half)
        run = base / "run"
        out = launch(code, run, config=config)
        if out.returncode != 0:
            print(out.stdout[-2000:] + out.stderr[-2000:], file=sys.stderr)
            return 1
        lines = (run / "train" / "metrics-rank0.jsonl").read_text().splitlines()
        update_s = statistics.median(json.loads(x)["update_time"] for x in lines if x.strip())
        cmd = [
            TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            str(code / "train_lm.py"),
            "--config",
            str(config),
        ]
        seconds = {}
        for k in (int(x) for x in args.replay.split(",")):
            cert = certify(run, cmd, checkpoint=half, updates=k)
            seconds[k] = cert.seconds
            row = {"replayed": k, "certified": cert.certified, "seconds": round(cert.seconds, 2)}
            print(json.dumps(row | {"update_s": round(update_s, 4)}), flush=True)
        low, high = min(seconds), max(seconds)
        if high > low:
            per = (seconds[high] - seconds[low]) / (high - low)
            fixed = seconds[low] - low * per
            print(
                json.dumps({"per_update_s": round(per, 3), "launch_s": round(fixed, 2), "update_s": update_s})
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
