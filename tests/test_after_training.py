"""After training: checkpoints preserved for later use, validation at chosen checkpoints, export for serving.

One real 2-rank run of the example (save_every 5, keep 2, keep_updates [10, 20], 30 updates) serves every test
of the module that needs a run; the rest are unit tests of the pure policies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import launch, write_config
from torchrelay.checkpoint.retention import AnyOf, EveryN, Explicit, Final, LatestN, decide, policy_for
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.cli import main
from torchrelay.config import RelayConfig
from torchrelay.contract import build_contract
from torchrelay.errors import ConfigError
from torchrelay.manifest import Manifest

TOTAL = 30
KEEP = {"total_updates": TOTAL, "warmup_updates": 2, "save_every": 5, "keep": 2, "keep_updates": [10, 20]}


# ------------------------------------------------------------------------------------------------ units
def _cfg(**changes: object) -> RelayConfig:
    return RelayConfig.from_dict({"seed": 1, "micro_batch": 2, "manifest": "m.jsonl", **KEEP, **changes})


def test_preservation_policies_compose_and_say_why() -> None:
    saved = [5, 10, 15, 20, 25, 30]
    verdict = decide(policy_for(_cfg()), saved)
    assert verdict.deleted == [5, 15]
    assert verdict.kept == {
        10: "keep_updates",
        20: "keep_updates",
        25: "latest 2",
        30: "latest 2, final",
    }
    every = decide(policy_for(_cfg(keep_every=15, keep_updates=[])), saved)
    assert every.kept == {15: "keep_every 15", 25: "latest 2", 30: "latest 2, keep_every 15, final"}
    # the final checkpoint survives later saves of nothing newer (e.g. a run whose keep shrank)
    assert decide(AnyOf((LatestN(2), Final(20))), [10, 20, 25, 30]).kept == {
        20: "final",
        25: "latest 2",
        30: "latest 2",
    }
    # whatever a policy says, the newest complete checkpoint is what a resume needs
    assert decide(Explicit(frozenset({5})), [5, 10]).kept == {5: "keep_updates", 10: "newest"}
    assert decide(policy_for(_cfg()), []).kept == {}
    # a checkpoint to keep must be written: the loop saves at kept updates off the save_every cadence too
    policy = policy_for(_cfg(keep_updates=[7], keep_every=12))
    assert [u for u in range(1, TOTAL) if policy.saves_at(u)] == [7, 12, 24]
    assert not LatestN(2).saves_at(7) and EveryN(0).preserve([0, 5]) == {}


def test_preservation_fields_are_validated_and_runtime_only(example: dict[str, Path]) -> None:
    with pytest.raises(
        ConfigError, match=r"'keep_updates' must be a list of updates in \[1, total_updates=30\]"
    ):
        _cfg(keep_updates=[0])
    with pytest.raises(ConfigError, match="'keep_updates' must be a list"):
        _cfg(keep_updates=[31])
    with pytest.raises(ConfigError, match="'keep_every' must be an integer >= 0"):
        _cfg(keep_every=-1)
    assert _cfg(keep_updates=[20, 10, 20]).keep_updates == [10, 20]
    # changing what is kept never changes the contract (the math): a resume accepts it as a runtime change
    base = RelayConfig.from_dict(
        {
            "seed": 1,
            "micro_batch": 2,
            "manifest": str(example["manifest"]),
            "data_root": str(example["root"]),
            **KEEP,
        }
    )
    manifest = Manifest.load(example["manifest"], str(example["root"]))
    a = build_contract(base, 2, None, manifest)
    b = build_contract(base.replace(keep_updates=[5], keep_every=3, keep=4), 2, None, manifest)
    assert a["sha256"] == b["sha256"]


# ------------------------------------------------------------------------------------------------ one real run
@pytest.fixture(scope="module")
def kept_run(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("kept")
    config = write_config(base / "lm.yaml", example["manifest"], example["root"], **KEEP)
    run = base / "run"
    out = launch(example["code"], run, config=config)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run


def test_retention_keeps_the_listed_updates_and_the_latest_two(
    kept_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpts = list_checkpoints(kept_run)
    assert [c.update for c in ckpts] == [10, 20, 25, 30] and all(c.complete for c in ckpts)
    assert main(["status", str(kept_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {c["update"]: c["kept"] for c in status["checkpoints"]} == {
        10: "keep_updates",
        20: "keep_updates",
        25: "latest 2",
        30: "latest 2, final",
    }
    assert main(["status", str(kept_run)]) == 0
    table = capsys.readouterr().out
    assert "kept because" in table and "keep_updates" in table
