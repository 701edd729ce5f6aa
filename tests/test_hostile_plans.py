"""A hostile or careless launch plan is refused in one line (exit 2, naming the file or field) before `sbatch` or
`launch` writes anything or starts a process: an alias bomb, a repeated key, a non-finite number, a count no node
has, a run_dir that holds something else. `cli.main(argv)` in-process; only the bomb runs in a subprocess, under a
timeout (it hung the reader)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import torchrelay
from torchrelay.cli import main
from torchrelay.controller.plan import load_plan
from torchrelay.errors import RecordError
from torchrelay.util.yaml_records import read_yaml

# 700 bytes whose aliases expand to 9^9 values: every reader that walks the document (the depth check first) hung
BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['x'] * 9)}]\n"
    for prev, name in zip(["", *"abcdefgh"], "abcdefghi", strict=True)
)
BASE = "run_dir: run\ntrain: {script: train.py}\nsmoke: {when: never}\n"


def _plan(**sections: str) -> str:
    """BASE with some top-level sections replaced or added (each written as YAML flow text)."""
    lines = {"run_dir": "run", "train": "{script: train.py}", "smoke": "{when: never}", **sections}
    return "".join(f"{key}: {value}\n" for key, value in lines.items())


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err and err.startswith(f"torchrelay {argv[0]}: error: "), err
    assert all(w in err for w in words), err
    return err


def _nothing_written(folder: Path, *keep: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(keep)


@pytest.mark.launch
def test_an_alias_bomb_is_refused_at_once_naming_the_file(tmp_path: Path) -> None:
    plan = tmp_path / "bomb.yaml"
    plan.write_text(BOMB + BASE)
    assert len(BOMB) < 800
    env = {"PYTHONPATH": str(Path(torchrelay.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    for verb in ("sbatch", "launch"):
        out = subprocess.run(
            [sys.executable, "-m", "torchrelay", verb, str(plan)],
            capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 2, (verb, out.stderr)
        assert "bomb.yaml (plan file): its aliases expand 38 values to 490329074" in out.stderr, out.stderr
        _nothing_written(tmp_path, "bomb.yaml")


def test_anchors_within_bounds_still_read_and_loops_and_repeated_keys_are_refused(tmp_path: Path) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text(
        "env: &env {A: '1'}\ntrain: {script: t.py, env: *env}\nsmoke: {<<: {updates: 4}, when: never}\n"
    )
    assert read_yaml(ok, what="plan") == {
        "env": {"A": "1"},
        "train": {"script": "t.py", "env": {"A": "1"}},
        "smoke": {"updates": 4, "when": "never"},
    }
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [1, *a]\n")
    with pytest.raises(RecordError, match=r"loop\.yaml \(plan\): an alias holds the node it names"):
        read_yaml(loop, what="plan")
    twice = tmp_path / "twice.yaml"
    twice.write_text("run_dir: a\ntrain: {script: t.py}\nrun_dir: /etc\n")
    with pytest.raises(RecordError, match=r"twice\.yaml \(plan\): key 'run_dir' is repeated at line 3"):
        read_yaml(twice, what="plan")


def test_top_level_x_keys_hold_anchors_and_are_ignored_other_unknown_keys_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`x-common: &common {...}` (docker-compose's convention) was refused as `plan.x-common: unknown field`."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "x-env: &env {A: '1'}\n"
        "x-smoke: &smoke {updates: 4, when: never}\n"
        "x-note: any value at all\n"
        "run_dir: run\ntrain: {script: t.py, env: *env}\nsmoke: {<<: *smoke, timeout_s: 60}\n"
    )
    loaded = load_plan(plan)
    assert loaded.train.env == {"A": "1"} and (loaded.smoke.updates, loaded.smoke.when) == (4, "never")
    assert not any(str(k).startswith("x-") for k in loaded.to_dict())
    # only at the top, and only x-: another unknown key is still one line naming it
    plan.write_text("x-env: &env {A: '1'}\nxenv: 1\nrun_dir: run\ntrain: {script: t.py}\n")
    _refused(capsys, ["sbatch", str(plan)], "plan.yaml: xenv: unknown field")
    plan.write_text("run_dir: run\ntrain: {script: t.py, x-env: {A: '1'}}\n")
    _refused(capsys, ["launch", str(plan)], "plan.yaml: train.x-env: unknown field")
    _nothing_written(tmp_path, "plan.yaml")


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"memory": "{soft_fraction: .nan}"}, "memory.soft_fraction: must be a finite number, got nan"),
        ({"memory": "{hard_fraction: .inf}"}, "memory.hard_fraction: must be a finite number, got inf"),
        ({"memory": "{soft_fraction: 2.5}"}, "memory.soft_fraction: must be <= 1"),
        ({"memory": "{soft_gib: -.inf}"}, "memory.soft_gib: must be a finite number"),
        ({"budget": "{margin_s: .inf}"}, "budget.margin_s: must be a finite number"),
        ({"smoke": "{timeout_s: .nan}"}, "smoke.timeout_s: must be a finite number"),
        ({"train": "{script: t.py, nproc_per_node: 100000000000000000000000}"}, "train.nproc_per_node: must be <= 1024"),
        ({"train": "{script: t.py, nproc_per_node: 2000}"}, "train.nproc_per_node: must be <= 1024, got 2000"),
        ({"train": "{script: t.py, nnodes: 1000000}"}, "train.nnodes: must be <= 65536"),
        ({"slurm": "{gpus_per_node: 5000}"}, "slurm.gpus_per_node: must be <= 1024"),
        ({"slurm": "{max_requeues: 100000000000000000000000}"}, "slurm.max_requeues: must be within"),
        (
            {"train": "{script: t.py, nproc_per_node: 2}", "fallbacks": "[{name: f, run_dir: f, nproc_per_node: 0}]"},
            "fallbacks[0].nproc_per_node: must be >= 1, got 0",
        ),
        (
            {"fallbacks": "[{name: f, run_dir: f, nproc_per_node: 100000000000000000000000}]"},
            "fallbacks[0].nproc_per_node: must be <= 1024",
        ),
    ],
)  # fmt: skip
def test_plan_numbers_are_finite_and_counts_within_a_node(
    sections: dict[str, str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(_plan(**sections))
    _refused(capsys, ["sbatch", str(plan), "--output", str(tmp_path / "x.sbatch")], "p.yaml", field)
    _nothing_written(tmp_path, "p.yaml")


def test_launch_refuses_a_non_finite_memory_limit_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(BASE + "memory: {soft_fraction: .nan}\n")
    _refused(capsys, ["launch", str(plan), "--devices", "1"], "memory.soft_fraction: must be a finite number")
    _nothing_written(tmp_path, "p.yaml")


def test_launch_refuses_memory_limits_that_cannot_hold_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(BASE + "memory: {soft_gib: 8, hard_gib: 4}\n")
    _refused(capsys, ["launch", str(plan), "--devices", "1"], "memory limits must satisfy 0 < soft <= hard")
    _nothing_written(tmp_path, "p.yaml")


@pytest.mark.parametrize("kind", ["foreign", "file"])
def test_a_run_dir_that_holds_something_else_is_refused_before_anything_is_written(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    if kind == "foreign":
        run.mkdir()
        (run / "passwd").write_text("root:x:0:0\n")
        words = ("run_dir", str(run), "is not empty (['passwd']) and holds no torchrelay run")
    else:
        run.write_text("a file\n")
        words = ("run_dir", str(run), "is not a directory")
    plan = tmp_path / "p.yaml"
    plan.write_text(BASE)
    _refused(capsys, ["sbatch", str(plan)], *words)
    _refused(capsys, ["launch", str(plan), "--devices", "1"], *words)
    _nothing_written(tmp_path, "p.yaml", "run")  # no run.sbatch, .run.launch.lock or .run.attempts beside it
    # what may come before a run is taken: nothing, an empty directory, a controller's attempts
    if kind == "file":
        run.unlink()
        assert main(["sbatch", str(plan)]) == 0, capsys.readouterr().err
        run.mkdir()
    else:
        (run / "passwd").unlink()
    assert main(["sbatch", str(plan)]) == 0, capsys.readouterr().err
    (run / "attempts").mkdir()
    assert main(["sbatch", str(plan)]) == 0, capsys.readouterr().err
    assert (tmp_path / "run.sbatch").is_file() and load_plan(plan).run_dir == str(run)
