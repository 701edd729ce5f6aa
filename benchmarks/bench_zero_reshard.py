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
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from torchrelay.checkpoint.zero_reshard import (  # noqa: E402
    BASE,
    SINGLE,
    assemble,
    optim_files,
    reshard_folder,
)


def write_partitions(folder: Path, elements: int, world: int) -> None:
    """`world` ZeRO-2 partition files of one group of `elements` fp32 masters with both moments."""
    size = math.ceil(elements / (2 * world)) * 2
    gen = torch.Generator().manual_seed(0)
    flats = [torch.randn(size * world, generator=gen) for _ in range(3)]
    for flat in flats:
        flat[elements:] = 0
    for rank in range(world):
        cut = slice(rank * size, (rank + 1) * size)
        doc = {
            SINGLE: [flats[0][cut].clone()],
            BASE: {
                "state": {
                    0: {
                        "step": torch.tensor(10.0),
                        "exp_avg": flats[1][cut].clone(),
                        "exp_avg_sq": flats[2][cut].clone(),
                    }
                },
                "param_groups": [{"params": [0]}],
            },
            "group_paddings": [max(0, (rank + 1) * size - max(rank * size, elements))],
            "param_alignment_paddings": [[0]],
            "partition_count": [world],
        }
        torch.save({"optimizer_state_dict": doc}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    torch.save({"dp_world_size": world}, folder / "mp_rank_00_model_states.pt")


def measure(elements: int, old: int, new: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-zero-reshard-") as tmp:
        source, target = Path(tmp) / "old", Path(tmp) / "new"
        source.mkdir()
        write_partitions(source, elements, old)
        size = math.ceil(elements / (2 * new)) * 2
        per_rank = []
        whole = None
        for rank in range(new):
            started = time.perf_counter()
            whole = reshard_folder(
                source, target, rank, new, [size], lambda p: torch.load(p, weights_only=True)
            )
            per_rank.append(time.perf_counter() - started)
        started = time.perf_counter()
        docs = [torch.load(p, weights_only=True)["optimizer_state_dict"] for p in optim_files(target)]
        live = [(d[SINGLE], [d[BASE]["state"][0]], d["group_paddings"]) for d in docs]
        assert whole is not None and assemble(live).equal(whole) == []
        proof = time.perf_counter() - started
    state_bytes = 3 * 4 * elements
    return {
        "elements": elements,
        "state_MiB": round(state_bytes / 2**20, 1),
        "old": old,
        "new": new,
        "reshard_s_slowest_rank": round(max(per_rank), 3),
        "proof_s": round(proof, 3),
        "MiB_per_s": round(state_bytes / 2**20 / max(per_rank), 1),
    }


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
