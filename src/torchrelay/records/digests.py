"""A bitwise digest of the parameters after every update, per rank: two runs (or two segments) compared update by
update without running them again, and the first update where they part named.

Each tensor is read as integers of its element size (a float32 as int32: its bits, not its value), laid out in
rows of WIDTH, and reduced on its own device to the sums of its rows and of its columns, each then weighted by
its place. Any one changed element changes both; rounding that moves one element up by an ulp and another down
leaves a plain sum alike, not these (the two differ in their row or their column, whose weights differ). The
sums wrap in the integers' width, which is a pass as cheap as a float sum (an int32 sum accumulated in int64 is
fifty times slower on a CPU: measured). The terms of every tensor are stacked on the device and read in one
transfer, so an update costs one host synchronization, not one per tensor; the host hashes them (SHA-256) into a
short hex digest.

`train/digests-rank<r>.jsonl`: `{"u": update, "params": hex, "n": tensors}` per update, trimmed at a resume
as the metric and exposure logs are (lines past the checkpoint go to train/recovery-history/), and like them on
disk up to a checkpoint before it is committed (a kill lost the buffered ones); a reader still takes the last line
of each update.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import RankLog
from torchrelay.util.jsonl import iter_records

# An element size to the integer type that reads its bits.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The width of the rows a tensor's integers are laid out in: row sums and column sums, each weighted by its place.
WIDTH = 1024


def digests_path(train_dir: Path, rank: int) -> Path:
    return train_dir / f"digests-rank{rank}.jsonl"


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard is what it holds
    return (to_local() if callable(to_local) else t).detach()


def _weighted(sums: torch.Tensor) -> torch.Tensor:
    """Σ (i + 1) x sums[i] in int64 (wrapping): a sum that moves when equal amounts trade places."""
    weights = torch.arange(1, sums.numel() + 1, device=sums.device, dtype=torch.int64)
    return (sums.to(torch.int64) * weights).sum()


def terms(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Three int64 numbers per tensor, stacked on the tensors' device (no host sync): its bits read as integers
    and laid out in rows of WIDTH, the place-weighted sums of its row sums and of its column sums (each wrapping
    in the integers' width, accumulated at that width: a cheap pass), and the sum of the ragged tail."""
    parts = []
    for tensor in tensors:
        flat = _local(tensor).contiguous().reshape(-1)
        if flat.numel() == 0 or flat.is_complex() or flat.element_size() not in _INTS:
            continue
        bits = flat.view(_INTS[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.uint8)
        # below 4 bytes the sums accumulate in int32 (a narrower sum would wrap after a few elements)
        acc = bits.dtype if bits.element_size() >= 4 else torch.int32
        full = bits.numel() // WIDTH * WIDTH
        rows = bits[:full].view(-1, WIDTH)
        tail = bits[full:]
        parts.append(
            torch.stack((
                _weighted(rows.sum(1, dtype=acc)),
                _weighted(rows.sum(0, dtype=acc)) if full else torch.zeros((), dtype=torch.int64, device=bits.device),
                _weighted(tail),
            ))
        )  # fmt: skip
    if not parts:
        return None
    device = parts[0].device
    return torch.cat([p.to(device) for p in parts])


def digest(tensors: Iterable[torch.Tensor]) -> tuple[str, int]:
    """(hex digest, number of tensors) of the tensors' bits: one host synchronization."""
    listed = list(tensors)
    found = terms(listed)
    values = found.tolist() if found is not None else []
    h = hashlib.sha256(struct.pack(f"<{len(values)}q", *values))
    return h.hexdigest()[:16], len(listed)


def parameters(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """The model's parameters in their registration order (what an update changes)."""
    return [] if model is None else list(model.parameters())


def layout(params: list[torch.Tensor]) -> str:
    """A short hash of what this rank holds of each parameter (its shard's shape and dtype, in order): two digests
    are comparable only where it is the same (another parallelism at the same world size shards otherwise)."""
    shapes = [(tuple(_local(t).shape), str(t.dtype)) for t in params]
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]


class DigestLog(RankLog):
    """A rank's per-update digests: `{"u": update, "params": hex, "n": tensors, "layout": hex}`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._layout: tuple[list[int], str] | None = None  # the parameters' ids and their layout, once

    def record(self, update: int, model: torch.nn.Module | None) -> None:
        params = parameters(model)
        if params:
            hex_digest, count = digest(params)
            ids = [id(t) for t in params]
            if self._layout is None or self._layout[0] != ids:
                self._layout = (ids, layout(params))
            self.write({"u": update, "params": hex_digest, "n": count, "layout": self._layout[1]})


def _rows(path: Path) -> Iterable[dict[str, Any]]:
    """One rank's digest log, the lines that name an update and a digest (in order: the last of an update wins)."""
    for row in iter_records(path) if path.is_file() else []:
        if isinstance(row, dict) and isinstance(row.get("u"), int) and isinstance(row.get("params"), str):
            yield row


def recorded(path: Path, update: int) -> dict[str, Any] | None:
    """The last record of `update` in one rank's digest log (None: none, e.g. a kill lost its buffered lines)."""
    found = None
    for row in _rows(path):
        if row["u"] == update:
            found = row
    return found


def restored_differs(path: Path, update: int, model: torch.nn.Module | None) -> str | None:
    """Whether the parameters just restored from checkpoint-<update> are not those update <update> trained, by
    this rank's digest log: a line saying how, or None (equal, or nothing comparable recorded: no line of that
    update, or one of another layout)."""
    params = parameters(model)
    row = recorded(path, update) if params else None
    if row is None or row.get("layout") != layout(params) or row.get("n") != len(params):
        return None
    got, _ = digest(params)
    if got == row["params"]:
        return None
    return f"the parameters restored hash to {got}, update {update} trained {row['params']} ({path.parent.name}/{path.name})"


def read_digests(run: RunDir) -> dict[int, dict[int, str]]:
    """`{rank: {update: digest}}` of a run directory (the last line of each update wins)."""
    out: dict[int, dict[int, str]] = {}
    train = run.train_dir
    for path in sorted(train.glob("digests-rank*.jsonl")) if train.is_dir() else []:
        rank = int(path.stem.removeprefix("digests-rank"))
        out[rank] = {row["u"]: row["params"] for row in _rows(path)}
    return out


def first_parting(a: dict[int, dict[int, str]], b: dict[int, dict[int, str]]) -> tuple[int | None, Any]:
    """(the first update whose digest differs on some rank, among the updates both recorded; the ranks there)."""
    parted: dict[int, list[int]] = {}
    for rank in sorted(set(a) & set(b)):
        for update in sorted(set(a[rank]) & set(b[rank])):
            if a[rank][update] != b[rank][update]:
                parted.setdefault(update, []).append(rank)
                break
    if not parted:
        return None, []
    first = min(parted)
    return first, parted[first]
