"""The layout of a run directory (docs/FORMATS.md), in one place."""

from __future__ import annotations

import os
from pathlib import Path

from torchrelay.checkpoint.select import CheckpointInfo, list_checkpoints
from torchrelay.config import RelayConfig
from torchrelay.errors import IntegrityError
from torchrelay.fsutil import read_json, temp_prefix
from torchrelay.layout import CONFIG_FILE, CONTRACT_FILE, HISTORY_FILE, LINEAGE_FILE, MANIFEST_REL, TRAIN_DIR
from torchrelay.manifest import INDEX_NAME
from torchrelay.util.records import read_json_or_none

# Files only the run's writer (who holds its lock) replaces, each by an atomic write; a writer killed mid-write
# leaves its temporary behind, for the next writer to remove.
WRITER_FILES = (CONFIG_FILE, LINEAGE_FILE, CONTRACT_FILE, HISTORY_FILE)


class RunDir:
    """Paths of a run directory; creates nothing by itself."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    config_path = property(lambda self: self.path / CONFIG_FILE)
    contract_path = property(lambda self: self.path / CONTRACT_FILE)
    manifest_path = property(lambda self: self.path / MANIFEST_REL)
    manifest_index_path = property(lambda self: self.path / "data" / INDEX_NAME)
    history_path = property(lambda self: self.path / HISTORY_FILE)
    train_dir = property(lambda self: self.path / TRAIN_DIR)

    def exists(self) -> bool:
        # Creating a run writes the contract last: a creation killed before it leaves no run, only its debris.
        return self.contract_path.exists()

    def unexplained_entries(self, allowed: tuple[str, ...] = ()) -> list[str]:
        """What a directory that holds no run contains beyond `allowed` and a killed creation's own files."""
        temps = tuple(temp_prefix(n) for n in WRITER_FILES)
        train = self.train_dir.is_dir() and not any(self.train_dir.iterdir())
        out = []
        for p in sorted(self.path.iterdir()):
            name = p.name
            if name in allowed or name.startswith(temps):
                continue
            if name == "train" and train:
                continue
            # data/ comes first, then train/, then the manifest's copy in data/: only a creation makes both.
            if (
                name == "data"
                and p.is_dir()
                and {c.name for c in p.iterdir() if not c.name.startswith(temp_prefix(INDEX_NAME))}
                <= ({"manifest.jsonl", INDEX_NAME} if train else set())
            ):
                continue
            if name in (CONFIG_FILE, LINEAGE_FILE) and train and _is_json_object(p):
                continue
            out.append(name)
        return out

    def remove_stale_temps(self) -> list[str]:
        """Remove what a writer killed mid-write left: atomic-write temporaries, a log's trim (hold the lock)."""
        temps = tuple(temp_prefix(n) for n in WRITER_FILES)
        found = [self.path / n for n in os.listdir(self.path) if n.startswith(temps)]
        if self.train_dir.is_dir():
            found += [p for p in self.train_dir.iterdir() if p.name.endswith(".jsonl.trim")]
        data = self.path / "data"
        if data.is_dir():
            found += [p for p in data.iterdir() if p.name.startswith(temp_prefix(INDEX_NAME))]
        for p in found:
            p.unlink(missing_ok=True)
        return [str(p.relative_to(self.path)) for p in found]

    def checkpoints(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.path)

    def load_config(self) -> RelayConfig:
        """The stored (live) configuration, with the manifest pointing into the run directory."""
        try:
            data = read_json(self.config_path, what="the run's configuration")
        except FileNotFoundError as exc:
            raise IntegrityError(
                f"{self.config_path} is missing: {self.path} holds no torchrelay run"
            ) from exc
        if not isinstance(data, dict):
            raise IntegrityError(f"{self.config_path} does not hold a JSON object")
        return RelayConfig.from_dict(data, source=str(self.config_path))


def _is_json_object(path: Path) -> bool:
    return isinstance(read_json_or_none(path, what=path.name), dict)
