"""examples/train_lightning.py with each update paced to LIGHTNING_PACE_S seconds, so that a signal lands before
the end of the schedule."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytorch_lightning as pl
import train_lightning  # type: ignore[import-not-found]  # the example, beside this file in the test's code repo


class Pace(pl.Callback):
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(float(os.environ.get("LIGHTNING_PACE_S", "0")))


if __name__ == "__main__":
    sys.exit(train_lightning.main(callbacks=(Pace(),)))
