"""ZeRO-2 partition files as DeepSpeed 0.19 writes them, and the time to reshard them: shared by
tests/test_zero_reshard.py (toy size) and benchmarks/bench_zero_reshard.py."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from torchrelay.checkpoint.zero_reshard import BASE, SINGLE, assemble, optim_files, reshard_folder


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
