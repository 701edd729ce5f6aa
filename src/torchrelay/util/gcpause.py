"""No cyclic garbage collection for the length of a block that makes many objects at once (a load, a metadata
file's unpickling): each collection of the oldest generation walks the whole heap of a process that has torch and
a model in it, tens of milliseconds each, while the block's threads wait on the interpreter."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """Collections off inside the block; back on after it only where they were on before it (nested blocks, and a
    caller that turned them off itself, keep them off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
