"""A DataLoader whose order does not depend on its worker count, and that reports the ids it delivered.

The batch sampler yields, for this rank, the fixed slice of every (update, micro-step) from the resume
position on: resuming is a jump, not a replay, and any `num_workers` gives the same batches in the same
order because DataLoader returns batches in sampler order whatever worker produced them. A dataset that sets
`wants_context = True` receives a SampleContext (index, epoch, update, seed) instead of the bare index, so its
augmentation can depend on the epoch inside the workers (see data/sample.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from torchrelay.data.order import GlobalOrder
from torchrelay.data.sample import SampleContext


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
    context: bool = False  # yield SampleContexts instead of bare indices

    def __iter__(self) -> Iterator[list[Any]]:
        for u in range(self.start_update, self.total_updates):
            epoch = self.order.epoch_of(u)
            for m in range(self.grad_accum):
                slot = self.order.slot(u, m, self.rank, self.world_size, self.micro_batch)
                if self.context:
                    yield [SampleContext(i, epoch, u + 1, self.order.seed) for i in slot]
                else:
                    yield slot

    def __len__(self) -> int:
        return (self.total_updates - self.start_update) * self.grad_accum


class _Tagged(Dataset):
    """Returns (index, item) so the loop can log which samples a batch really held."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, key: int | SampleContext) -> tuple[int, Any]:
        return (key.index if isinstance(key, SampleContext) else key), self.dataset[key]

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
    persistent_workers: bool = False

    @property
    def wants_context(self) -> bool:
        """The dataset asked for SampleContexts (`wants_context = True`) instead of bare indices."""
        return getattr(self.dataset, "wants_context", False) is True

    def build(self, batches: RankBatches, seed: int) -> DataLoader:
        # An explicit generator keeps DataLoader from drawing its base seed from the global torch RNG,
        # which would shift every later draw by a different amount in a resumed process.
        gen = torch.Generator()
        gen.manual_seed(seed * 1_000_003 + batches.start_update)
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
        if self.wants_context:
            batches = dataclasses.replace(batches, context=True)
        return DataLoader(
            _Tagged(self.dataset),
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=_TaggedCollate(self.collate_fn),
            pin_memory=self.pin_memory,
            generator=gen,
            **kwargs,
        )
