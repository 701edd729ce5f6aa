"""The command a stage of a launch runs: torchrun on this node, or (several nodes) srun starting on each node an
agent (controller/supervisor.py) that guards its memory and runs torchrun there."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torchrelay.controller.memguard import MemoryLimits
from torchrelay.controller.plan import Plan
from torchrelay.errors import RelayError


def training_argv(
    plan: Plan,
    run_dir: Path,
    limits: MemoryLimits,
    env: Mapping[str, str],
    runner: Callable[[Sequence[str]], str] | None = None,
) -> list[str]:
    """torchrun on this node, or (several nodes) srun starting a per-node agent that runs torchrun."""
    t = plan.train
    user_rdzv = any(a.startswith(("--rdzv", "--master", "--standalone")) for a in t.torchrun_args)
    if not t.uses_srun:
        rdzv = [] if user_rdzv else ["--standalone"]
        return [t.python, "-m", "torch.distributed.run", *rdzv, "--nnodes=1",
                f"--nproc_per_node={t.nproc_per_node}", *t.torchrun_args, t.script, *t.args]  # fmt: skip
    from torchrelay.controller import slurm

    master, port, nodes = slurm.rendezvous(env, runner or slurm.run_command)
    if nodes != t.nnodes:
        raise RelayError(
            f"plan train.nnodes is {t.nnodes} but the allocation has {nodes} node(s)",
            hint="submit with --nodes equal to train.nnodes (torchrelay sbatch does)",
        )
    rdzv = [] if user_rdzv else [f"--master_addr={master}", f"--master_port={port}"]
    torchrun = [t.python, "-m", "torch.distributed.run", f"--nnodes={t.nnodes}", "--node_rank={SLURM_NODEID}",
                f"--nproc_per_node={t.nproc_per_node}", *rdzv, *t.torchrun_args, t.script, *t.args]  # fmt: skip
    agent = [t.python, "-m", "torchrelay.controller.supervisor", "--run-dir", str(run_dir),
             f"--soft-gib={limits.soft_bytes / 2**30:.3f}", f"--hard-gib={limits.hard_bytes / 2**30:.3f}"]  # fmt: skip
    srun = [
        "srun",
        f"--nodes={t.nnodes}",
        f"--ntasks={t.nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    return [*srun, *agent, "--", *torchrun]
