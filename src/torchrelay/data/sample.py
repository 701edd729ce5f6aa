"""Per-sample randomness that a resume cannot change: seeded from (run seed, manifest index, epoch) only.

A DataLoader worker's own RNG depends on how many workers there are and on when the loader started, so
augmentation drawn from it differs between an uninterrupted and a resumed run. A generator seeded from the
sample's identity and epoch is the same in any process, any worker count and any world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Part of every derived seed: a new scheme gets a new tag, so a run never silently draws other numbers.
_SEED_TAG = "torchrelay-sample-v1"


def sample_seed(seed: int, index: int, epoch: int) -> int:
    """A 63-bit seed that is a pure function of (run seed, manifest index, epoch)."""
    for name, value in (("seed", seed), ("index", index), ("epoch", epoch)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"sample_seed: {name} must be an int, got {value!r}")
    digest = hashlib.sha256(f"{_SEED_TAG}:{seed}:{index}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_generator(
    seed: int, index: int, epoch: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh torch.Generator for one sample in one epoch (same numbers in every process that asks)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(sample_seed(seed, index, epoch))
    return gen


@dataclass(frozen=True, slots=True)
class SampleContext:
    """What `dataset[ctx]` receives when the dataset sets `wants_context = True`.

    index: the manifest line; epoch: the pass over the data this draw belongs to (0-based); update: the update
    that consumes it (1-based, as `Step.update`); seed: the run's seed. None of them depends on the worker count,
    the world size or where the run was resumed.
    """

    index: int
    epoch: int
    update: int
    seed: int

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """`sample_generator(seed, index, epoch)`: this sample's randomness for this epoch."""
        return sample_generator(self.seed, self.index, self.epoch, device)

    def __index__(self) -> int:
        # A dataset that indexes a list or tensor with the context gets the manifest line.
        return self.index


def sample_dropout(
    x: torch.Tensor, p: float, seeds: torch.Tensor | list[int], salt: int = 0, training: bool = True
) -> torch.Tensor:
    """Dropout whose mask for row j is drawn from (seeds[j], salt) only, not from the rank's RNG.

    A rank's torch RNG is per rank, so `nn.Dropout` draws other masks once a run moves to another number of ranks
    (or another micro-batch split). Give each sample its seed (`tr.sample_seed(seed, index, epoch)` in a dataset
    with `wants_context`, collated with the batch) and each dropout site its own `salt`: a sample then gets the
    same mask on any layout, in any batch, at any position. One generator per row: meant for the layers where
    it matters, not for a whole large model.
    """
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"sample_dropout: p must be in [0, 1), got {p}")
    rows = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    if len(rows) != x.shape[0]:
        raise ValueError(f"sample_dropout: {len(rows)} seeds for a batch of {x.shape[0]} rows")
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    for j, seed in enumerate(rows):
        gen = torch.Generator(device=x.device)
        gen.manual_seed(sample_seed(seed & ((1 << 62) - 1), salt, 0))
        keep[j] = torch.rand(x.shape[1:], generator=gen, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
