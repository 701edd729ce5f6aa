"""The names of a run directory's files (docs/FORMATS.md), each written once; a checkpoint's own files are named
in checkpoint/ (inventory.INVENTORY, handed_off.HANDED_OFF, state.STATE_FILE)."""

from __future__ import annotations

CONFIG_FILE = "config.json"
CONTRACT_FILE = "resume_contract.json"
LINEAGE_FILE = "lineage.json"
HISTORY_FILE = "history.jsonl"
MANIFEST_REL = "data/manifest.jsonl"  # the run's copy of its manifest
TRAIN_DIR = "train"  # per-rank metric and exposure logs
SOURCE_MANIFEST = "source_manifest.sha256"  # beside a bundle's (and a prepared run's) source tree
PREPARE_RECORD = "REBASE_RECORD.json"  # written by `prepare` (handoff/prepare.py owns its format)
