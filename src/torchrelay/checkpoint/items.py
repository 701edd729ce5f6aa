"""One DCP item (a tensor torch.save wrote into a shard file) parsed without executing a pickle: from verified bytes in
memory (the verified reader) or from a window of an open file (offline reads), each a weights_only load.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import IO, Any

import torch

from torchrelay.checkpoint.torch_compat import StorageInfo, tensor_layout, zip_reader
from torchrelay.errors import CheckpointError, UnsafeInput


def _parse_item(view: memoryview, offset: int, length: int, path: Path, fqn: str) -> torch.Tensor:
    """The tensor DCP stored at bytes [offset, offset + length) of a verified file (a torch.save archive).

    torch.load(weights_only=True) without the data (torch_compat.tensor_layout) parses the archive's records and its
    pickle: it says where the tensor's bytes lie, and the tensor returned is a view of them in `view` (one copy
    less than torch.load to CPU, the largest cost of a load). An archive that asks for byte swapping, or one whose
    storage's place is not known, is loaded by torch.load to CPU instead."""
    stream = io.BufferedReader(_Memory(view[offset : offset + length]), buffer_size=1 << 16)
    try:
        if sys.byteorder == "little" and _little_endian(stream):
            stream.seek(0)
            layout, start = tensor_layout(stream)
            if isinstance(layout, torch.Tensor) and isinstance(start, int):
                return _in_place(view, offset, length, start, layout)
    except Exception as exc:  # noqa: BLE001 - weights_only refuses any payload that is not plain tensors
        raise _not_plain(path, fqn, exc) from exc
    stream.seek(0)
    part = _load_item(stream, path, fqn)
    if not isinstance(part, torch.Tensor):
        raise UnsafeInput(f"{path}: the bytes of {fqn!r} hold a {type(part).__name__}, not a tensor")
    return part


def _in_place(view: memoryview, offset: int, length: int, start: int, layout: torch.Tensor) -> torch.Tensor:
    """`layout`'s tensor over its storage's bytes at `start` of the item [offset, offset + length) of `view`: only
    the elements it reaches (the storage's own size is not trusted: torch 2.8's skip_data load makes it element-size times too large)."""
    if layout.numel() == 0:
        return torch.empty(0, dtype=layout.dtype).as_strided(
            layout.size(), layout.stride(), layout.storage_offset()
        )
    reach = (
        int(layout.storage_offset()) + sum((n - 1) * s for n, s in zip(layout.size(), layout.stride())) + 1
    )
    nbytes = reach * layout.element_size()
    if start < 0 or start + nbytes > length:
        raise CheckpointError(f"bytes {start}..{start + nbytes} lie outside the item's {length}")
    flat = torch.frombuffer(view, dtype=layout.dtype, count=reach, offset=offset + start)
    return flat.as_strided(layout.size(), layout.stride(), layout.storage_offset())


def _narrow(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The part [offsets, offsets + sizes) of `tensor`, a view (what DCP's own reader narrows a stored chunk to)."""
    for dim, (start, length) in enumerate(zip(offsets, sizes)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _load_item(stream: IO[bytes], path: Path, fqn: str) -> Any:
    """torch.load(weights_only=True) of one DCP item to CPU; anything it refuses is refused naming the file."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refuses any payload that is not plain tensors
        raise _not_plain(path, fqn, exc) from exc


def _not_plain(path: Path, fqn: str, exc: Exception) -> UnsafeInput:
    return UnsafeInput(f"{path}: the bytes of {fqn!r} are not a plain tensor ({type(exc).__name__}: {exc})")


def _refuse_transforms(info: StorageInfo, where: Path, fqn: str) -> None:
    """torchrelay never writes DCP's stream transforms (compression and the like): such an item is not read."""
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{where}: {fqn!r} is stored with transforms {list(info.transform_descriptors or ())}, "
            "which torchrelay never writes",
            hint="this checkpoint was not written by torchrelay; read it with torch.distributed.checkpoint",
        )


def _little_endian(stream: IO[bytes]) -> bool:
    """The archive's byte order is the host's (torch.load onto meta would crash on another: torch 2.13)."""
    reader = zip_reader(stream)
    return "byteorder" not in reader.get_all_records() or reader.get_record("byteorder") == b"little"


class _Seekable(io.RawIOBase):
    """A read-only, seekable file of `_size` bytes at position `_pos`; a subclass says how to read them."""

    _size: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + pos, 0), self._size)
        return self._pos


class _Memory(_Seekable):
    """A read-only, seekable file over bytes already in memory."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._view, self._pos = memoryview(data), 0
        self._size = len(self._view)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), len(self._view) - self._pos)
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n
