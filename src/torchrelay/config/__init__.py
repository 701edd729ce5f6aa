"""The configuration layer: the typed run configuration, the tunables of the checkpoint core, and every
TORCHRELAY_* environment variable.

`torchrelay.config` was one module until the modules were grouped into packages: a training script written then
(`from torchrelay.config import parse_assignments`) still runs, its names read from config/relay.py when first asked
for (not at import: the environment variables below it are imported by the lowest layer)."""

from __future__ import annotations

import importlib
from typing import Any

_RELAY = frozenset(
    {
        "RelayConfig",
        "parse_assignments",
        "parse_value",
        "is_runtime_key",
        "RUNTIME_FIELDS",
        "SAMPLERS",
        "ELASTIC_MODES",
    }
)


def __getattr__(name: str) -> Any:
    if name in _RELAY:
        return getattr(importlib.import_module("torchrelay.config.relay"), name)
    raise AttributeError(f"module 'torchrelay.config' has no attribute {name!r}")
