"""A package's names imported on first use (PEP 562): `import torchrelay` and the light CLI verbs load no torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `torchrelay.<where[name]>` the first time `name` is read."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"torchrelay.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
