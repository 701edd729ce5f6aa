"""A save's copies behind the next update (`SaveTuning.overlap_copy`, GPU only): which tensors only an optimizer's
step changes, and the wait every step makes, on the device, for their copies to land.

The save issues those copies on a stream of their own (checkpoint/host_stage.py `HostStage.begin`) and returns; the
next forward and backward run while they land; a pre-hook on every optimizer's step in the process makes the step's
stream wait for them; the persist waits for them (`Landed.wait`) before it reads a byte.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchrelay.checkpoint.host_stage import Landed
from torchrelay.checkpoint.torch_compat import dtensor_local
from torchrelay.config.tuning import SaveTuning


def step_protected(optimizers: Any, tuning: SaveTuning) -> frozenset[int]:
    """The data pointers of the CUDA tensors only an optimizer's step changes (the optimizers' parameters and
    state), when a save may copy them behind the next forward and backward: `overlap_copy` on, and every tracked
    optimizer a torch.optim.Optimizer, whose step runs the pre-hooks `StepWait` adds. Empty otherwise: every copy
    lands before the save returns."""
    listed: list[Any] = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    if (
        not tuning.overlap_copy
        or optimizers is None
        or not torch.cuda.is_available()
        or not torch.cuda.is_initialized()
        or not all(isinstance(o, torch.optim.Optimizer) for o in listed)
    ):
        return frozenset()

    def pointer(t: Any) -> int:
        local = dtensor_local(t) if hasattr(t, "to_local") else t
        return local.data_ptr() if isinstance(local, torch.Tensor) and local.is_cuda else 0

    found = {pointer(p) for o in listed for group in o.param_groups for p in group["params"]}
    found |= {pointer(v) for o in listed for st in o.state.values() for v in st.values()}
    return frozenset(p for p in found if p)


class StepWait:
    """The next optimizer step of this process (any optimizer's: one the run does not track may change the same
    parameters, on whatever stream it runs) waits on the device for the copies a save left landing; the loop's
    thread never blocks on them. Waiting on a landed event costs microseconds: every step waits until the next save
    re-arms it or the close drops it."""

    def __init__(self) -> None:
        self._hook: Any = None

    def arm(self, landed: Landed) -> None:
        self.drop()

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            landed.before_step()

        self._hook = register_optimizer_step_pre_hook(before_step)

    def drop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
