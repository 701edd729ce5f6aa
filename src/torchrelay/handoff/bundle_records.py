"""A verified bundle's records as `prepare` believes them: each read once, from the bytes SHA256SUMS vouches for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchrelay.config.relay import RelayConfig
from torchrelay.paths.layout import CONFIG_FILE
from torchrelay.paths.rundir import Bundle, Digests
from torchrelay.records.contract import load_contract
from torchrelay.records.history import read_history


@dataclass(frozen=True, slots=True)
class BundleRecords:
    """What `prepare` believes of a verified bundle: each record read once, from the bytes SHA256SUMS vouches for."""

    info: dict[str, Any]  # bundle.json
    contract: dict[str, Any]  # resume_contract.json (contract.load_contract)
    config: RelayConfig  # config.json as packed
    config_bytes: bytes  # its bytes, kept as the prepared run's config.json.orig
    history: list[dict[str, Any]]  # history.jsonl's segments


def bundle_config(bundle: Bundle) -> RelayConfig:
    """The run's configuration as packed (config.json), from the bytes the bundle read once."""
    return RelayConfig.from_dict(bundle.config_record()[0], source=CONFIG_FILE)


def verified_records(bundle: Bundle, verified: Digests) -> BundleRecords:
    """The records every use of a bundle needs, once `verify` checked it: each read once, refused unless its bytes
    are the verified ones."""
    config = bundle_config(bundle)
    data = bundle.verified_config_bytes(verified)
    info = bundle.info(verified)
    return BundleRecords(info, load_contract(bundle.path), config, data, read_history(bundle.path))
