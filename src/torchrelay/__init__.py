"""torchrelay: distributed PyTorch training runs that stop anywhere and continue bit for bit, with proof."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrelay.errors import install_excepthook

__version__ = "0.1.0"
__all__ = [
    "RelayConfig",
    "Run",
    "SampleContext",
    "Step",
    "__version__",
    "agree",
    "sample_dropout",
    "sample_generator",
    "sample_seed",
    "warmup_cosine",
]

if TYPE_CHECKING:
    from torchrelay.config import RelayConfig
    from torchrelay.data.sample import SampleContext, sample_dropout, sample_generator, sample_seed
    from torchrelay.lr_shape import warmup_cosine
    from torchrelay.run import Run, Step
    from torchrelay.util.collective import agree

# An uncaught refusal of the library (a configuration error, a contract mismatch) ends a rank with one message and
# its exit code rather than a traceback per rank and exit 1; any other exception keeps its traceback.
install_excepthook()

_LAZY = {
    "RelayConfig": "config",
    "Run": "run",
    "Step": "run",
    "agree": "util.collective",
    "warmup_cosine": "lr_shape",
    "SampleContext": "data.sample",
    "sample_dropout": "data.sample",
    "sample_generator": "data.sample",
    "sample_seed": "data.sample",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that light CLI verbs (status, stop, sbatch) start without importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"torchrelay.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'torchrelay' has no attribute {name!r}")
