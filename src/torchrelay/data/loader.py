"""A DataLoader whose order does not depend on its worker count, and that reports the ids it delivered.

The batch sampler yields, for this rank, the fixed slice of every (update, micro-step) from the resume
position on: resuming is a jump, not a replay, and any `num_workers` gives the same batches in the same
order because DataLoader returns batches in sampler order whatever worker produced them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from torchrelay.data.order import GlobalOrder


@dataclass(slots=True)
class RankBatches:
    """The batch sampler: manifest indices per micro-step for one rank, from `start_update` on."""

    order: GlobalOrder
    start_update: int
    total_updates: int
    rank: int
    world_size: int
    micro_batch: int
    grad_accum: int

    def __iter__(self) -> Iterator[list[int]]:
        for u in range(self.start_update, self.total_updates):
            for m in range(self.grad_accum):
                yield self.order.slot(u, m, self.rank, self.world_size, self.micro_batch)

    def __len__(self) -> int:
        return (self.total_updates - self.start_update) * self.grad_accum


class _Tagged(Dataset):
    """Returns (index, item) so the loop can log which samples a batch really held."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


class _TaggedCollate:
    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, samples: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [i for i, _ in samples], self.collate_fn([item for _, item in samples])


@dataclass(slots=True)
class RelayLoader:
    """What `Run.dataloader` returns; the run builds the real DataLoader at the resume position."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    pin_memory: bool = False
    prefetch_factor: int | None = None

    def build(self, batches: RankBatches, seed: int) -> DataLoader:
        # An explicit generator keeps DataLoader from drawing its base seed from the global torch RNG,
        # which would shift every later draw by a different amount in a resumed process.
        gen = torch.Generator()
        gen.manual_seed(seed * 1_000_003 + batches.start_update)
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return DataLoader(
            _Tagged(self.dataset),
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=_TaggedCollate(self.collate_fn),
            pin_memory=self.pin_memory,
            generator=gen,
            **kwargs,
        )
