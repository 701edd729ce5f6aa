"""On a prepared run the fields `prepare` set keep their value against the script's own config, unless overridden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchrelay.checkpoint.resume_check import keep_prepared, prepared_keys
from torchrelay.config.relay import RelayConfig
from torchrelay.errors import ConfigError
from torchrelay.paths.rundir import RunDir


def config(**changes: object) -> RelayConfig:
    base = {"seed": 1, "micro_batch": 2, "total_updates": 10, "manifest": "data/manifest.jsonl"}
    return RelayConfig.from_dict({**base, **changes})


def prepared(tmp_path: Path, changes: dict[str, list[object]]) -> Path:
    (tmp_path / "REBASE_RECORD.json").write_text(json.dumps({"format": 1, "changes": changes}))
    return tmp_path


def test_prepared_fields_win_over_the_scripts_config(tmp_path: Path) -> None:
    run = prepared(
        tmp_path,
        {"data_root": ["/a", "/b"], "external_files.teacher": ["/a/t", "/b/t"], "params.log_every": [1, 5]},
    )
    stored = config(
        data_root="/b",
        external_files={"teacher": "/b/t"},
        params={"log_every": 5, "lr": 0.1},
        runtime_params=["log_every"],
        num_workers=2,
    )
    script = config(
        data_root="/a",
        external_files={"teacher": "/a/t"},
        params={"log_every": 1, "lr": 0.1},
        runtime_params=["log_every"],
        num_workers=4,
    )
    cfg, notes = keep_prepared(RunDir(run), stored, script, {})
    assert (cfg.data_root, cfg.external_files, cfg.params["log_every"]) == ("/b", {"teacher": "/b/t"}, 5)
    assert cfg.num_workers == 4  # not set by prepare: the script may change it, as on any run
    assert len(notes) == 3 and notes[0].startswith("kept data_root='/b' set by prepare (REBASE_RECORD.json)")
    assert "the script's config says '/a'" in notes[0]

    # An explicit override (--set, TORCHRELAY_OVERRIDES) decides instead: nothing is kept for those keys.
    cfg, notes = keep_prepared(
        RunDir(run), stored, script, {"data_root": "/c", "log_every": 9, "external_files": {}}
    )
    assert cfg.data_root == "/a" and cfg.params["log_every"] == 1 and notes == []


def test_a_run_without_prepare_or_with_agreeing_config_keeps_nothing(tmp_path: Path) -> None:
    stored, script = config(data_root="/b"), config(data_root="/a")
    assert keep_prepared(RunDir(tmp_path), stored, script, {}) == (script, [])
    run = prepared(tmp_path, {"data_root": ["/a", "/b"]})
    assert keep_prepared(RunDir(run), stored, stored, {}) == (stored, [])
    (run / "REBASE_RECORD.json").write_text("{torn")
    with pytest.raises(ConfigError, match="REBASE_RECORD.json cannot be read"):
        prepared_keys(RunDir(run))


def test_an_override_of_a_contract_field_is_refused_in_one_line_a_runtime_one_is_not() -> None:
    from torchrelay.checkpoint.resume_check import refuse_contract_overrides

    stored = config(params={"lr": 0.1, "log_every": 1}, runtime_params=["log_every"])

    def refusal(overrides: dict[str, object]) -> str | None:
        try:
            refuse_contract_overrides(stored, stored.with_overrides(overrides), overrides)
        except ConfigError as exc:
            assert "\n" not in exc.message
            return exc.message
        return None

    # a runtime field, a runtime parameter, the layout's split (reshard decides), a contract field left as it was
    for fine in ({"data_root": "/x"}, {"log_every": 5}, {"micro_batch": 4}, {"seed": 1}, {"num_workers": 3}):
        assert refusal(fine) is None, fine
    changes = "changes the training contract (not a runtime field)"
    assert refusal({"lr": 0.2}) == f"resume refused: override params.lr: 0.1 -> 0.2 {changes}"
    assert (
        refusal({"params": {"lr": 0.3, "log_every": 1}})
        == f"resume refused: override params.lr: 0.1 -> 0.3 {changes}"
    )
    assert refusal({"total_updates": 20}) == f"resume refused: override total_updates: 10 -> 20 {changes}"


def test_an_override_may_name_a_key_under_a_runtime_section() -> None:
    """`--set external_files.teacher=/b/t` on a relaunch (a runtime key, as prepare accepts it) was refused:
    `override 'external_files.teacher' names no config field`."""
    stored = config(external_files={"teacher": "/a/t"})
    assert stored.with_overrides({"external_files.teacher": "/b/t"}).external_files == {"teacher": "/b/t"}
    with pytest.raises(ConfigError, match="'seed.x' names no config field"):
        stored.with_overrides({"seed.x": 1})
    with pytest.raises(ConfigError, match="override 'nope' names no config field"):
        stored.with_overrides({"nope": 1})
