"""In-process tests of the run directory's one name table: a checkpoint's name has one format and one strict
parser, every reader of checkpoints asks it, and a bundle's records are believed only as verified."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.errors import IntegrityError
from torchrelay.paths.layout import checkpoint_name, parse_checkpoint_name
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.records.validation import read_records

HOSTILE = [
    "checkpoint-0007",  # a second name for update 7
    "checkpoint-00",
    "checkpoint-x",
    "checkpoint-",
    "checkpoint--1",
    "checkpoint-+7",
    "checkpoint- 7",
    "checkpoint-7 ",
    "checkpoint-7\n",
    "checkpoint-1e3",
    "checkpoint-7.5",
    "checkpoint-\u0667",  # ARABIC-INDIC DIGIT SEVEN: a digit to str.isdigit and to \d, not to us
    "checkpoint-\uff17",  # FULLWIDTH DIGIT SEVEN
    "checkpoint-" + "9" * 5000,  # past int()'s limit on a string's digits
    "Checkpoint-7",
    " checkpoint-7",
    ".tmp-checkpoint-7",
    "checkpoint-7/",
    "checkpoint-7.old",
    "7",
    "",
]


def test_checkpoint_name_round_trips() -> None:
    for update in (0, 1, 7, 10, 100, 12345, 10**17):
        assert parse_checkpoint_name(checkpoint_name(update)) == update
    assert checkpoint_name(7) == "checkpoint-7"
    assert RunDir("/r").checkpoint(7) == Path("/r/checkpoint-7")


@pytest.mark.parametrize("name", HOSTILE)
def test_a_name_checkpoint_name_does_not_write_is_no_checkpoint(name: str) -> None:
    assert parse_checkpoint_name(name) is None


@pytest.mark.parametrize("update", [-1, True, "7", 7.0, None])
def test_only_an_update_has_a_checkpoint_name(update: object) -> None:
    with pytest.raises(ValueError, match="a checkpoint's update is an int >= 0"):
        checkpoint_name(update)  # type: ignore[arg-type]


def test_the_readers_of_checkpoints_ignore_other_names(tmp_path: Path) -> None:
    # Directories named like checkpoints, but not as the writer names them: never a candidate to resume from,
    # to validate or to clean (before, `checkpoint-0007` was a second update 7 and `checkpoint-\u0667` update 7).
    for name in ("checkpoint-0007", "checkpoint-\u0667", "checkpoint-7 "):
        (tmp_path / name).mkdir()
        (tmp_path / "validation" / name).mkdir(parents=True)
        (tmp_path / "validation" / name / "record.json").write_text("{}")
    assert list_checkpoints(tmp_path) == []
    assert RunDir(tmp_path).checkpoint_dirs() == []
    assert read_records(RunDir(tmp_path)) == {}
    (tmp_path / "checkpoint-7").mkdir()
    assert [c.update for c in list_checkpoints(tmp_path)] == [7]
    assert RunDir(tmp_path).checkpoint_dirs() == [tmp_path / "checkpoint-7"]


def test_a_bundle_record_is_believed_only_as_verified(tmp_path: Path) -> None:
    info = {"lineage": "abc", "parent_lineage": None, "checkpoint": "checkpoint-3", "source": None}
    bundle = Bundle(tmp_path)
    bundle.info_path.write_text(json.dumps(info))
    verified = {"bundle.json": (hashlib.sha256(bundle.info_path.read_bytes()).hexdigest(), 0)}
    assert bundle.info(verified)["lineage"] == "abc"
    bundle.info_path.write_text(json.dumps({**info, "lineage": "forged"}))
    with pytest.raises(IntegrityError, match="bundle.json changed between verification and reading"):
        bundle.info(verified)
    with pytest.raises(IntegrityError, match="bundle.json changed between verification and reading"):
        bundle.info({})  # a bundle.json SHA256SUMS does not list is not believed either
