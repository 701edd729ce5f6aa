"""A process that imported torch leaves in under a second instead of several: its heap is frozen at exit."""

from __future__ import annotations

import atexit
import gc

# At its end the interpreter runs the garbage collector over every object still alive while it tears the modules
# down, and a process that imported torch and torch.distributed.checkpoint holds about 250,000 of them (torch,
# sympy, the model): a rank of the example spent 3.4-4.1 s between its last exit handler and its end on the shared
# 2-core VM (load 3-5), 0.6 s with the heap frozen first; `python -c "import torch.distributed.checkpoint"` 1.4-1.9 s
# against 0.3-0.4 s (2026-12-02, benchmarks/RESULTS.md "The suite's length"). Frozen objects are only left out of
# those collections: exit handlers (logging's flush, multiprocessing's joins, release_groups) still run, and an
# object freed by its last reference is still freed. What no longer happens is the collection of garbage cycles at
# the very end, whose finalizers Python never promised to run at exit; every file torchrelay writes is closed and
# fsynced before its record says so.
_registered = False


def freeze_at_exit() -> None:
    """Freeze the garbage collector's heap at interpreter exit (an exit handler, registered once)."""
    global _registered
    if _registered:
        return
    _registered = True
    # Before or after the other exit handlers, it changes nothing for them: it frees nothing and keeps nothing alive.
    atexit.register(gc.freeze)
