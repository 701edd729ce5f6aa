"""Learning-rate shapes as plain functions of the update, for torch's LambdaLR."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(total: int, warmup: int, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warmup over `warmup` updates, then cosine from 1 to `floor` at `total` (a LambdaLR factor)."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
