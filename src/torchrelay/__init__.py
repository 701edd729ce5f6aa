"""torchrelay: distributed PyTorch training runs that stop anywhere and continue bit for bit, with proof."""

__version__ = "0.1.0"

from torchrelay.config import RelayConfig  # noqa: E402
from torchrelay.run import Run, Step  # noqa: E402
from torchrelay.schedule import warmup_cosine  # noqa: E402

__all__ = ["RelayConfig", "Run", "Step", "warmup_cosine", "__version__"]
