"""Token streams: windows of token files (a memmap of uint16 or uint32 tokens, as nanoGPT's prepare.py writes), a
sample being a window whose offset is a pure function of the run's seed and its place in the data stream.

The manifest (`token_manifest`) has one line per *window slot* of each file: `{"id", "path", "tokens", "window"}`.
The run's order deals the slots out as it deals any manifest's samples (each slot once per epoch, a pure function
of seed and epoch, whatever the world size), and the ledger proves the slots. The window a slot reads is then:

* without replacement: window k of the file, tokens [k*B, k*B + B + 1) (B = block_size): every token of the file
  but the tail is read once per epoch, in the epoch's shuffled order;
* with replacement (nanoGPT's get_batch): a uniform offset in [0, tokens - B - 1], drawn by Philox, a counter-based
  generator, keyed by the run's seed and counting the slot's (epoch, index) — its place in the stream, which no
  rank, worker count or resume changes. Offsets repeat and overlap, as nanoGPT's do; a slot only numbers a draw.

So the windows a run reads are as proven as its exposures: `window_offsets(run_dir, ...)` derives each update's
windows from the proven order, and any loader worker count, world size or resume reads the same ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrelay.data.sample import SampleContext
from torchrelay.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Part of every Philox key: a new scheme gets a new tag, so a run never silently draws other windows.
_KEY_TAG = 0x746F6B656E2D7631  # "token-v1"
_MASK64 = (1 << 64) - 1


def window_offset(seed: int, epoch: int, index: int, span: int) -> int:
    """A uniform offset in [0, span) that is a pure function of (seed, epoch, index): Philox's first 64-bit output
    for that counter, scaled by multiply-shift (bias under span / 2**64; numpy's raw Philox stream is stable,
    where Generator.integers may change between numpy versions)."""
    if span <= 0:
        raise ValueError(f"window_offset: span must be > 0, got {span}")
    bits = np.random.Philox(key=np.array([seed & _MASK64, _KEY_TAG], dtype=np.uint64),
                            counter=np.array([index, epoch, 0, 0], dtype=np.uint64))  # fmt: skip
    raw = int(bits.random_raw())
    return (raw * span) >> 64


def token_manifest(
    files: list[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    block_size: int,
    dtype: str = "uint16",
    slots: int | None = None,
) -> Path:
    """Write the manifest of window slots for these token files to `out` (JSONL) and return its path.

    Each file gets (tokens - 1) // block_size slots (the non-overlapping windows that fit), or `slots` each;
    `tokens` (the file's length in tokens) is in every line, so the contract binds each file's length.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"token_manifest: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if block_size < 1:
        raise ConfigError(f"token_manifest: block_size must be >= 1, got {block_size}")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    out = Path(out)
    with open(out, "w") as f:
        for name in files:
            # absolute, links kept: a path under data_root (as the user names it, often through a link to the
            # storage) is what prepare re-points; resolving the link would put it outside
            path = Path(os.path.abspath(name))
            size = path.stat().st_size
            if size % itemsize:
                raise ConfigError(f"{path}: {size} bytes is no whole number of {dtype} tokens")
            tokens = size // itemsize
            fit = (tokens - 1) // block_size
            if fit < 1:
                raise ConfigError(f"{path}: {tokens} tokens hold no window of block_size {block_size} + 1")
            for k in range(slots if slots is not None else fit):
                f.write(
                    json.dumps({"id": f"{path.name}:{k}", "path": str(path), "tokens": tokens, "window": k})
                )
                f.write("\n")
    return out


class TokenWindows:
    """dataset[ctx] for a token-window manifest: `(x, y, offset)`, x the window's block_size tokens, y the same
    shifted by one (int64 tensors), offset where the window starts in its file.

    records: `run.manifest.records`; replacement: True draws offsets as nanoGPT's get_batch does (stated per
    run: put it in `params`, so that the contract binds it). Each process maps each file once (np.memmap), lazily:
    the dataset pickles as paths, for loader workers.
    """

    wants_context = True

    def __init__(self, records: Any, *, block_size: int, replacement: bool, dtype: str = "uint16") -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"TokenWindows: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.records = records
        self.block_size = int(block_size)
        self.replacement = bool(replacement)
        self.dtype = dtype
        self._maps: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # a worker maps the files itself

    def offset(self, ctx: SampleContext, record: dict[str, Any] | None = None) -> int:
        """Where the window of this draw starts (see the module's docstring)."""
        rec = record if record is not None else self.records[ctx.index]
        if self.replacement:
            return window_offset(ctx.seed, ctx.epoch, ctx.index, int(rec["tokens"]) - self.block_size)
        start = int(rec["window"]) * self.block_size
        if start + self.block_size + 1 > int(rec["tokens"]):
            # a short or empty window would reach the model unnoticed (or fail in collate, far from its cause):
            # token_manifest(slots=...) beyond the windows that fit, or another block_size than the manifest's
            raise ConfigError(
                f"manifest line {ctx.index} ({rec['id']}): window {rec['window']} of block_size {self.block_size} "
                f"ends past the file's {rec['tokens']} tokens",
                hint="without replacement a file holds (tokens - 1) // block_size windows: write the manifest "
                "without slots= and with the same block_size, or train with replacement=True",
            )
        return start

    def __getitem__(self, ctx: SampleContext) -> tuple[torch.Tensor, torch.Tensor, int]:
        rec = self.records[ctx.index]
        data = self._map(str(rec["path"]), int(rec["tokens"]))
        start = self.offset(ctx, rec)
        chunk = torch.from_numpy(data[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:], start

    def _map(self, path: str, tokens: int) -> np.ndarray:
        data = self._maps.get(path)
        if data is None:
            data = np.memmap(path, dtype=DTYPES[self.dtype], mode="r")
            if len(data) != tokens:
                size = len(data) * data.itemsize
                for name, other in DTYPES.items():
                    if name != self.dtype and size == tokens * np.dtype(other).itemsize:
                        raise ConfigError(
                            f"{path}: {tokens} {name} tokens as the manifest says, read as {self.dtype}",
                            hint=f"give TokenWindows dtype={name!r}, the dtype token_manifest wrote it with",
                        )
                # an OSError: the loop reports it as a sample it could not read, naming the file (run/loop.py)
                raise OSError(
                    f"{path}: {len(data)} {self.dtype} tokens, the manifest says {tokens}: another file than the "
                    "run's (restore it, or point data_root at the right copy)"
                )
            self._maps[path] = data
        return data


def window_offsets(
    order: Any, records: Any, update: int, *, block_size: int, replacement: bool
) -> Iterator[tuple[int, int]]:
    """(manifest index, offset) of each window of update `update`'s global batch (1-based, as Step.update), in
    the order's global-batch order: what the ranks read, derived from the order the ledger proves."""
    view = TokenWindows(records, block_size=block_size, replacement=replacement)
    epoch = order.epoch_of(update - 1)
    for index in order.global_batch_indices(update - 1).tolist():
        ctx = SampleContext(int(index), epoch, update, order.seed)
        yield int(index), view.offset(ctx)
