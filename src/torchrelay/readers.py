"""The documented offline readers (docs/CORE_API.md): what a tool may read of a run, a checkpoint or a manifest
without a process group. With `torchrelay/__init__.py` this is the public surface; every other module is internal
and may move."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrelay.util.lazy import lazy_names

__all__ = [
    "Manifest",
    "RunDir",
    "build_contract",
    "contract_diff",
    "contract_sha256",
    "flatten",
    "latest_complete",
    "list_checkpoints",
    "load_contract",
    "load_statefuls",
    "load_tensors",
    "prove",
    "read_history",
    "stored_config",
    "summarize",
    "validate_complete",
    "validate_resume",
    "write_inventory",
    "write_request",
]

if TYPE_CHECKING:
    from torchrelay.checkpoint.inventory import validate_complete, write_inventory
    from torchrelay.checkpoint.reader import load_statefuls, load_tensors
    from torchrelay.checkpoint.resume_check import validate_resume
    from torchrelay.checkpoint.select import latest_complete, list_checkpoints
    from torchrelay.config.relay import stored_config
    from torchrelay.ledger.exposure import prove
    from torchrelay.manifest import Manifest
    from torchrelay.paths.rundir import RunDir
    from torchrelay.policy.stop import write_request
    from torchrelay.records.contract import (
        build_contract,
        contract_diff,
        contract_sha256,
        flatten,
        load_contract,
    )
    from torchrelay.records.history import read_history
    from torchrelay.records.summary import summarize

# Lazy, as the package's own names: a tool that reads a run's status imports no torch for it.
_LAZY = {
    "Manifest": "manifest",
    "RunDir": "paths.rundir",
    "build_contract": "records.contract",
    "contract_diff": "records.contract",
    "contract_sha256": "records.contract",
    "flatten": "records.contract",
    "latest_complete": "checkpoint.select",
    "list_checkpoints": "checkpoint.select",
    "load_contract": "records.contract",
    "load_statefuls": "checkpoint.reader",
    "load_tensors": "checkpoint.reader",
    "prove": "ledger.exposure",
    "read_history": "records.history",
    "stored_config": "config.relay",
    "summarize": "records.summary",
    "validate_complete": "checkpoint.inventory",
    "validate_resume": "checkpoint.resume_check",
    "write_inventory": "checkpoint.inventory",
    "write_request": "policy.stop",
}

__getattr__ = lazy_names("torchrelay.readers", _LAZY)
