"""Fixtures shared by the suite: the example's code repo and data, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff_fixtures import packed_fixture  # noqa: F401 - `packed`: here, so the session builds it once, not per module
from helpers import make_code_repo, make_data, write_config


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{'code': git repo with train_lm.py, 'root': data root, 'manifest': manifest, 'config': small config}."""
    base = tmp_path_factory.mktemp("example")
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    config = write_config(base / "lm.yaml", manifest, root)
    return {"base": base, "code": code, "root": root, "manifest": manifest, "config": config}
