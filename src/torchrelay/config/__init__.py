"""The configuration layer: the typed run configuration, the tunables of the checkpoint core, and every
TORCHRELAY_* environment variable.

`torchrelay.config` was one module until the modules were grouped into packages: a training script written then
(`from torchrelay.config import parse_assignments`) still runs, its names read from config/relay.py when first asked
for (not at import: the environment variables below it are imported by the lowest layer)."""

from __future__ import annotations

from torchrelay.util.lazy import lazy_names

_RELAY = (
    "RelayConfig",
    "parse_assignments",
    "parse_value",
    "is_runtime_key",
    "RUNTIME_FIELDS",
    "SAMPLERS",
    "ELASTIC_MODES",
)
__getattr__ = lazy_names("torchrelay.config", dict.fromkeys(_RELAY, "config.relay"))
