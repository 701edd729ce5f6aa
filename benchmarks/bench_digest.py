"""The per-update digest of the parameters (torchrelay/records/digests.py) against the update it follows.

    OMP_NUM_THREADS=1 PYTHONPATH=src:tests python benchmarks/bench_digest.py --width 1024 --depth 8 --batch 64
    PYTHONPATH=src:tests python benchmarks/bench_digest.py --device cuda --width 4096 --depth 16 --batch 4096

An MLP of `--depth` square layers trained with AdamW; the median time of an update (forward, backward, step) and
of the digest right after it (two integer reductions per tensor on its device, one host read). Prints one JSON
line; the figures are in RESULTS.md. tests/test_digests.py runs the same measurement at toy size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from digest_cost import measure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    result = measure(
        width=args.width, depth=args.depth, batch=args.batch, updates=args.updates, device=args.device
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
