"""The global data order: a pure function of (seed, manifest, epoch), and who gets which samples when.

A global batch is defined without the world size: update u consumes samples [u*G, (u+1)*G) of the
stream of epoch orders (G = global batch). Inside it, micro-step m and rank r take a fixed slice, so the
same global batch splits differently over another world size without changing its content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from torchrelay.errors import ConfigError

ORDER_VERSION = 1


@dataclass(slots=True)
class GlobalOrder:
    """Which manifest indices every update, micro-step and rank consumes."""

    num_samples: int
    seed: int
    global_batch: int
    kind: str = "shuffled"
    lengths: Sequence[int] | np.ndarray | None = None
    bucket_size: int = 64
    _cache: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch > self.num_samples:
            raise ConfigError(
                f"global batch {self.global_batch} is larger than the manifest ({self.num_samples} samples)",
                hint="lower micro_batch or grad_accum, or use more data",
            )
        if self.kind == "length_bucketed" and (self.lengths is None or len(self.lengths) != self.num_samples):
            raise ConfigError("the length_bucketed sampler needs a 'length' for every manifest sample")

    @property
    def updates_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def epoch_of(self, update: int) -> int:
        """The epoch that update `update` (0-based) draws from."""
        return update // self.updates_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The samples of one epoch, in consumption order (the tail that fills no batch is dropped)."""
        if epoch not in self._cache:
            self._cache.clear()  # one epoch at a time is all a loop needs; keeps memory O(manifest)
            self._cache[epoch] = self._build(epoch)
        return self._cache[epoch]

    def _build(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, ORDER_VERSION])
        perm = rng.permutation(self.num_samples)
        used = self.updates_per_epoch * self.global_batch
        if self.kind == "shuffled":
            return perm[:used]
        # length_bucketed: sort runs of `bucket_size` global batches by length, cut them into global
        # batches, then shuffle the batches so long and short ones alternate across the epoch.
        assert self.lengths is not None
        lengths = np.asarray(self.lengths)
        perm = perm[:used]
        chunk = self.global_batch * self.bucket_size
        pieces = []
        for start in range(0, used, chunk):
            part = perm[start : start + chunk]
            pieces.append(part[np.argsort(-lengths[part], kind="stable")])
        batches = np.concatenate(pieces).reshape(self.updates_per_epoch, self.global_batch)
        return batches[rng.permutation(self.updates_per_epoch)].reshape(-1)

    def global_batch_indices(self, update: int) -> np.ndarray:
        """Manifest indices of the global batch of update `update` (0-based)."""
        epoch, k = divmod(update, self.updates_per_epoch)
        return self.epoch_order(epoch)[k * self.global_batch : (k + 1) * self.global_batch]

    def slot(self, update: int, micro: int, rank: int, world_size: int, micro_batch: int) -> list[int]:
        """Indices rank `rank` takes in micro-step `micro` of update `update` (0-based)."""
        per_micro = world_size * micro_batch
        start = micro * per_micro + rank * micro_batch
        return self.global_batch_indices(update)[start : start + micro_batch].tolist()

    def position(self, updates_done: int) -> int:
        """Samples consumed globally after `updates_done` updates."""
        return updates_done * self.global_batch
