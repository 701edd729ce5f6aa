"""One trained-and-packed run shared by the handoff tests: baseline, stopped source, and its bundle."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import launch, make_code_repo, make_data, write_config
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.policy.stop import write_request

TOTAL = 16
STOP_AT = 5


@dataclass
class Packed:
    base: Path
    code: Path
    root: Path
    manifest: Path
    teacher: Path
    config: Path
    baseline: Path
    source: Path
    bundle: Path
    lineage: str


def build_packed(base: Path) -> Packed:
    """Train uninterrupted (the reference), train again stopping at STOP_AT, and pack the stopped run."""
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    teacher = base / "teacher" / "teacher.bin"
    teacher.parent.mkdir()
    teacher.write_bytes(os.urandom(4096))
    config = write_config(base / "lm.yaml", manifest, root, external_files={"teacher": str(teacher)})
    baseline = base / "baseline"
    out = launch(code, baseline, config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    source = base / "source"
    source.mkdir()
    write_request(source, at_update=STOP_AT)
    out = launch(code, source, config=config)
    assert (source / f"checkpoint-{STOP_AT}" / "COMPLETE.json").exists(), out.stdout + out.stderr
    bundle = base / "bundle"
    result = pack(source, bundle, PackOptions(code_dir=code))
    info = json.loads((bundle / "bundle.json").read_text())
    assert info["lineage"] == result.lineage
    return Packed(base, code, root, manifest, teacher, config, baseline, source, bundle, result.lineage)


@pytest.fixture(scope="session", name="packed")
def packed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    """Built once per session and shared by the handoff and security tests; tests copy it before changing it."""
    return build_packed(tmp_path_factory.mktemp("handoff"))
