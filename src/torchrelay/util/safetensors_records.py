"""A safetensors file read as untrusted input: its header checked before safetensors allocates a byte (the bounds:
util/records.py, docs/FORMATS.md)."""

from __future__ import annotations

import math
import os
import struct
from typing import Any

from torchrelay.errors import RecordError
from torchrelay.util.records import DAMAGED_HINT, SAFETENSORS_HEADER_LIMIT, kind_of, parse_json
from torchrelay.util.safepath import open_regular

# Bytes per element of each safetensors dtype (safetensors 0.4+): every one its writer writes (a stateful's complex64
# or FNUZ float8 tensor too), or a checkpoint that holds one is refused as damaged at every resume.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E5M2FNUZ": 1, "F8_E4M3FNUZ": 1, "I16": 2,
    "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def safetensors_header(data: bytes, size: int, *, source: str) -> dict[str, Any]:
    """The header of a safetensors file whose first bytes are `data` and whose size is `size`, checked before
    anything is allocated: its length bounded, its JSON an object of tensors, each of a known dtype, a shape of
    sizes, and offsets that lay the tensors back to back, each of its shape's size, ending at the file's end."""
    if len(data) < 8:
        raise RecordError(source, f"has {size} bytes, too few for a safetensors header", hint=DAMAGED_HINT)
    (length,) = struct.unpack("<Q", data[:8])
    if length > SAFETENSORS_HEADER_LIMIT or 8 + length > size:
        raise RecordError(
            source,
            f"claims a safetensors header of {length:,} bytes in a file of {size:,} (a pickle or a forgery?)",
            hint=DAMAGED_HINT,
        )
    header = parse_json(data[8 : 8 + length], source=f"{source} header")
    if not isinstance(header, dict):
        raise RecordError(source, f"header is a JSON {kind_of(header)}, not an object", hint=DAMAGED_HINT)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise RecordError(
                    source, "is not an object of strings", field="__metadata__", hint=DAMAGED_HINT
                )
            continue
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_SIZES:
            raise RecordError(source, f"{where} has no known dtype", hint=DAMAGED_HINT)
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(_natural(d) for d in shape):
            raise RecordError(
                source, f"{where}: shape {str(shape)[:80]} is not a list of sizes", hint=DAMAGED_HINT
            )
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets):
            raise RecordError(
                source, f"{where}: data_offsets {str(offsets)[:80]} are not two offsets", hint=DAMAGED_HINT
            )
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPE_SIZES[entry["dtype"]]:
            raise RecordError(
                source,
                f"{where}: data_offsets [{begin}, {end}] do not hold a {entry['dtype']} tensor of shape {shape}",
                hint=DAMAGED_HINT,
            )
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            problem = "overlaps the tensor before it" if begin < at else "leaves a gap before it"
            raise RecordError(source, f"tensor {name!r} at [{begin}, {end}] {problem}", hint=DAMAGED_HINT)
        at = end
    if 8 + length + at != size:
        raise RecordError(
            source, f"its tensors end at byte {8 + length + at:,}, the file at {size:,}", hint=DAMAGED_HINT
        )
    return header


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors(
    path: str | os.PathLike[str], *, what: str, root: str | os.PathLike[str] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, metadata) of a safetensors file read as untrusted input: opened the safe way, its header checked
    (`safetensors_header`) before safetensors allocates a byte; any other fault of the file is a RecordError too."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source = f"{path} ({what})"
    fd, size = open_regular(path, what=what, root=root)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) == 8:
            (length,) = struct.unpack("<Q", head)
            if length <= SAFETENSORS_HEADER_LIMIT and 8 + length <= size:
                head += os.pread(fd, length, 8)
        header = safetensors_header(head, size, source=source)
        # The file checked is the file loaded: safetensors opens it again, by this descriptor where /proc has it.
        by_fd = f"/proc/self/fd/{fd}"
        try:
            tensors = load_file(by_fd if os.path.exists(by_fd) else os.fspath(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise RecordError(
                source, f"not a safetensors file safetensors reads ({str(exc)[:200]})", hint=DAMAGED_HINT
            ) from None
    finally:
        os.close(fd)
    return tensors, dict(header.get("__metadata__") or {})
