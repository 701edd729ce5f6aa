"""The verbs' arguments: a number out of range, a job id that is no id, a destination inside its source, a
missing checkpoint and a directory that holds no run are refused with exit 2 and one message naming the argument
or the path, before anything is written; what is echoed from the input never carries a control character.
`cli.main(argv)` in-process, on copies of the 0.1.0 fixture's run and bundle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import REPO
from torchrelay.checkpoint.handed_off import HANDED_OFF
from torchrelay.cli import main
from torchrelay.config.relay import RelayConfig
from torchrelay.errors import ConfigError

FIXTURE = REPO / "tests" / "fixtures" / "legacy-v0.1.0"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", out, symlinks=True)
    return out


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusal: its usage, then `VERB: error: argument ...`
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["stop", "{run}", "--at-update", "-5"], ["argument --at-update: must be in [0, 999999999999999999], got -5"]),
        (["stop", "{run}", "--at-update", str(10**30)], ["argument --at-update: must be in [0, "]),
        (["verify", "{bundle}", "--jobs", "-3"], ["argument --jobs: must be in [1, 1024], got -3"]),
        (["verify", "{bundle}", "--jobs", "0"], ["argument --jobs: must be in [1, 1024], got 0"]),
        (["pack", "{run}", "{tmp}/b", "--checkpoint", "-1"], ["argument --checkpoint: must be in [0, "]),
        (["export", "{run}", "{tmp}/w", "--checkpoint", "-1"], ["argument --checkpoint: must be in [0, "]),
        (["launch", "{tmp}/p.yaml", "--devices", "-2"], ["argument --devices: must be in [0, 1024], got -2"]),
        (["launch", "{tmp}/p.yaml", "--budget", "nan"], ["argument --budget: must be a finite number of seconds"]),
        (["sbatch", "{tmp}/p.yaml", "--nodes", "0"], ["argument --nodes: must be in [1, 65536], got 0"]),
        (["sbatch", "{tmp}/p.yaml", "--gpus-per-node", "100000"], ["argument --gpus-per-node: must be in [0, 1024]"]),
        (["sbatch", "{tmp}/p.yaml", "--signal", "-5"], ["argument --signal: must be in [1, "]),
        (["validate", "{run}", "--cmd", "true", "--timeout", "-1"], ["argument --timeout: must be a finite number"]),
        (["validate", "{run}", "--cmd", "true", "--budget", "inf"], ["argument --budget: must be a finite number"]),
        (["audit", "--updates", "1", "--", "true"], ["argument --updates: must be in [2, 999999999999999999], got 1"]),
        (["certify", "{run}", "--updates", "0", "--", "true"], ["argument --updates: must be in [1, 999999999999999999], got 0"]),
        (["certify", "--checkpoint", "-1", "{run}", "--", "true"], ["argument --checkpoint: must be in [0, "]),
        (["audit", "--updates", str(10**30), "--", "true"], ["argument --updates: must be in [2, "]),
        (["audit", "--stops", "-2", "--", "true"], ["argument --stops: must be in [1, 999999999999999999], got -2"]),
        (["audit", "--stop-at=-3,2", "--", "true"], ["argument --stop-at: must be in [1, 999999999999999999], got -3"]),
        (["audit", "--stop-at", "3,x", "--", "true"], ["argument --stop-at: expected an integer, got 'x'"]),
        (["audit", "--seed", str(2**64), "--", "true"], ["argument --seed: must be in [-9223372036854775807, "]),
        (["audit", "--timeout", "nan", "--", "true"], ["argument --timeout: must be a finite number of seconds > 0"]),
        (["audit", "--timeout", "0", "--", "true"], ["argument --timeout: must be a finite number of seconds > 0"]),
        (["audit", "--atol", "inf", "--", "true"], ["argument --atol: must be a finite number >= 0, got 'inf'"]),
    ],
)  # fmt: skip
def test_a_number_out_of_range_is_refused_naming_the_argument(
    argv: list[str], words: list[str], run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = FIXTURE / "bundle"
    (tmp_path / "p.yaml").write_text(f"run_dir: {tmp_path}/planned\ntrain: {{script: t.py}}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    _refused(capsys, [a.format(run=run, bundle=bundle, tmp=tmp_path) for a in argv], *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (run / "REQUEST_STOP").exists()


def test_stop_refuses_a_job_id_that_is_no_id_and_never_echoes_its_control_characters(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys, ["stop", str(run), "--job", "x\x1b[31m"], "argument --job: 'x\\x1b[31m' is not a job id"
    )
    assert "\x1b" not in err
    assert not (run / "REQUEST_STOP").exists()  # read back, it would have stopped any job, not none
    assert main(["stop", str(run), "--job", "123_4", "--at-update", "12"]) == 0  # the run is at 8
    assert "wrote" in capsys.readouterr().out and '"job": "123_4"' in (run / "REQUEST_STOP").read_text()


def test_stop_names_a_request_that_is_a_directory(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "REQUEST_STOP").mkdir()
    err = _refused(
        capsys, ["stop", str(run)], f"{run / 'REQUEST_STOP'} is a directory, not a stop request", "hint"
    )
    assert ".tmp" not in err
    assert [p.name for p in run.iterdir() if "REQUEST_STOP" in p.name] == ["REQUEST_STOP"]


def test_pack_refuses_a_checkpoint_that_is_not_there_with_exit_2(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        capsys,
        ["pack", str(run), str(tmp_path / "b"), "--checkpoint", "99"],
        "checkpoint-99 does not exist (complete: 4, 8)",
        "hint: pass --checkpoint",
    )
    assert not (tmp_path / "b").exists()


def test_report_refuses_a_directory_that_holds_no_run_as_status_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "notarun"
    empty.mkdir()
    status = _refused(capsys, ["status", str(empty)], "holds no torchrelay run")
    report = _refused(capsys, ["report", str(empty)], "holds no torchrelay run")
    assert report.split(": error: ", 1)[1] == status.split(": error: ", 1)[1]
    assert list(empty.iterdir()) == []


def test_a_destination_inside_its_source_is_refused_before_anything_is_written(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(FIXTURE / "bundle", bundle, symlinks=True)
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*"))
    for dest in (bundle / "inner", bundle):
        _refused(
            capsys,
            [
                "prepare",
                str(bundle),
                "--run-dir",
                str(dest),
                "--set",
                f"data_root={FIXTURE / 'data' / 'root'}",
            ],
            f"the run directory {dest} ",
            f"the bundle {bundle}",
        )
    shutil.copytree(bundle, run / "b", symlinks=True)
    _refused(
        capsys, ["prepare", str(run / "b"), "--run-dir", str(run)], f"the bundle {run / 'b'} lies inside"
    )
    assert sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*")) == files
    assert main(["verify", str(bundle)]) == 0, capsys.readouterr().out

    _refused(
        capsys, ["pack", str(run), str(run / "inner")], f"the bundle {run / 'inner'} lies inside the run"
    )
    assert not (run / "inner").exists() and not (run / "checkpoint-8" / HANDED_OFF).exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".inner")]


def test_a_config_count_past_64_bits_is_refused(tmp_path: Path) -> None:
    base = {"seed": 1, "micro_batch": 1, "total_updates": 4, "manifest": "m.jsonl"}
    with pytest.raises(
        ConfigError, match=r"^config\.keep: must be within \+-9223372036854775807 \(64 bits\)"
    ):
        RelayConfig.from_dict({**base, "keep": 10**30})
    with pytest.raises(ConfigError, match=r"^config\.keep_updates\[0\]: must be within"):
        RelayConfig.from_dict({**base, "keep_updates": [10**30]})
