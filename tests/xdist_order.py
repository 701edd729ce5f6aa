"""The two workers' file order (scripts/test.sh: `-n 2 --dist loadfile`): the modules that take minutes first.

pytest-xdist hands out files in order of their number of tests, most first, so a module of one or two long
launches (a ZeRO-2 move: 2-4 minutes under two workers) came last and ran alone while the other worker sat idle,
the suite's tail. Longest first is the classic cure: sent first, a long module runs beside the many short ones.
HEAVY is the order by the last full run's durations (`--durations`, CI at two workers); a module not named keeps
xdist's order after them, and a name that no longer exists is passed over.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

HEAVY = (
    "tests/test_zero_reshard_offload.py",
    "tests/test_trainer_zero_offload.py",
    "tests/test_slurm.py",
    "tests/test_memory_stacks.py",
    "tests/test_zero_reshard.py",
    "tests/test_trainer_zero_move.py",
    "tests/test_elastic_muon.py",
    "tests/test_deepspeed.py",
    "tests/test_trainer.py",
    "tests/test_durable_tier.py",
    "tests/test_multinode.py",
    "tests/test_zoo.py",
    "tests/test_lightning.py",
    "tests/test_demo.py",
    "tests/test_four_ranks.py",
)


def heavy_first_order(queue: OrderedDict[str, Any]) -> None:
    """Move HEAVY's files to the front of xdist's work queue (file -> its tests), in HEAVY's order."""
    for scope in reversed([s for s in HEAVY if s in queue]):
        queue.move_to_end(scope, last=False)


def heavy_first(config: Any, log: Any) -> Any:
    """A LoadFileScheduling that sends HEAVY's files first."""
    from xdist.scheduler import LoadFileScheduling

    class HeavyFirst(LoadFileScheduling):  # type: ignore[misc]
        ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first call: the queue is whole, nothing handed out yet
                self.ordered = True
                heavy_first_order(self.workqueue)
            super()._assign_work_unit(node)

    return HeavyFirst(config, log)
