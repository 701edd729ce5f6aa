"""examples/train_tokens.py with each update paced to TOKENS_PACE_S seconds (a kill lands mid-run): the pause comes
after the loop's body, before the run's next boundary; nothing the update computes changes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import train_tokens  # type: ignore[import-not-found]  # the example, beside this file in the test's code repo

import torchrelay as tr

_steps = tr.Run.steps


def _paced(self: tr.Run, *args: Any, **kwargs: Any) -> Iterator[Any]:
    inner = _steps(self, *args, **kwargs)
    try:
        for step in inner:
            yield step
            time.sleep(float(os.environ.get("TOKENS_PACE_S", "0")))
    finally:
        inner.close()


if __name__ == "__main__":
    tr.Run.steps = _paced  # type: ignore[method-assign]
    sys.exit(train_tokens.main())
