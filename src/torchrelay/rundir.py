"""The layout of a run directory (docs/FORMATS.md), in one place."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchrelay.checkpoint.select import CheckpointInfo, list_checkpoints
from torchrelay.config import RelayConfig
from torchrelay.errors import IntegrityError


class RunDir:
    """Paths of a run directory; creates nothing by itself."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    config_path = property(lambda self: self.path / "config.json")
    contract_path = property(lambda self: self.path / "resume_contract.json")
    manifest_path = property(lambda self: self.path / "data" / "manifest.jsonl")
    history_path = property(lambda self: self.path / "history.jsonl")
    train_dir = property(lambda self: self.path / "train")

    def exists(self) -> bool:
        return self.contract_path.exists()

    def checkpoints(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.path)

    def load_config(self) -> RelayConfig:
        """The stored (live) configuration, with the manifest pointing into the run directory."""
        try:
            data = json.loads(self.config_path.read_text())
        except FileNotFoundError as exc:
            raise IntegrityError(
                f"{self.config_path} is missing: {self.path} holds no torchrelay run"
            ) from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"{self.config_path} is not valid UTF-8 JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise IntegrityError(f"{self.config_path} does not hold a JSON object")
        return RelayConfig.from_dict(data, source=str(self.config_path))
