"""`torchrelay launch` after a crash (issue 52 (g)): the controller's relaunch resumes from the node-local memory tier
the crashed attempt saved, history records the tier, and the run ends bit for bit as the uninterrupted one. Real
CLI, real torchrun, the example LM, the whole controller tree SIGKILLed."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import (
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    last_logged,
    segments,
    write_config,
)
from kill_campaign import kill_job
from test_controller import CLI, launch_cli, outcome_of, write_plan
from torchrelay.checkpoint.tiers import memory_root
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir
from torchrelay.util.proctree import Tree

U = 16


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    run = tmp_path / "run"
    yield run
    if (run / "lineage.json").exists():  # whatever memory tier the test left in /dev/shm
        lineage = json.loads((run / "lineage.json").read_text())["lineage"]
        shutil.rmtree(memory_root(lineage, RunDir(run)).parent, ignore_errors=True)


@pytest.mark.launch
def test_the_controllers_relaunch_after_a_crash_resumes_from_the_memory_tier(
    example: dict[str, Path], baseline: Path, tmp_path: Path, run_dir: Path
) -> None:
    config = write_config(tmp_path / "lm.yaml", example["manifest"], example["root"], memory_every=1,
                          **{"params.min_update_s": 0.2})  # fmt: skip
    plan = write_plan(tmp_path / "plan.yaml", example["code"], config, run_dir, smoke={"when": "never"})
    proc = subprocess.Popen([*CLI, "launch", str(plan)], env=clean_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    tree = Tree(proc.pid)
    deadline = time.monotonic() + 240
    while last_logged(run_dir) < 11 and proc.poll() is None and time.monotonic() < deadline:
        tree.collect()
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    killed_after = last_logged(run_dir)
    kill_job(tree, proc)  # type: ignore[arg-type]
    assert killed_after < U, killed_after
    held = subprocess.run(
        [*CLI, "status", str(run_dir)], capture_output=True, text=True, env=clean_env(COLUMNS="200")
    )
    assert "(memory tier, this node)" in held.stdout, held.stdout + held.stderr  # what the relaunch can take

    out = launch_cli(plan)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first, second = segments(run_dir)
    assert first["ended"] == "crash", first
    assert second["resumed_tier"] == "memory" and 8 < second["resumed_from"] <= killed_after, (
        second,
        killed_after,
    )
    assert killed_after - second["resumed_from"] <= 2, (
        second,
        killed_after,
    )  # K=1, plus one still persisting
    assert outcome_of(run_dir)["exit_code"] == 0
    shown = subprocess.run(
        [*CLI, "status", str(run_dir)], capture_output=True, text=True, env=clean_env(COLUMNS="200")
    )
    assert "resumed from the memory tier" in shown.stdout, shown.stdout + shown.stderr
    assert_same_final_state(baseline, run_dir, U)
    assert_same_logs(baseline, run_dir)
    assert prove(run_dir).ok
