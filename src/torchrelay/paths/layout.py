"""The one name table of a run directory and a bundle (docs/LAYOUT.md, docs/FORMATS.md): every name is written
here once, and a checkpoint's directory name has one format and one parser. `rundir.RunDir` and `rundir.Bundle`
turn these names into paths and read the files; a checkpoint's own files are named in checkpoint/
(inventory.INVENTORY, handed_off.HANDED_OFF, state.STATE_FILE)."""

from __future__ import annotations

from torchrelay.util.sums import SUMS_NAME

# --- a run directory -----------------------------------------------------------------------------------------
CONFIG_FILE = "config.json"
CONTRACT_FILE = "resume_contract.json"
LINEAGE_FILE = "lineage.json"
HISTORY_FILE = "history.jsonl"
DATA_DIR = "data"
MANIFEST_REL = f"{DATA_DIR}/manifest.jsonl"  # the run's copy of its manifest
INDEX_NAME = (
    "manifest.index.npz"  # the saved index of the manifest, beside the run's copy, data/manifest.jsonl
)
TRAIN_LOCK = ".torchrelay-train.lock"  # the training's writer lock (paths/lock.py)
LOCK_FILES = frozenset({TRAIN_LOCK})
TRAIN_DIR = "train"  # per-rank metric and exposure logs
VALIDATION_DIR = "validation"  # one record per validated checkpoint (records/validation.py owns the format)
ATTEMPTS_DIR = "attempts"  # the controller's record of each launch
REQUEST_STOP = "REQUEST_STOP"  # a stop asked by touching this file (policy/stop.py reads it)
SOURCE_DIR = "source"  # the run's exact code: a bundle's archives, a prepared run's extracted tree
SOURCE_MANIFEST = "source_manifest.sha256"  # beside a bundle's (and a prepared run's) source tree
PREPARE_RECORD = "REBASE_RECORD.json"  # written by `prepare` (handoff/prepare.py owns its format)
# Written into a committed checkpoint by the ledger's background prover (ledger/proof.py owns its format).
LEDGER_PROOF = "LEDGER_PROOF.json"

# --- a bundle: a run directory's files (above) at its top, and these ------------------------------------------
BUNDLE_INFO = "bundle.json"  # the bundle's lineage record
SUMS_FILE = SUMS_NAME  # every other file's digest (util/sums.py owns the format); its digest is the bundle's
SIG_FILE = "SHA256SUMS.sig"  # an SSH signature of SHA256SUMS, when signed
MANIFEST_INFO = f"{DATA_DIR}/manifest_info.json"  # the manifest's identity at packing
PROGRESS_FILE = f"{DATA_DIR}/training_progress.json"  # the run's state at the stop
README_FILE = "README.md"

# --- a checkpoint's directory name: `checkpoint-<update>`, the update in decimal without leading zeros ---------
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_GLOB = f"{CHECKPOINT_PREFIX}*"  # a candidate only: parse_checkpoint_name decides
# a save's folder until its rename; a retired one until deleted; the run's one spare (checkpoint/recycle.py)
TMP_CHECKPOINT_PREFIX = ".tmp-checkpoint-"
DELETING_CHECKPOINT_PREFIX = ".deleting-checkpoint-"
SPARE_CHECKPOINT = ".spare-checkpoint"
_DIGITS = frozenset("0123456789")
_MAX_DIGITS = 18  # far past any run's updates, and short of int()'s refusal of a long string
MAX_UPDATE = 10**_MAX_DIGITS - 1  # the highest update a checkpoint's name can hold


def checkpoint_name(update: int) -> str:
    """The directory name of the checkpoint taken after `update` (`checkpoint-7`); parse_checkpoint_name's inverse."""
    if isinstance(update, bool) or not isinstance(update, int) or update < 0:
        raise ValueError(f"a checkpoint's update is an int >= 0, not {update!r}")
    return f"{CHECKPOINT_PREFIX}{update}"


def checkpoint_label(update: object) -> str:
    """A checkpoint's name as shown for an update read back from a record (a JSON key is text): for a line of
    output, never a path."""
    return f"{CHECKPOINT_PREFIX}{update}"


def parse_checkpoint_name(name: str) -> int | None:
    """The update of a checkpoint directory's name, or None for any other name: only what checkpoint_name writes
    is a checkpoint (`checkpoint-0007`, `checkpoint-+7`, `checkpoint-٧` or a trailing newline name none)."""
    digits = name.removeprefix(CHECKPOINT_PREFIX) if isinstance(name, str) else ""
    if (
        digits == name
        or not digits
        or len(digits) > _MAX_DIGITS
        or not set(digits) <= _DIGITS
        or (digits[0] == "0" and digits != "0")
    ):
        return None
    return int(digits)
