"""A refusal is one message and its exit code, on every path out of Run.open, and it is on record.

One torchrun launch of tests/dist_open.py opens a run broken in every way Run.open can fail (issue 9 defect 6,
issue 8 defect 5): a contract mismatch, a manifest that is not UTF-8, an OSError on rank 0 (history.jsonl is a
directory), a run held by another writer, a bug on rank 0, a failure on rank 1 only; then an uncaught refusal.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TORCHRUN, clean_env, segments
from torchrelay.cli import main

SCRIPT = Path(__file__).with_name("dist_open.py")


@pytest.fixture(scope="module")
def opened(
    example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, list[dict]]:
    base = tmp_path_factory.mktemp("refusals")
    out = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(SCRIPT), str(base)]
        + [str(example["config"])],
        capture_output=True,
        text=True,
        timeout=240,  # a rank left waiting would sit out the script's gloo timeout (60 s) per case
        env=clean_env(TORCHRELAY_LOCK_WAIT_S="0.3"),
    )
    seen = [json.loads((base / f"seen-rank{r}.json").read_text()) for r in (0, 1)]
    return base, out.stdout + out.stderr, seen


def _case(seen: list[dict], name: str) -> list[tuple[str, int | None, bool]]:
    return [(s[name]["type"], s[name]["code"], s[name]["reported"]) for s in seen]


@pytest.mark.launch
def test_every_rank_raises_the_refusal_and_none_waits(opened: tuple[Path, str, list[dict]]) -> None:
    base, output, seen = opened
    assert _case(seen, "mismatch") == [("ContractMismatch", 2, True)] * 2
    assert _case(seen, "manifest") == [("ConfigError", 2, True)] * 2
    assert "manifest.jsonl:1: the data manifest is not UTF-8 text" in seen[1]["manifest"]["message"]
    # an OSError on rank 0 (not a RelayError) used to leave rank 1 in the broadcast until it was killed
    assert _case(seen, "history") == [("PathError", 2, True)] * 2
    assert "history.jsonl: Is a directory" in seen[1]["history"]["message"]
    assert _case(seen, "busy") == [("RunBusy", 2, True)] * 2
    # a bug keeps its traceback on rank 0; rank 1 hears of it and exits 1
    assert _case(seen, "bug") == [("TypeError", None, False), ("RelayError", 1, True)]
    assert "failed on rank 0 with TypeError: injected bug" in seen[1]["bug"]["message"]
    # rank 1 alone failed: both raise the same refusal naming it, said once by rank 0 (util/collective.py)
    assert _case(seen, "local") == [("PathError", 2, True)] * 2
    assert seen[0]["local"]["message"].startswith("opening the run failed on rank 1: ")
    assert seen[0]["local"]["message"] == seen[1]["local"]["message"]
    assert all(s[c]["seconds"] < 20 for s in seen for c in s), seen


@pytest.mark.launch
def test_refusals_are_said_once_without_a_traceback(opened: tuple[Path, str, list[dict]]) -> None:
    base, output, seen = opened
    # torchrun prints a traceback of its own (ChildFailedError); no frame of the ranks may appear
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert all("site-packages" in f or "bin/torchrun" in f for f in frames), frames
    said = [line for line in output.splitlines() if line.startswith("torchrelay")]
    assert said == [
        f"torchrelay: resume refused: the training contract in {base / 'mismatch' / 'resume_contract.json'} "
        "differs in 1 field(s):",
        f"torchrelay: {base / 'manifest' / 'data' / 'manifest.jsonl'}:1: the data manifest is not UTF-8 text "
        "(invalid start byte at byte 40)",
        f"torchrelay: opening the run: {base / 'history' / 'history.jsonl'}: Is a directory",
        said[3],  # RunBusy names the holder
        # (the bug is a traceback for rank 0's hook: it was caught)
        f"torchrelay: opening the run failed on rank 1: {base / 'local' / 'data' / 'manifest.jsonl'}: "
        "Permission denied",
        f"torchrelay: resume refused: the training contract in {base / 'again' / 'resume_contract.json'} "
        "differs in 1 field(s):",
        f"torchrelay: resume refused: the training contract in {base / 'final' / 'resume_contract.json'} "
        "differs in 1 field(s):",
    ], said
    assert said[3].startswith(f"torchrelay: {base / 'busy'} is in use by a writer: pid ")
    # the uncaught refusal ended both ranks through the excepthook with exit 2
    assert output.count("exitcode  : 2") == 2, output[-3000:]


@pytest.mark.launch
def test_refused_launches_are_recorded_unless_another_writer_holds_the_run(
    opened: tuple[Path, str, list[dict]], capsys: pytest.CaptureFixture[str]
) -> None:
    base, output, seen = opened
    created = segments(base / "run")
    for name, why in (
        ("mismatch", "seed: 1234 -> 1235"),
        ("manifest", "not UTF-8 text"),
        ("local", "opening the run failed on rank 1:"),
        ("final", "seed: 1234 -> 1235"),
    ):
        history = segments(base / name)
        assert len(history) == len(created) + 1, name
        last = history[-1]
        assert (last["ended"], last["exit_code"]) == ("refused", 2), name
        assert why in last["notes"][-1], (name, last["notes"])
        assert last["last_update"] == last["first_update"] - 1  # no update ran
        assert last["parent"] == created[-1]["segment"]
        assert main(["status", "--last-exit", str(base / name)]) == 2
        assert "refused (exit 2)" in capsys.readouterr().out
    # the launch after a refusal continues the segment that ran, not the refused one
    again = segments(base / "again")
    assert [s["ended"] for s in again[len(created) :]] == ["refused", "error"]  # (it ran no update)
    assert again[-1]["parent"] == created[-1]["segment"]
    assert all(s["again"].get("opened") for s in seen)
    # RunBusy: the history belongs to the writer that holds the run; nothing is written into it
    assert segments(base / "busy") == created
    assert (base / "history" / "history.jsonl").is_dir()
    assert "could not record the refused launch in history.jsonl" in output
    shutil.rmtree(base)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_uncaught_configuration_error_is_one_message_on_rank_0_and_exit_2(rank: int) -> None:
    """Before Run.open (the script's own RelayConfig): the same error on every rank, said by rank 0 only; importing
    torchrelay alone installs nothing (no side effect on import)."""
    script = "import torchrelay as tr\ntr.RelayConfig.from_dict({'seed': 1, 'micro_batch': 4})\n"
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=clean_env(RANK=str(rank)),
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    said = "torchrelay: config.total_updates: required field missing (and 1 more: ['manifest'])"
    assert out.stderr.startswith(said) if rank == 0 else out.stderr == "", out.stderr
    # any other exception keeps its traceback and exit 1
    other = subprocess.run(
        [sys.executable, "-c", "import torchrelay\nraise ValueError('a bug')"],
        capture_output=True,
        text=True,
        env=clean_env(RANK=str(rank)),
        timeout=60,
    )
    assert other.returncode == 1 and "Traceback" in other.stderr and "ValueError: a bug" in other.stderr
    untouched = (
        "import sys\nhook = sys.excepthook\nimport torchrelay\nassert sys.excepthook is hook, 'changed'\n"
    )
    assert subprocess.run([sys.executable, "-c", untouched], env=clean_env(), timeout=60).returncode == 0
