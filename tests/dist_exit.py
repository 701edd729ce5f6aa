"""Run under torchrun (2 ranks, gloo) by test_rank_failures.py: when a script that trained a run (a background
save included) destroys its process groups and ends, no process group is left for the interpreter's finalization.

Why: a gloo worker thread may still hold the last collective's work, whose tensors were made in Python; when it
lets go of them it takes the GIL, and during finalization a thread that takes the GIL is ended in a way C++
cannot unwind (`terminate called without an active exception`, SIGABRT: the exit code a stop promised is lost).
A group that dies while the interpreter is alive joins its workers first. So every group the script's
`destroy_process_group()` unregistered, the default one and the ones torchrelay made, must be gone by the time the
last exit handler runs, and torchrelay must not hold the default one past the destroy: `dist_exit.py BASE CONFIG`
prints `DEFAULT_HELD <rank> False|True` after the destroy and `GROUPS_LEFT <rank> <n> of <m>` (torchrelay's
groups still alive) from the first exit handler the script registered (the last to run).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

import torchrelay as tr
from dist_rank_failures import Files  # the same one-file-per-sample dataset
from torchrelay.util import collective

refs: list[weakref.ref[Any]] = []


def report() -> None:
    # No collection here: what is alive now meets the finalization.
    ours = sum(r() is not None for r in refs)
    print(f"GROUPS_LEFT {RANK} {ours} of {len(refs)}", flush=True)


def train(run_dir: Path, cfg: tr.RelayConfig) -> int:
    with tr.Run.open(run_dir, cfg) as run:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(Files(run.manifest.records))):
            for _, batch in step.micro_batches(model):
                model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
    return run.exit_code


RANK = -1
if __name__ == "__main__":
    atexit.register(report)  # before torchrelay registers anything: it runs last
    base, config = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
    code = train(base / "run", tr.RelayConfig.from_dict(yaml.safe_load(config.read_text())))
    world = dist.group.WORLD
    refs.extend(weakref.ref(g) for g in dist.distributed_c10d._world.pg_map if g is not world)
    dist.barrier()
    dist.destroy_process_group()
    # the default group is the script's: its destroy frees it unless another object holds it (DDP's may: torch's
    # own); torchrelay's table of protocols must not
    held = any(x is world for entry in collective._training for x in entry)
    print(f"DEFAULT_HELD {RANK} {held}", flush=True)
    del world
    sys.exit(code)
