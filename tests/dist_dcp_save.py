"""Run under torchrun (2 ranks, gloo) by test_async_save.py: the save split into plan and write
(checkpoint/dcp_save.py) across ranks, and a failure of either rank in either half raised on both, none waiting.

`dist_dcp_save.py BASE`: each case's outcome on each rank goes to BASE/seen-rank<r>.json. A rank left waiting in a
collective would hit the gloo timeout (60 s) instead, and the launch fail.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from torchrelay.checkpoint import dcp_save


def doc_of(rank: int) -> dict[str, Any]:
    shared = {
        f"w{i}": torch.arange(64, dtype=torch.float32) * (i + 1) for i in range(6)
    }  # equal on both ranks
    return {"model": shared, "per_rank": {str(rank): {"model": {"own": torch.full((8,), float(rank))}}}}


def outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the point
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main() -> None:
    base = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    seen: dict[str, Any] = {}

    written: dict[str, tuple[str, int]] = {}
    seen["ok"] = outcome(lambda: dcp_save.plan(doc_of(rank)).write(base / "ok", written))
    seen["ok_files"] = sorted(Path(p).name for p in written)

    real_local, real_global = DefaultSavePlanner.create_local_plan, DefaultSavePlanner.create_global_plan

    def local_fails(self: Any) -> Any:
        raise RuntimeError("boom in the local plan")

    if rank == 1:
        DefaultSavePlanner.create_local_plan = local_fails  # type: ignore[method-assign]
    seen["local"] = outcome(lambda: dcp_save.plan(doc_of(rank)))
    DefaultSavePlanner.create_local_plan = real_local  # type: ignore[method-assign]

    def global_fails(self: Any, plans: Any) -> Any:
        raise RuntimeError("boom in the global plan")

    DefaultSavePlanner.create_global_plan = global_fails  # type: ignore[method-assign]
    seen["global"] = outcome(lambda: dcp_save.plan(doc_of(rank)))
    DefaultSavePlanner.create_global_plan = real_global  # type: ignore[method-assign]

    planned = dcp_save.plan(doc_of(rank))
    target = base / "write"
    if rank == 1:  # rank 1's directory cannot be made: its write fails, rank 0's succeeds
        (base / "not-a-dir").write_text("")
        target = base / "not-a-dir" / "write"
    seen["write"] = outcome(lambda: planned.write(target, {}))

    (base / f"seen-rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
