"""torchrelay: distributed PyTorch training runs that stop anywhere and continue bit for bit, with proof."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["RelayConfig", "Run", "Step", "__version__", "warmup_cosine"]

if TYPE_CHECKING:
    from torchrelay.config import RelayConfig
    from torchrelay.run import Run, Step
    from torchrelay.schedule import warmup_cosine

_LAZY = {"RelayConfig": "config", "Run": "run", "Step": "run", "warmup_cosine": "schedule"}


def __getattr__(name: str) -> Any:
    # Lazy, so that light CLI verbs (status, stop, sbatch) start without importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"torchrelay.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'torchrelay' has no attribute {name!r}")
