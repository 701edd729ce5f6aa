"""Restore: what a segment brings back from its checkpoint, and the objects it brings it into."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchrelay.checkpoint import state as ckpt_state


@dataclass(slots=True)
class Tracked:
    """What `run.track` registered: what each save writes and a resume restores."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    statefuls: dict[str, ckpt_state.Stateful] = field(default_factory=dict)
