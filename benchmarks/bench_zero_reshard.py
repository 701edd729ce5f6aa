"""What moving a DeepSpeed ZeRO-2 checkpoint to another number of ranks costs, against the size of its state.

    OMP_NUM_THREADS=1 python benchmarks/bench_zero_reshard.py --elements 1e6,1e7,4e7 --old 4 --new 2

For each size: the fp32 masters and both Adam moments of one param group of that many elements, cut as DeepSpeed
0.19's ZeRO-2 cuts them (padded to a multiple of 2 x ranks, one slice per rank), written as `--old` partition
files; then each of the `--new` ranks reshards them as a rank does at load (checkpoint/zero_reshard.py: read every
old partition, gather, cut its own slice, write its file) one after the other, and the proof is made (the new
partitions gathered and compared bit for bit). Prints one JSON line per size: the state's bytes, the slowest
rank's reshard seconds (the ranks run it at once on a cluster), the proof's seconds and the throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(ROOT / "tests"))  # the partition writer and the measure are shared with the suite

from zero_partitions import measure  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--elements", default="1e6,1e7", help="comma-separated sizes of the state, in elements"
    )
    parser.add_argument("--old", type=int, default=4)
    parser.add_argument("--new", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for text in args.elements.split(","):
        print(json.dumps(measure(int(float(text)), args.old, args.new)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
