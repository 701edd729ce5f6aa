"""torchrelay: distributed PyTorch training runs that stop anywhere and continue bit for bit, with proof."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrelay.util.lazy import lazy_names

__version__ = "0.1.0"
__all__ = [
    "RelayConfig",
    "Run",
    "SampleContext",
    "Step",
    "TokenWindows",
    "__version__",
    "agree",
    "install_excepthook",
    "sample_dropout",
    "sample_generator",
    "sample_seed",
    "token_manifest",
    "warmup_cosine",
]

if TYPE_CHECKING:
    from torchrelay.config.relay import RelayConfig
    from torchrelay.data.sample import SampleContext, sample_dropout, sample_generator, sample_seed
    from torchrelay.data.tokens import TokenWindows, token_manifest
    from torchrelay.errors import install_excepthook
    from torchrelay.run import Run, Step
    from torchrelay.run.lr_shape import warmup_cosine
    from torchrelay.util.collective import agree

# Importing torchrelay changes nothing in the process. The one-line report of an uncaught refusal (a configuration
# error, a contract mismatch: one message and its exit code instead of a traceback per rank and exit 1) is installed
# by RelayConfig and Run.open, the calls that can raise one, and by nothing else; a program of its own opts in with
# tr.install_excepthook().
_LAZY = {
    "RelayConfig": "config.relay",
    "Run": "run",
    "Step": "run",
    "agree": "util.collective",
    "warmup_cosine": "run.lr_shape",
    "install_excepthook": "errors",
    "SampleContext": "data.sample",
    "sample_dropout": "data.sample",
    "sample_generator": "data.sample",
    "sample_seed": "data.sample",
    "TokenWindows": "data.tokens",
    "token_manifest": "data.tokens",
}


# Lazy, so that light CLI verbs (status, stop, sbatch) start without importing torch.
__getattr__ = lazy_names("torchrelay", _LAZY)
