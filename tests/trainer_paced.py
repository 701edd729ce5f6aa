"""A Trainer example (TRAINER_EXAMPLE, by default train_hf_trainer) with each update paced to TRAINER_PACE_S seconds,
so that a signal lands before the end; `--kill-at PHASE:UPDATE:RANK` (taken off the example's own arguments)
arms a crash test's kill inside a save (torchrelay.util.kill_points)."""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

from transformers import TrainerCallback

from torchrelay.util import kill_points


class Pace(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(float(os.environ.get("TRAINER_PACE_S", "0")))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the optimizer that steps, inside accelerate's and DeepSpeed's wrappers (tests/test_four_ranks.py reads it)
        inner, chain = kwargs.get("optimizer"), []
        while inner is not None and len(chain) < 4:
            chain.append(type(inner).__name__)
            inner = getattr(inner, "optimizer", None)
        print(f"[rank {os.environ.get('RANK', '0')}] OPTIMIZER {' > '.join(chain)}", flush=True)


if __name__ == "__main__":
    if "--kill-at" in sys.argv:
        at = sys.argv.index("--kill-at")
        kill_points.arm(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    example = importlib.import_module(os.environ.get("TRAINER_EXAMPLE", "train_hf_trainer"))
    sys.exit(example.main(callbacks=(Pace(),)))
