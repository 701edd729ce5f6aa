"""This user's memory tiers on this node (checkpoint/node_tiers.py, `status --memory`, `stop --forget-memory`), on
real folders: each judged live, stale or kept from its inventories, its run directory and the run's locks; stale
ones freed with their lineage's folder; a live one, or one in a folder not the user's alone, never touched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from torchrelay.checkpoint import node_tiers
from torchrelay.checkpoint.inventory import inventory_entry, write_inventory
from torchrelay.checkpoint.node_tiers import KEPT, LIVE, REFUSED, STALE, hold, release, scan
from torchrelay.checkpoint.replica import replica_dir
from torchrelay.checkpoint.tiers import memory_root
from torchrelay.cli import main
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import RunDir
from torchrelay.records.history import write_history

LINEAGE = "0123456789ab"


@pytest.fixture
def mem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "mem"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(root))
    return root


def _run(path: Path, durable: list[int], finished: bool = False) -> RunDir:
    run = RunDir(path)
    path.mkdir(parents=True)
    run.contract_path.write_text("{}")
    for update in durable:
        _ckpt(path, update, run)
    if finished:
        write_history(run, [{"segment": "a", "ended": "finished"}])
    return run


def _ckpt(folder: Path, update: int, run: RunDir, size: int = 1000) -> Path:
    ckpt = folder / f"checkpoint-{update}"
    ckpt.mkdir(parents=True, mode=0o700)
    data = bytes(size)
    (ckpt / "state.bin").write_bytes(data)
    entry = inventory_entry("state.bin", hashlib.sha256(data).hexdigest(), size)
    write_inventory(ckpt, [entry], update=update, tier="memory", lineage=LINEAGE, run_dir=str(run.path))
    return ckpt


def _tier(run: RunDir, updates: list[int], replica: list[int] | None = None) -> Path:
    root = memory_root(LINEAGE, run)
    root.mkdir(parents=True, mode=0o700, exist_ok=True)
    for update in updates:
        _ckpt(root, update, run)
    for update in replica or []:
        _ckpt(replica_dir(root, 1), update, run)
    return root


def test_each_tier_is_judged_from_its_run_and_what_it_holds(tmp_path: Path, mem: Path) -> None:
    killed = _run(tmp_path / "killed", [8])  # memory newer than durable: a relaunch here resumes from it
    _tier(killed, [11], replica=[11])
    stopped = _run(tmp_path / "stopped", [8, 12])
    _tier(stopped, [11])
    finished = _run(tmp_path / "finished", [8], finished=True)
    _tier(finished, [15])
    gone = _run(tmp_path / "gone", [8])
    _tier(gone, [11])
    (gone.path / "contract.json").unlink() if (gone.path / "contract.json").exists() else None
    gone.contract_path.unlink()
    empty = _run(tmp_path / "empty", [])
    (memory_root(LINEAGE, empty) / ".tmp-checkpoint-3").mkdir(parents=True)  # a first save cut by a kill

    tiers = {Path(t.root).name: t for t in scan()}
    by = {name: tiers[memory_root(LINEAGE, r).name] for name, r in
          [("killed", killed), ("stopped", stopped), ("finished", finished), ("gone", gone), ("empty", empty)]}  # fmt: skip
    assert {k: t.verdict for k, t in by.items()} == {
        "killed": KEPT, "stopped": STALE, "finished": STALE, "gone": STALE, "empty": STALE,
    }, {k: t.why for k, t in by.items()}  # fmt: skip
    k = by["killed"]
    assert (k.run_dir, k.lineage, k.updates, k.replicas, k.durable_update) == (
        str(killed.path), LINEAGE, [11], {"1": [11]}, 8,
    )  # fmt: skip
    assert k.bytes >= 2000 and 0 <= k.age_s < 600, k
    assert by["stopped"].why == "the durable checkpoint-12 is at least as new as every update held"
    assert by["finished"].why == "its run finished" and by["finished"].finished
    assert by["gone"].why == "its run directory is gone or holds no run" and not by["gone"].run_exists
    assert by["empty"].why == "it holds no complete memory checkpoint"


def test_a_tier_in_use_on_this_node_or_whose_run_is_locked_is_live_and_never_freed(
    tmp_path: Path, mem: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held_run = _run(tmp_path / "held", [8], finished=True)
    held = _tier(held_run, [8])
    locked_run = _run(tmp_path / "locked", [8], finished=True)
    locked = _tier(locked_run, [8])
    fd = hold(held)  # what every rank of a segment takes on its node's tier
    lock = RunLock(locked_run.path, "train").acquire()
    try:
        verdicts = {Path(t.root): (t.verdict, t.why) for t in scan()}
        assert verdicts[held][0] == LIVE and "uses it" in verdicts[held][1], verdicts
        assert verdicts[locked][0] == LIVE and "train lock is held by pid" in verdicts[locked][1], verdicts
        assert main(["stop", "--forget-memory", "--stale"]) == 0
        assert held.is_dir() and locked.is_dir()
        assert main(["stop", str(held_run.path), "--forget-memory"]) == 2  # RunBusy: one line, exit 2
        assert held.is_dir()
        err = capsys.readouterr().err
        assert "is in use by a writer" in err and "Traceback" not in err, err
    finally:
        release(fd)
        lock.release()
    assert main(["stop", "--forget-memory", "--stale"]) == 0
    assert not held.exists() and not locked.exists() and not (mem / LINEAGE).exists()


def test_stale_tiers_are_freed_with_their_lineage_folder_and_a_kept_one_only_by_name(
    tmp_path: Path, mem: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = _run(tmp_path / "killed", [8])
    kept = _tier(killed, [11])
    finished = _run(tmp_path / "finished", [8], finished=True)
    stale = _tier(finished, [15], replica=[15])
    assert main(["status", "--memory", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {Path(t["root"]).name: t["verdict"] for t in doc["tiers"]} == {kept.name: KEPT, stale.name: STALE}
    assert main(["stop", "--forget-memory", "--stale"]) == 0
    out = capsys.readouterr().out
    assert not stale.exists() and kept.is_dir(), out
    assert "1 tier(s) left" in out, out
    assert main(["status", "--memory"]) == 0 and str(killed.path) in capsys.readouterr().out
    assert main(["stop", str(killed.path), "--forget-memory"]) == 0
    assert not kept.exists() and not (mem / LINEAGE).exists() and mem.is_dir()
    assert main(["stop", str(killed.path), "--forget-memory"]) == 0
    assert "nothing of" in capsys.readouterr().out


def test_a_folder_not_the_users_alone_is_listed_refused_and_left(tmp_path: Path, mem: Path) -> None:
    finished = _run(tmp_path / "finished", [8], finished=True)
    root = _tier(finished, [8])
    root.parent.chmod(0o777)  # the lineage's folder: others could have put anything in it
    (tier,) = scan()
    assert tier.verdict == REFUSED and "writable by others" in tier.why, tier
    assert main(["stop", "--forget-memory", "--stale"]) == 0
    assert main(["stop", str(finished.path), "--forget-memory"]) == 2
    assert root.is_dir()
    with pytest.raises(Exception, match="writable by others"):
        node_tiers.forget(tier)


@pytest.mark.parametrize(
    "argv",
    [
        ["stop", "--forget-memory"],
        ["stop", "RUN", "--forget-memory", "--stale"],
        ["stop", "--stale"],
        ["stop", "RUN", "--forget-memory", "--at-update", "3"],
        ["stop"],
        ["status"],
        ["status", "--memory", "--last-exit"],
    ],
)
def test_bad_memory_flags_are_one_line_and_exit_2(
    argv: list[str], mem: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err and len(err.splitlines()) <= 2, err


def test_a_controller_ending_frees_its_runs_stale_tier_and_says_what_it_leaves(
    tmp_path: Path, mem: Path
) -> None:
    finished = _run(tmp_path / "finished", [8], finished=True)
    stale = _tier(finished, [8])
    crashed = _run(tmp_path / "crashed", [8])
    kept = _tier(crashed, [11])
    launch = RunLock(finished.path, "launch").acquire()  # the controller's own lock: not a user of the tier
    try:
        (freed,) = node_tiers.at_controller_end(finished.path)
        assert (
            not stale.exists() and freed.startswith("memory tier freed on ") and "its run finished" in freed
        )
    finally:
        launch.release()
    (left,) = node_tiers.at_controller_end(crashed.path)
    assert (
        kept.is_dir() and left.startswith("memory tier left on ") and "--forget-memory` frees it" in left
    ), left
    train = RunLock(
        crashed.path, "train"
    ).acquire()  # a training still holding the run: its tier is never freed
    (crashed.path / "history.jsonl").unlink(missing_ok=True)
    write_history(crashed, [{"segment": "a", "ended": "finished"}])
    try:
        assert node_tiers.at_controller_end(crashed.path) == [] and kept.is_dir()
    finally:
        train.release()
