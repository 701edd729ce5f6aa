"""A planned stop (3 budget, 4 request, 5 signal, 6 memory) reads as one, not as torchrun's failure report: the
filter of `torchrelay launch` and `python -m torchrelay.controller.torchrun`, on torchrun's real output (issue 51)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from helpers import REPO, clean_env, launch, run_tree, segments
from torchrelay.cli import main
from torchrelay.controller.torchrun import TorchrunOutput, ranks_exit

AGENT = (
    "E1207 05:43:15.486000 10219 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {c}) "
    "local_rank: 0 (pid: 10289) of binary: /venv/bin/python3\n"
)
STACK = """Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-07_05:43:15
  rank      : 1 (local_rank: 1)
  exitcode  : {c1} (pid: 10290)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_05:43:15
  rank      : 0 (local_rank: 0)
  exitcode  : {c} (pid: 10289)
  error_file: <N/A>
============================================================
"""


def _filter(text: str) -> tuple[str, TorchrunOutput]:
    out = io.StringIO()
    shown = TorchrunOutput(out)
    for line in text.splitlines(keepends=True):
        shown.write(line)
    shown.close()
    return out.getvalue(), shown


def test_a_planned_stop_s_report_is_one_line_and_a_crash_s_is_kept_whole() -> None:
    before = "[rank0] torchrelay: stopped at update 21: budget\n"
    shown, f = _filter(before + AGENT.format(c=3) + STACK.format(c=3, c1=3) + "after\n")
    assert shown == before + (
        "torchrun: 2 rank(s) ended with a planned stop, exit 3 (budget); torchrun's failure report is left out\n"
        "after\n"
    )
    assert f.codes == [3, 3] and ranks_exit(1, f.codes) == 3
    # a rank that crashed beside one that stopped: the report is the crash's, as torchrun wrote it
    crash = AGENT.format(c=1) + STACK.format(c=1, c1=4)
    shown, f = _filter(crash)
    assert shown == crash and f.codes == [1, 4] and ranks_exit(1, f.codes) == 1
    # a refusal (exit 2) is no planned stop either
    shown, f = _filter(STACK.format(c=2, c1=2))
    assert "train.py FAILED" in shown and ranks_exit(1, f.codes) == 2
    # a rank's own traceback is never held back, nor is one cut short by the end of the output
    rank = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad\nnext\n'
    )
    assert _filter(rank)[0] == rank
    cut = "\n".join(STACK.format(c=3, c1=3).splitlines()[:12]) + "\n"
    assert _filter(cut)[0] == cut
    assert ranks_exit(0, []) == 0 and ranks_exit(1, []) == 1 and ranks_exit(1, [-9]) == 137


@pytest.mark.launch
def test_plain_torchrun_users_get_the_ranks_exit_code_without_the_report(tmp_path: Path) -> None:
    script = tmp_path / "ends.py"
    script.write_text(
        # one write each: two ranks' prints share the pipe and interleaved word by word ('rankrank 1')
        "import os, sys\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\nsys.exit(int(sys.argv[1]))\n"
    )
    cmd = [sys.executable, "-m", "torchrelay.controller.torchrun", "--nproc_per_node=2", str(script)]
    out = run_tree([*cmd, "4"], timeout=120, env=clean_env(), cwd=tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
    assert "Traceback" not in out.stderr and "FAILED" not in out.stderr and "exitcode" not in out.stderr
    assert "2 rank(s) ended with a planned stop, exit 4 (request)" in out.stderr
    out = run_tree([*cmd, "1"], timeout=120, env=clean_env(), cwd=tmp_path)
    assert out.returncode == 1 and "ChildFailedError" in out.stderr and "ends.py FAILED" in out.stderr


@pytest.mark.launch
def test_a_refusal_in_the_loop_is_said_once_and_says_how_to_start_over(
    example: dict[str, Path], tmp_path: Path
) -> None:
    # the FSDP2 exact-mode refusal came from rank 0 and rank 1; following its hint gave a second refusal (issue 51)
    run = tmp_path / "run"
    out = launch(
        example["code"], run, config=example["config"], sets={"elastic": "exact", "params.parallel": "fsdp2"}
    )
    assert out.returncode != 0, out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if "the model is FSDP2" in line]
    assert len(said) == 1 and said[0].startswith("torchrelay: elastic: exact: the model is FSDP2"), out.stderr
    assert out.stderr.count("exitcode  : 2") == 2  # every rank ended with the refusal's code
    hint = f"no checkpoint was saved in {run}, which keeps this launch's settings: to start over with others, remove it"
    assert hint in out.stderr and (segments(run)[-1]["ended"], segments(run)[-1]["exit_code"]) == (
        "refused",
        2,
    )
    assert main(["status", "--last-exit", str(run)]) == 2
    shutil.rmtree(run)  # as the hint says: the setting it names changed, the run starts
    out = launch(example["code"], run, config=example["config"], sets={"params.parallel": "fsdp2"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def _fixture_run(root: Path) -> Path:
    run = root / "run"
    shutil.copytree(REPO / "tests" / "fixtures" / "legacy-v0.1.0" / "run", run, symlinks=True)
    return run


def _status(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        code = main(argv)
    return code, out.getvalue()


def test_status_shows_the_whole_refusal_and_readable_notes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --last-exit showed a contract refusal's first line only; the segments table showed
    # "runtime: {'num_workers': [0, 1]}" and notes cut mid-word at 80 characters (issue 51)
    run = _fixture_run(tmp_path)
    history = run / "history.jsonl"
    seg = json.loads(history.read_text().splitlines()[-1])
    refusal = (
        "resume refused: the training contract in /r/resume_contract.json differs in 2 field(s):\n"
        "  seed: 1234 -> 1235\n  micro_batch: 4 -> 8\n  hint: resume with the recorded values"
    )
    long_note = "loader workers: " + " ".join(f"word{i}" for i in range(60))
    ran = {**seg, "runtime_changes": {"num_workers": [0, 1]}, "notes": [long_note]}
    refused = {
        **seg,
        "segment": "s-refused",
        "ended": "refused",
        "exit_code": 2,
        "notes": ["earlier", refusal],
    }
    history.write_text(json.dumps(ran) + "\n" + json.dumps(refused) + "\n")
    code, out = _status(["status", "--last-exit", str(run)])
    assert code == 2 and out == f"segment s-refused: refused (exit 2): {refusal}\n", out
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: what is cut is the note, not the table's column
    code, out = _status(["status", str(run)])
    flat = " ".join(out.split())
    assert "runtime: num_workers 0 -> 1" in flat and "{'num_workers'" not in flat, out
    shown_words = [w for w in flat.split() if w.startswith("word")]
    assert shown_words and all(w[4:].isdigit() for w in shown_words), shown_words  # no word cut in two
    assert "…" in flat


def test_stop_at_an_update_already_past_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `stop --at-update 2` on a run at update 10 printed "...stop after update 2"; the run stopped at 21 (issue 51)
    run = _fixture_run(tmp_path)  # at update 8
    for past in (2, 8):
        assert main(["stop", str(run), "--at-update", str(past)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"torchrelay stop: error: stop --at-update {past}: the run is past it, at update 8 ("
        )
        assert "hint: pass an update after 8" in err and len(err.strip().splitlines()) == 2
        assert not (run / "REQUEST_STOP").exists()
    assert main(["stop", str(run), "--at-update", "9"]) == 0
    assert "stop after update 9" in capsys.readouterr().out


def test_a_run_refused_at_its_first_open_says_how_to_start_over(tmp_path: Path) -> None:
    # a global batch larger than the manifest is refused once the directory exists: following the hint (a smaller
    # micro_batch) was then a contract mismatch, a second refusal (issue 51)
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"id": f"s{i}"}) + "\n" for i in range(4)))
    script = tmp_path / "t.py"
    script.write_text(
        "import sys\nimport torchrelay as tr\n"
        "if __name__ == '__main__':\n"
        "    cfg = tr.RelayConfig(seed=1, micro_batch=int(sys.argv[1]), grad_accum=1, total_updates=2, "
        "manifest='m.jsonl')\n"
        "    with tr.Run.open('run', cfg) as run:\n"
        "        for step in run.steps(run.dataloader(list(range(4)), collate_fn=list)):\n"
        "            for _ in step.micro_batches():\n                pass\n"
        "    sys.exit(run.exit_code)\n"
    )

    def run(micro_batch: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), str(micro_batch)],
            capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path,
        )  # fmt: skip

    out = run(8)
    assert out.returncode == 2 and out.stderr.startswith("torchrelay: global batch 8 is larger"), out.stderr
    assert out.stderr.splitlines()[1] == (
        "  hint: lower micro_batch or grad_accum, or use more data; no checkpoint was saved in "
        f"{tmp_path / 'run'}, which keeps this launch's settings: to start over with others, remove it"
    )
    shutil.rmtree(tmp_path / "run")
    out = run(2)
    assert out.returncode == 0, out.stderr
