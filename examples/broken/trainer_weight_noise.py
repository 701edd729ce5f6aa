"""BROKEN on purpose: a Trainer callback that draws from a random stream of its own, which no checkpoint holds.

examples/train_hf_trainer.py with one callback added: before every update it perturbs the weights with a little
noise (a hand-made weight-noise regularizer) drawn from its own torch.Generator. Neither Trainer nor torchrelay
knows of that generator, so a resumed launch builds it afresh from its seed: after a stop the noise repeats the
first launch's draws, and the resumed run parts from the uninterrupted one at the first update after the resume.
`torchrelay audit` names it: a random stream the script holds (torch.Generator) started over at the resume.
Fix: track the generator with the run, in a RelayTrainer subclass (torchrelay saves a generator's state per rank):

    class NoisyTrainer(RelayTrainer):
        def relay_track(self, **statefuls):
            super().relay_track(noise=noise.gen, **statefuls)

    torchrelay audit --updates 2 --stop-at 1 -- torchrun --nproc_per_node=2 examples/broken/trainer_weight_noise.py --output-dir runs/noisy
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the good example
from train_hf_trainer import main  # noqa: E402


class WeightNoise(TrainerCallback):
    """Adds N(0, 1e-3) to every weight before each update, from a generator seeded the same on every rank."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)  # BUG: in no checkpoint, restarts at every launch

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen), alpha=1e-3)


if __name__ == "__main__":
    noise = WeightNoise(seed=7)
    sys.exit(main(callbacks=(noise,)))
