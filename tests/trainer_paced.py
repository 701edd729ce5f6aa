"""The Trainer example with each update paced to TRAINER_PACE_S seconds, so that a signal lands before the end."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from train_hf_trainer import main
from transformers import TrainerCallback


class Pace(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(float(os.environ.get("TRAINER_PACE_S", "0")))


if __name__ == "__main__":
    sys.exit(main(callbacks=(Pace(),)))
