"""The property everything rests on: stopped anywhere and continued, a run ends bit for bit where it would have."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    assert_same_final_state,
    assert_same_logs,
    launch,
    launch_bg,
    segments,
    sigterm,
    wait_for_update,
)
from torchrelay.checkpoint.dcp_io import read_metadata
from torchrelay.checkpoint.inventory import read_inventory
from torchrelay.checkpoint.reader import load_tensors
from torchrelay.cli import main
from torchrelay.ledger.exposure import prove
from torchrelay.policy.stop import write_request
from torchrelay.records.summary import summarize
from torchrelay.util.hashing import sha256_hex

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch

U = 16


def test_three_stops_request_signal_budget(example: dict[str, Path], baseline: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = example["code"]
    # 1. a request file, honoured after update 3
    run.mkdir()
    write_request(run, at_update=3)
    out = launch(code, run, config=example["config"])
    assert out.returncode != 0 and "exitcode  : 4" in out.stderr
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 3
    assert main(["status", str(run), "--last-exit"]) == 4  # what torchrun's exit 1 stood for
    # 2. SIGTERM to torchrun once update 6 is logged; torchrun signals each rank's process group, so the 8 loader
    # workers of each rank get it too, and must not die of it (the rank stops cleanly and ends them).
    # agree at every boundary; paced so the signal surely lands before the end (a runtime param: no bit changes)
    sets = {"params.min_update_s": 0.2, "num_workers": 8}
    proc = launch_bg(code, run, sets=sets, env={"TORCHRELAY_CHECK_EVERY": "1"})
    wait_for_update(run, 6, proc)
    sigterm(proc)
    proc.wait(timeout=120)
    seg = segments(run)[-1]
    assert seg["ended"] == "signal", proc.stdout.read() if proc.stdout else ""
    assert 6 <= seg["last_update"] < U and seg["runtime_changes"]["num_workers"] == [0, 8]
    # 3. a time budget: stops while a checkpoint still fits (paced updates: the rest can never fit in 0.9 s)
    budget = {"TORCHRELAY_BUDGET_S": "0.9", "TORCHRELAY_MARGIN_S": "0.6"}
    out = launch(code, run, sets={"params.min_update_s": 0.2}, env=budget)
    seg = segments(run)[-1]
    assert seg["ended"] == "budget", out.stdout + out.stderr
    assert seg["last_update"] < U and "exitcode  : 3" in out.stderr
    assert main(["status", str(run), "--last-exit"]) == 3
    # 4. to the end
    out = launch(code, run, sets={"params.min_update_s": 0})
    assert out.returncode == 0, out.stdout + out.stderr
    assert [s["ended"] for s in segments(run)] == ["request", "signal", "budget", "finished"]
    assert assert_same_final_state(baseline, run, U) > 10
    assert_same_logs(baseline, run)
    report = prove(run)
    assert report.ok and report.exposures == U * 16 and report.distinct == U * 16
    # each segment continues exactly where the one before it stopped (clean stops save at the stop)
    segs = segments(run)
    assert [s["resumed_from"] for s in segs[1:]] == [s["last_update"] for s in segs[:-1]]
    assert [s["first_update"] for s in segs[1:]] == [s["last_update"] + 1 for s in segs[:-1]]


@pytest.fixture(scope="module")
def stopped_at_0_and_5(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run, three launches that two tests read: a stop agreed before the first update, a stop after update 5,
    then to the end with 2 loader workers (one launch fewer than a run for each)."""
    run = tmp_path_factory.mktemp("stops-0-5") / "run"
    run.mkdir()
    write_request(run)  # no update named: honoured at the first boundary
    first = launch(example["code"], run, config=example["config"])
    after_first = {"segment": segments(run)[-1], "checkpoints": list(run.glob("checkpoint-*"))}
    write_request(run, at_update=5)
    launch(example["code"], run)
    out = launch(example["code"], run, sets={"num_workers": 2})
    assert out.returncode == 0, out.stdout + out.stderr
    return {"run": run, "first": first, "after_first": after_first}


def test_num_workers_change_between_segments(stopped_at_0_and_5: dict[str, Any], baseline: Path) -> None:
    run = stopped_at_0_and_5["run"]
    stopped, seg = segments(run)[-2:]
    assert (stopped["ended"], stopped["last_update"]) == ("request", 5)
    assert seg["runtime_changes"] == {"num_workers": [0, 2]}
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)


def test_fsdp2_stop_and_continue(example: dict[str, Path], tmp_path: Path) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    sets = {"params.parallel": "fsdp2"}
    out = launch(example["code"], straight, config=example["config"], sets=sets)
    assert out.returncode == 0, out.stdout + out.stderr
    stopped.mkdir()
    write_request(stopped, at_update=7)
    launch(example["code"], stopped, config=example["config"], sets=sets)
    assert segments(stopped)[-1]["last_update"] == 7
    out = launch(example["code"], stopped)
    assert out.returncode == 0, out.stdout + out.stderr
    assert assert_same_final_state(straight, stopped, U) > 10
    assert_same_logs(straight, stopped)
    # export consolidates FSDP2's shards (tensors of several chunks) into what DCP's own loader reassembles
    assert main(["export", str(straight), str(tmp_path / "export")]) == 0
    md = read_metadata(straight / f"checkpoint-{U}" / "model")
    assert any(
        len(item.chunks) > 1 for key, item in md.state_dict_metadata.items() if key.startswith("model.")
    )
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    stored = load_tensors(straight / f"checkpoint-{U}")
    assert weights.keys() == {k.removeprefix("model.") for k in stored if k.startswith("model.")}
    assert all(torch.equal(t, stored[f"model.{k}"]) for k, t in weights.items())


@pytest.mark.parametrize("phases", [("shards:16:1", "inventory:16:0", "rename:16:0")])
def test_sigkill_during_saves(
    example: dict[str, Path], baseline: Path, tmp_path: Path, phases: tuple[str, ...]
) -> None:
    """A rank SIGKILLed while writing shards, before the inventory, before the rename: resumes from checkpoint-8."""
    run = tmp_path / "run"
    for i, phase in enumerate(phases):
        out = launch(
            example["code"],
            run,
            config=example["config"] if i == 0 else None,
            args=("--kill-at", phase),
        )
        assert out.returncode != 0 and "SIGKILL" in out.stderr, out.stderr[-2000:]
        assert not (run / "checkpoint-16").exists()
        assert (run / "checkpoint-8" / "COMPLETE.json").exists()
        # The killed run left no stale lock, and status tells a segment that ended without a word.
        state = summarize(run)
        assert not state["running"] and state["trained_by"] is None
        assert state["ended_unrecorded"] == (segments(run)[-1]["ended"] == "running")
        assert main(["status", str(run), "--last-exit"]) == 1
        if i:
            assert segments(run)[-1]["resumed_from"] == 8
    out = launch(example["code"], run)
    assert out.returncode == 0, out.stdout + out.stderr
    ended = [s["ended"] for s in segments(run)]
    # rank 1 killed: rank 0 sees its peer vanish mid-collective and records "error"; rank 0 killed: its
    # segment is closed as "crash" by the next open
    assert ended == ["error", "crash", "crash", "finished"], ended
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-")]
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    assert prove(run).ok


def test_sigkill_during_a_background_persist_resumes_from_the_previous_checkpoint(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed while checkpoint-8 is written in the background (the loop already past it): the next
    launch resumes from checkpoint-4, saves inline (async_save: false) and ends bit for bit — the same files,
    byte for byte, as the baseline's background saves wrote."""
    run = tmp_path / "run"
    out = launch(
        example["code"],
        run,
        config=example["config"],
        sets={"save_every": 4},
        args=("--kill-at", "shards:8:1"),
    )
    assert out.returncode != 0 and "SIGKILL" in out.stderr, out.stderr[-2000:]
    assert (run / "checkpoint-4" / "COMPLETE.json").exists() and not (run / "checkpoint-8").exists()
    out = launch(example["code"], run, sets={"async_save": False})
    assert out.returncode == 0, out.stdout + out.stderr
    assert segments(run)[-1]["resumed_from"] == 4
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-")]
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    assert prove(run).ok
    a, b = baseline / f"checkpoint-{U}", run / f"checkpoint-{U}"
    entries = {e["path"]: e["sha256"] for e in read_inventory(a)["files"]}
    assert entries.keys() == {e["path"] for e in read_inventory(b)["files"]}
    compared = [
        rel
        for rel in entries
        # .metadata and relay_state.json name the directory and the segment; the example never seeds python's
        # and numpy's generators, so each process starts its own (their torch generator is compared above)
        if rel not in ("model/.metadata", "relay_state.json") and not rel.startswith("rng/")
    ]
    assert len([p for p in compared if p.endswith(".distcp")]) >= 2, entries
    for rel in compared:
        assert sha256_hex(b / rel) == entries[rel], rel


def test_checkpoint_without_inventory_is_never_chosen(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    (run / "checkpoint-16" / "COMPLETE.json").unlink()
    out = launch(example["code"], run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert segments(run)[-1]["resumed_from"] == 8
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)


def test_stop_before_the_first_update_leaves_no_checkpoint_and_resumes_exactly(
    stopped_at_0_and_5: dict[str, Any], baseline: Path
) -> None:
    """A stop agreed at update 0 writes no checkpoint (an optimizer that never stepped has no true state)."""
    run = stopped_at_0_and_5["run"]
    assert stopped_at_0_and_5["first"].returncode != 0
    seg = stopped_at_0_and_5["after_first"]["segment"]
    assert (seg["ended"], seg["last_update"]) == ("request", 0)
    assert not stopped_at_0_and_5["after_first"]["checkpoints"]
    assert segments(run)[1]["resumed_from"] is None  # the next launch started from update 1
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
