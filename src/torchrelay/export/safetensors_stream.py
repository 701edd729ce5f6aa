"""Write a safetensors file one tensor at a time, hashing the bytes on their way to disk.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the tensors' bytes back to back. Every shape and dtype is known from the checkpoint's metadata before a
byte is read, so the header is written first and the tensors follow as they are read: memory holds one tensor,
never the file, and `safetensors.safe_open` (and so Hugging Face `from_pretrained`) reads the result.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from torchrelay.errors import ConfigError, RelayError

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def nbytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor of a file: its name, shape and dtype as written."""

    name: str
    shape: list[int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


class SafetensorsWriter:
    """`with SafetensorsWriter(path, slots) as w: w.write(name, tensor)` for each slot, in order."""

    def __init__(self, path: Path, slots: list[TensorSlot], metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":  # safetensors is little-endian; torch's bytes are the machine's
            raise RelayError("safetensors export needs a little-endian machine")
        self.path = path
        self.slots = slots
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for slot in slots:
            if slot.dtype not in DTYPE_CODES:
                raise ConfigError(
                    f"tensor {slot.name!r} has dtype {slot.dtype}, which safetensors cannot hold"
                )
            header[slot.name] = {
                "dtype": DTYPE_CODES[slot.dtype],
                "shape": slot.shape,
                "data_offsets": [offset, offset + slot.nbytes],
            }
            offset += slot.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._f = open(path, "wb")  # noqa: SIM115 - closed in __exit__
        self._emit(struct.pack("<Q", len(text)) + text)

    def _emit(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next slot's bytes; the tensor must match the slot exactly (name, shape, dtype)."""
        slot = self.slots[self._next]
        if name != slot.name or list(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise RelayError(
                f"{self.path}: expected {slot.name} {slot.shape} {slot.dtype}, got {name} "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            self._emit(flat.view(torch.uint8).numpy().data)
        self._next += 1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                if self._next != len(self.slots):
                    raise RelayError(
                        f"{self.path}: {len(self.slots) - self._next} tensor(s) were not written"
                    )
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
