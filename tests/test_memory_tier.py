"""The memory tier (checkpoint/tiers.py): checkpoints every `memory_every` updates in node-local memory, with the
durable tier's proof. Real 2-rank torchrun jobs, SIGKILLed whole: a relaunch resumes from memory, refuses a memory
checkpoint with one flipped byte in one line and takes the durable tier, and ends bit for bit equal to the
uninterrupted run with its ledger proved; the save decision and the capacity check are pure and tested as such."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_same_final_state, assert_same_logs, clean_env, launch, launch_bg, metrics, segments
from kill_campaign import kill_job
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.policy import SaveContext, SaveDecision, SaveVerdict
from torchrelay.checkpoint.retention import EveryN, LatestN
from torchrelay.checkpoint.tiers import capacity, memory_root, missing_note
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir
from torchrelay.records.digests import read_digests
from torchrelay.records.summary import summarize
from torchrelay.util.proctree import Tree

U = 16  # the example's total_updates (save_every 8)


# ------------------------------------------------------------------------------------------- pure decisions
def test_the_save_decision_is_pure_and_durable_wins_over_memory() -> None:
    decide = SaveDecision(save_every=4, retention=EveryN(0), memory_every=1).decide
    assert decide(SaveContext(3, 10)) == SaveVerdict(memory=True)
    assert decide(SaveContext(4, 10)) == SaveVerdict(durable=True)  # never both: the durable one is newer
    assert not decide(SaveContext(10, 10))  # the end of the schedule saves as a stop does
    # step.save_now, agreed among the ranks, saves durably: at a memory update and at the schedule's end too
    assert decide(SaveContext(3, 10, saving=True)) == SaveVerdict(durable=True)
    assert decide(SaveContext(10, 10, saving=True)) == SaveVerdict(durable=True)
    assert not SaveDecision(save_every=4, retention=LatestN(2)).decide(SaveContext(3, 10))  # no memory tier
    every3 = SaveDecision(save_every=8, retention=EveryN(5), memory_every=3).decide
    assert [u for u in range(1, 16) if every3(SaveContext(u, 16)).memory] == [3, 6, 9, 12]
    assert [u for u in range(1, 16) if every3(SaveContext(u, 16)).durable] == [5, 8, 10, 15]


def test_capacity_keeps_reduces_or_refuses_in_one_line() -> None:
    gib = 1 << 30
    assert capacity(1 * gib, 2, shm_free=10 * gib, ram_free=10 * gib) == (2, None)
    keep, line = capacity(2 * gib, 4, shm_free=7 * gib, ram_free=100 * gib)
    assert keep == 2 and line is not None and "\n" not in line, line
    assert line.startswith("memory tier reduced to memory_keep 2: 4 + 1 slots of 2.00 GiB need 10.00 GiB"), (
        line
    )
    keep, line = capacity(3 * gib, 1, shm_free=100 * gib, ram_free=5 * gib)  # RAM, not /dev/shm, is short
    assert keep == 0 and line is not None and line.startswith("memory tier off for this segment"), line


def test_a_memory_tier_found_empty_is_noted_only_where_it_missed_an_update(tmp_path: Path) -> None:
    root = tmp_path / "shm" / "lineage" / "digest"
    line = missing_note(root, memory_every=1, durable_update=8, reached=13)  # wiped between the launches
    assert line is not None and "\n" not in line, line
    assert line.startswith(
        "no memory checkpoint past update 8 though the run reached update 13 (memory_every 1):"
    )
    assert f"{root} on " in line and line.endswith(" is gone (wiped since the last launch, another node, or the "
                                                   "tier off for lack of room); resuming from the durable tier")  # fmt: skip
    root.mkdir(parents=True)
    assert "holds none" in (missing_note(root, 1, 8, 13) or "")
    assert missing_note(root, 0, 8, 13) is None  # no memory tier
    assert (
        missing_note(root, 1, 8, 8) is None and missing_note(root, 1, 8, None) is None
    )  # nothing past durable
    # killed at 9: the save of 9 may have been cut (9 is logged once 8's committed): nothing was sure to be there
    assert missing_note(root, 1, 8, 9) is None and missing_note(root, 1, 8, 10) is not None
    assert missing_note(root, 4, 8, 15) is None and missing_note(root, 4, 8, 16) is not None  # 12 sure at 16


def test_the_memory_tiers_sizing_counts_every_optimizer_of_a_list() -> None:
    """run.track(optimizer=[muon, adamw]) (examples/train_lm.py's LingBot shape): the first memory save sizes
    the tier from the bytes of each optimizer's state, as the save itself writes them all (it raised
    AttributeError: 'list' object has no attribute 'state_dict')."""
    import torch

    from torchrelay.run.restore import Tracked

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opts = [torch.optim.AdamW(model[0].parameters()), torch.optim.SGD(model[1].parameters(), momentum=0.9)]
    model(torch.ones(1, 4)).sum().backward()
    for opt in opts:
        opt.step()
    floats = sum(p.numel() for p in model.parameters())  # 23 parameters' floats
    alone = Tracked()
    alone.register(model, None, {})
    assert alone.state_bytes() == 4 * floats
    both = Tracked()
    both.register(model, opts, {})  # type: ignore[arg-type]  # Run.track takes a list of optimizers
    adam = 2 * 4 * model[0].weight.numel() + 2 * 4 * model[0].bias.numel() + 2 * 4  # moments, each step
    sgd = 4 * (model[1].weight.numel() + model[1].bias.numel())  # momentum buffers
    assert both.state_bytes() == 4 * floats + adam + sgd


# -------------------------------------------------------------------------------------------- real kills
@pytest.fixture
def tier_runs(tmp_path: Path) -> Iterator[list[Path]]:
    """Run directories whose memory tier (in /dev/shm) is removed after the test, whatever it left."""
    runs: list[Path] = []
    yield runs
    for run in runs:
        lineage = (
            json.loads((run / "lineage.json").read_text())["lineage"]
            if (run / "lineage.json").exists()
            else None
        )
        if lineage:
            shutil.rmtree(memory_root(lineage, RunDir(run)).parent, ignore_errors=True)


def _memory_root(run: Path) -> Path:
    return memory_root(json.loads((run / "lineage.json").read_text())["lineage"], RunDir(run))


def _last_logged(run: Path) -> int:
    rows = metrics(run, 0)
    return int(rows[-1]["update"]) if rows else 0


def _kill_at(example: dict[str, Path], run: Path, update: int, **kw: Any) -> int:
    """Launch, SIGKILL the whole job (launcher, ranks, workers) once this launch's rank 0 logged `update`; returns
    the last update logged."""
    before = len(segments(run)) if (run / "history.jsonl").exists() else 0
    proc = launch_bg(example["code"], run, **kw)
    tree = Tree(proc.pid)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        tree.collect()
        opened = (run / "history.jsonl").exists() and len(segments(run)) > before
        if opened and (run / "train" / "metrics-rank0.jsonl").exists() and _last_logged(run) >= update:
            break
        time.sleep(0.01)
    assert proc.poll() is None, (
        f"the job ended before update {update}: {proc.stdout.read() if proc.stdout else ''}"
    )
    kill_job(tree, proc)  # type: ignore[arg-type]
    return _last_logged(run)


def _assert_same_digests(baseline: Path, run: Path) -> None:
    """Every update's parameter digest, on every rank, as the uninterrupted run's: those up to each resumed
    checkpoint were on disk before the kill (the saves hand the digest log to the OS as they do the others)."""
    want, got = read_digests(RunDir(baseline)), read_digests(RunDir(run))
    missing = {r: sorted(set(want[r]) - set(got.get(r, {}))) for r in want}
    assert not any(missing.values()), f"updates without a digest per rank: {missing}"
    assert got == want


def _finish(example: dict[str, Path], run: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = launch(example["code"], run, **kw)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.launch
def test_sigkill_resumes_from_memory_and_a_flipped_byte_falls_back_to_durable(
    example: dict[str, Path], baseline: Path, tmp_path: Path, tier_runs: list[Path]
) -> None:
    """(c) then (a): a memory checkpoint with one byte flipped is refused in one line naming the file and the
    durable checkpoint-8 is used; killed again, the next launch resumes from memory, losing at most K=1 update
    and the one during which the newest memory checkpoint was still being committed in the background;
    the run ends bit for bit as the uninterrupted one, its ledger proved, history naming each resume's tier."""
    run = tmp_path / "run"
    tier_runs.append(run)
    sets = {"memory_every": 1, "params.min_update_s": 0.2}  # paced (no bit changes): the kills land mid-run
    last = _kill_at(example, run, 10, config=example["config"], sets=sets)
    root = _memory_root(run)
    for folder in (
        root,
        root.parent,
        root.parent.parent,
    ):  # /dev/shm/torchrelay-<uid>/<lineage>/<run>: no one
        assert folder.stat().st_mode & 0o7777 == 0o700, folder  # else reaches a file in it, whatever its mode
    held = sorted(root.glob("checkpoint-*"))
    assert len(held) == 1 and (held[0] / "COMPLETE.json").exists(), held  # memory_keep 1
    saved = int(held[0].name.split("-")[1])
    assert last - 2 <= saved <= last and saved > 8, (saved, last)  # K=1, plus the one persisting
    doc = json.loads((held[0] / "COMPLETE.json").read_text())
    assert doc["tier"] == "memory" and doc["world_size"] == 2 and doc["run_dir"] == str(run.resolve())
    held_state = summarize(run)["memory_tier"]
    assert [c["update"] for c in held_state["checkpoints"]] == [saved], held_state  # status shows the tier
    victim = max((held[0] / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    last = _kill_at(example, run, min(U - 2, last + 2), sets=sets)
    seg = segments(run)[1]
    assert seg["resumed_from"] == 8 and seg["resumed_tier"] == "durable", seg
    refusal = [n for n in seg["notes"] if n.startswith("memory checkpoint-")]
    assert refusal == [
        f"memory {held[0].name} refused: {victim} does not match its SHA-256 in COMPLETE.json"
    ], seg
    for ckpt in root.glob(
        "checkpoint-*"
    ):  # the refused one was deleted at open: what the tier holds verifies
        validate_complete(ckpt)

    # memory_keep is a runtime field: a count the node cannot hold is reduced at the first memory save, in one line
    out = _finish(example, run, sets={"memory_keep": 10**12, "params.min_update_s": 0})
    reduced = [x for x in (out.stdout + out.stderr).splitlines() if "memory tier reduced to memory_keep" in x]
    assert len(reduced) == 1 and "GiB free in /dev/shm" in reduced[0], out.stdout[-2000:]
    seg = segments(run)[2]
    assert seg["resumed_tier"] == "memory" and last - 2 <= seg["resumed_from"] <= last, (seg, last)
    assert "resuming from the memory tier" in out.stdout + out.stderr
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    _assert_same_digests(baseline, run)
    assert prove(run).ok
    assert not root.exists()  # a finished run's memory tier is given back


@pytest.mark.launch
def test_random_kills_lose_at_most_k_updates_and_end_bit_exact(
    example: dict[str, Path], baseline: Path, tmp_path: Path, tier_runs: list[Path]
) -> None:
    """(e) Kills at random updates of a run saving to memory every update: every relaunch resumes (none refused,
    none from an unusable state), losing at most K=1 update plus the one whose checkpoint was still being committed
    in the background, and the end is bit-exact."""
    run = tmp_path / "run"
    tier_runs.append(run)
    rng = random.Random(52)
    sets = {"memory_every": 1, "params.min_update_s": 0.2}
    last = 0
    lost: list[int] = []
    for i in range(5):
        target = min(U - 1, last + rng.randint(1, 3))
        if target <= last:
            break
        killed_at = _kill_at(example, run, target, config=example["config"] if i == 0 else None, sets=sets)
        if i:
            seg = segments(run)[-1]
            assert seg["resumed_tier"] in ("memory", "durable") and seg["resumed_from"] >= last - 1, (
                seg,
                last,
            )
            lost.append(last - seg["resumed_from"])
        last = killed_at
    _finish(example, run, sets={"params.min_update_s": 0})
    seg = segments(run)[-1]
    assert seg["resumed_from"] >= last - 2, (seg, last)
    lost.append(last - seg["resumed_from"])
    assert lost and max(lost) <= 2, lost
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    _assert_same_digests(baseline, run)
    assert prove(run).ok


@pytest.mark.launch
def test_a_memory_folder_another_user_took_over_is_refused_and_the_run_ends_on_the_durable_tier(
    example: dict[str, Path], baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed mid-run with its memory tier; then its lineage's folder belongs to another user and everyone may write
    in it (a checkpoint could have been planted there): the relaunch reads nothing in it (one line: refused) and
    runs its segment on the durable tier (one line: off), both in its history; nothing in that folder is deleted,
    and the run ends bit for bit as the uninterrupted one. Before: the relaunch resumed from that folder."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the folder is handed to another user (chown)")
    shm = tmp_path / "shm"  # TORCHRELAY_MEMORY_ROOT: the user's choice; the folders made under it are checked
    shm.mkdir()
    env = {"TORCHRELAY_MEMORY_ROOT": str(shm)}
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(shm))
    run = tmp_path / "run"
    _kill_at(example, run, 10, config=example["config"], sets={"memory_every": 1, "params.min_update_s": 0.2},
             env=env)  # fmt: skip
    root = _memory_root(run)
    held = sorted(root.glob("checkpoint-*"))
    assert held and all(int(c.name.split("-")[1]) > 8 for c in held), held
    taken = root.parent  # the lineage's folder
    os.chown(taken, 65534, 65534)
    os.chmod(taken, 0o777)

    out = _finish(example, run, sets={"params.min_update_s": 0}, env=env)
    seg = segments(run)[1]
    assert seg["resumed_tier"] == "durable" and seg["resumed_from"] == 8, seg
    refused = [n for n in seg["notes"] if n.startswith("memory tier refused: ")]
    off = [n for n in seg["notes"] if n.startswith("memory tier off for this segment: ")]
    assert len(refused) == 1 and len(off) == 1, seg["notes"]
    for line in refused + off:
        assert "\n" not in line and f"{taken} on " in line and "belongs to uid 65534" in line, line
        assert "TORCHRELAY_MEMORY_ROOT" in line, line
    said = (out.stdout + out.stderr).count("memory tier off for this segment: ")
    assert said == 1, out.stdout[-3000:]
    assert all(c.is_dir() for c in held)  # another user's folder: nothing in it deleted
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    _assert_same_digests(baseline, run)
    assert prove(run).ok


@pytest.mark.full  # a fresh interpreter importing deepspeed and building its engine: 10-20 s
@pytest.mark.parametrize("stage", [2, 3])
def test_the_memory_tiers_sizing_counts_a_deepspeed_engines_optimizer(stage: int) -> None:
    """A DeepSpeed engine is tracked as the model (its optimizer is the engine's own): the sizing counted the
    model's tensors only, a quarter of what the engine's save writes under ZeRO-2 (the fp32 partition and both
    moments), so the capacity check passed a tier that did not fit. Now within a few percent of the files."""
    pytest.importorskip("deepspeed")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("deepspeed_sizing.py")), str(stage)],
        capture_output=True, text=True, timeout=300, env={**clean_env(), "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.9 * sizes["written"] <= sizes["counted"] <= 1.5 * sizes["written"], sizes
