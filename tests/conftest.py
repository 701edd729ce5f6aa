"""Fixtures shared by the suite: the example's code repo and data, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff_fixtures import packed_fixture  # noqa: F401 - `packed`: here, so the session builds it once, not per module
from helpers import launch, make_code_repo, make_data, write_config


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{'code': git repo with train_lm.py, 'root': data root, 'manifest': manifest, 'config': small config}."""
    base = tmp_path_factory.mktemp("example")
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    config = write_config(base / "lm.yaml", manifest, root)
    return {"base": base, "code": code, "root": root, "manifest": manifest, "config": config}


@pytest.fixture(scope="session")
def baseline(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's config trained uninterrupted on 2 ranks: the reference several modules compare against.
    Read it, never change it (copy it first)."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    out = launch(example["code"], run, config=example["config"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SCHEDULE_GATE_PASS (16, 2)" in out.stdout and "TRAINING_CONTRACT" in out.stdout
    return run
