"""benchmarks/issue22_goals.py: issue 22's verdicts from what bench_save.py and bench_load.py wrote. The verdicts
against hand-built figures at and around each threshold; then both benchmarks run for real on a tiny state (a
torchrun launch: full suite only) and the tables are checked against the JSON they wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "issue22_goals.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("issue22_goals", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


goals = _module()


def _launch(slow: list[list[float]], lost: float, persists: list[tuple[float, float]]) -> dict[str, Any]:
    """A launch as bench_save reports it: persists are (committed s, worst update during it)."""
    return {
        "updates": 100,
        "reserve_ready_update": 10,
        "over_1_1x_not_saving": slow,
        "max_not_saving": max([x for _, x in slow], default=1.0),
        "lost_vs_saves_x_copy": lost,
        "lost_vs_plain_x_copy": lost,
        "saves": [
            {"committed_s": c, "max_during_persist": w, "updates_during_persist": 5} for c, w in persists
        ],
    }


def _verdicts(lines: list[str]) -> list[str]:
    return [line.rsplit("|", 2)[-2].strip() for line in lines[2:]]


def test_goal_1_needs_no_slow_update_and_the_lost_time_within_the_limit() -> None:
    runs = [
        (
            "r",
            {
                "launches": {
                    "ok": _launch([], 1.1, [(1.0, 1.0)]),
                    "lost": _launch([], 1.1001, [(1.0, 1.0)]),
                    "slow": _launch([[12, 1.12]], 1.0, [(1.0, 1.0)]),
                },
                "launch": _launch([], 0.4, [(1.0, 1.0)]),
            },
        )
    ]
    lines = goals.goal1(runs)
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["r, ok", "r, lost", "r, slow", "r, main"]
    assert _verdicts(lines) == ["met", "**not met**", "**not met**", "met"]
    assert "12: 1.120" in lines[4]


def test_goal_2_judges_every_persist_against_the_floor_before() -> None:
    launch = _launch([], 1.0, [(10.0, 1.0), (11.1, 1.0), (10.5, 1.0)])
    ok = {"disk_write_streams_s": 10.0, "disk_write_streams_after_s": 5.0, "launch": launch}
    lines = goals.goal2([("r", ok)])
    assert "10.000: 1.00 / 0.50; 11.100: 0.90 / 0.45; 10.500: 0.95 / 0.48" in lines[2]
    assert _verdicts(lines) == ["met"]
    slower = dict(ok, launch=_launch([], 1.0, [(10.0, 1.0), (11.2, 1.0)]))
    assert _verdicts(goals.goal2([("r", slower)])) == ["**not met**"]
    # a persist that never committed is not a pass
    unfinished = dict(ok, launch=dict(launch, saves=[{"committed_s": 10.0}, {"committed_s": None}]))
    assert _verdicts(goals.goal2([("r", unfinished)])) == ["**not met**"]


def test_goal_3_is_the_worst_update_of_every_persist() -> None:
    at = {"launch": _launch([], 1.0, [(1.0, 1.02), (1.0, 1.1)])}
    over = {"launch": _launch([], 1.0, [(1.0, 1.02), (1.0, 1.1001)])}
    assert _verdicts(goals.goal3([("r", at)])) == ["met"]
    assert _verdicts(goals.goal3([("r", over)])) == ["**not met**"]


def test_goal_4_takes_each_round_s_mean_cold_read_and_wants_the_tensors_equal() -> None:
    load = {
        "cold_read_s": 99.0,
        "round_floors_s": [10.0, 8.0],
        "round_end_floors_s": [9.0, 8.0],
        "rows": {
            "default #1": {"s": 10.0, "equal": True},  # 9.5 / 10 = 0.95
            "default #2": {"s": 8.5, "equal": True},  # 8 / 8.5 = 0.94
            "other #2": {"s": 7.0, "equal": False},
        },
    }
    lines = goals.goal4([("r", load)])
    assert "| 0.95 |" in lines[2] and "10.000 / 9.000" in lines[2]
    assert _verdicts(lines) == ["met", "**not met**", "**not met**"]
    unbracketed = {"cold_read_s": 5.0, "rows": {"default": {"s": 5.0, "equal": True}}}
    assert _verdicts(goals.goal4([("r", unbracketed)])) == ["met"]


def test_a_file_that_is_not_a_bench_s_json_gets_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "save.json"
    bad.write_text("{not json")
    load_only = tmp_path / "load.json"
    load_only.write_text(json.dumps({"rows": {}, "cold_read_s": 1.0}))
    for args, words in (
        (["--save", str(bad)], f"--save {bad}: not a readable JSON file"),
        (["--save", str(tmp_path / "gone.json")], "gone.json: not a readable JSON file"),
        (["--save", str(load_only)], "give it as --load"),
        ([], "give at least one --save or --load file"),
    ):
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert out.returncode != 0
        assert words in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) <= 2  # argparse's usage line, then the one line


def _bench_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """bench_save.py under torchrun and bench_load.py (bracketed, 2 rounds) on a tiny CPU state."""
    base = tmp_path_factory.mktemp("bench")
    save, load = base / "save.json", base / "load.json"
    common = ["--device", "cpu", "--backend", "gloo", "--layers", "2", "--width", "64", "--dir", str(base)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    out = subprocess.run(
        [*torchrun, str(ROOT / "benchmarks" / "bench_save.py"), *common, "--batch", "4", "--saves", "2"]
        + ["--save-every", "5", "--quick", "--skip", "torch.save,dcp,dcp-async,torch_checkpointing"]
        + ["--json", str(save)],
        capture_output=True, text=True, env=_bench_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_load.py"), *common, "--no-dcp", "--no-tc"]
        + ["--repeat", "2", "--variants", "default", "--bracket", "--json", str(load)],
        capture_output=True, text=True, env=_bench_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return save, load


def _rows(text: str, goal: int) -> list[str]:
    """The rows of goal `goal`'s table in the script's output (its header and rule left out)."""
    section = text.split(f"**Goal {goal}:", 1)[1].split("**Goal", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")][2:]


def test_the_tables_of_a_real_bench_run_carry_its_figures(bench_json: tuple[Path, Path]) -> None:
    save_path, load_path = bench_json
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--save", str(save_path), "--load", str(load_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = out.stdout
    save, load = json.loads(save_path.read_text()), json.loads(load_path.read_text())
    assert f"cpu, torch {save['torch']}" in text.splitlines()[0]
    persists = save["launch"]["saves"]
    assert len(persists) == 2
    goal2 = _rows(text, 2)[0]
    for persist in persists:
        ratio = save["disk_write_streams_s"] / persist["committed_s"]
        assert f"{persist['committed_s']:.3f}: {ratio:.2f}" in goal2
    assert [row.split("|")[1].strip() for row in _rows(text, 1)] == ["save, main"]
    goal3 = _rows(text, 3)[0]
    assert ", ".join(f"{p['max_during_persist']:.3f}" for p in persists) in goal3
    rows = _rows(text, 4)
    assert len(rows) == len(load["rows"]) == 2
    for k, line in enumerate(rows):
        mean = (load["round_floors_s"][k] + load["round_end_floors_s"][k]) / 2
        ratio = mean / load["rows"][f"default #{k + 1}"]["s"]
        assert f"| {ratio:.2f} | True |" in line
        assert line.endswith("| met |") == (round(ratio, 12) >= goals.RESUME_FLOOR)
