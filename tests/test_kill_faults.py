"""A few SIGKILLs of the whole job (launcher, both ranks, loader workers), as benchmarks/bench_kill.py does hundreds
with the same tests/kill_campaign.py: inside saves, while the run is being created, between updates. Each next
launch resumes from the newest complete checkpoint, refuses nothing, leaves no temporary behind, and the run ends
bit for bit with its ledger proved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kill_campaign import Campaign
from torchrelay import RelayConfig, Run
from torchrelay.errors import ConfigError


@pytest.mark.launch
def test_whole_job_sigkilled_inside_saves_resumes_exactly(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    camp = Campaign(
        tmp_path,
        example["code"],
        example["config"],
        sets={"save_every": 1, "num_workers": 1},
        # (where, n-th event of the launch, delay after it): creating the run, the first and third save's
        # first moments, the update after a commit
        plans=[("create", 1, 0.0), ("save", 1, 0.0), ("save", 3, 0.002), ("update", 2, 0.0)],
        baseline=baseline,  # the session's: saving every update and a loader worker change no bit
    )
    camp.run(kills=4)

    kills, ends = camp.kills, camp.ends
    assert not [e.problem for e in ends if e.problem], ends  # a refused or failed launch abandons its run
    assert len(kills) == 4 and len(ends) == 1, (kills, ends)
    assert sum(k.inside_save for k in kills) >= 2, kills
    for k in kills:
        assert k.next_outcome == "resumed" and not k.refusal, k
        assert k.resumed_from == k.committed and not k.corrupt_resume, k
        assert not k.leftovers and not k.lock_held_after, k
    assert any(k.left for k in kills), "no kill left a temporary: the cleanup was not exercised"
    end = ends[0]
    assert end.finished and end.kills == 4, end
    assert end.bit_exact and end.tensors_equal > 10 and end.logs_equal, end
    assert end.ledger_ok, end  # every sample exactly once, as many exposures as the uninterrupted run
    assert not end.temporaries_at_end, end


def _config(example: dict[str, Path]) -> RelayConfig:
    return RelayConfig.from_dict(yaml.safe_load(example["config"].read_text()))


# What `Run.open` has written when a kill lands between two of its creation steps (the contract comes last).
CREATION_STEPS = [
    {"data/": None},
    {"data/": None, "train/": None, "data/manifest.jsonl": '{"id": "half'},
    {"data/": None, "train/": None, "data/manifest.jsonl": "", ".config.json.tmp-4242": "{"},
    {
        "data/": None,
        "train/": None,
        "data/manifest.jsonl": "",
        "config.json": "{}",
        "lineage.json": "{}",
        ".resume_contract.json.tmp-4242": "",
    },
]


@pytest.mark.parametrize("left", CREATION_STEPS, ids=lambda left: "+".join(left))
def test_a_creation_killed_before_its_contract_is_created_again(
    example: dict[str, Path], tmp_path: Path, left: dict[str, str | None]
) -> None:
    """A kill while the run was being created left no run; the same command creates it (was: refused)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rel, text in left.items():
        if text is None:
            (run_dir / rel).mkdir()
        else:
            (run_dir / rel).write_text(text)
    with Run.open(run_dir, _config(example), code_dir=example["code"]) as run:
        assert run.start_update == 0
    assert json.loads((run_dir / "lineage.json").read_text())["lineage"]
    assert (run_dir / "data" / "manifest.jsonl").read_bytes() == example["manifest"].read_bytes()
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("foreign", [{"notes.txt": "mine"}, {"data/": None, "config.json": "{}"}])
def test_a_directory_not_made_by_a_creation_is_still_refused(
    example: dict[str, Path], tmp_path: Path, foreign: dict[str, str | None]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rel, text in foreign.items():
        if text is None:
            (run_dir / rel).mkdir()
        else:
            (run_dir / rel).write_text(text)
    with pytest.raises(ConfigError, match="is not empty"):
        Run.open(run_dir, _config(example), code_dir=example["code"])
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == sorted(
        {rel.split("/")[0] for rel in foreign}
    )


def test_the_next_open_removes_half_written_files_of_a_killed_writer(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """A writer killed inside an atomic write or a log trim left a temporary; the next open removes it."""
    run_dir = tmp_path / "run"
    with Run.open(run_dir, _config(example), code_dir=example["code"]):
        pass
    debris = [
        ".history.jsonl.tmp-4242",
        ".config.json.tmp-4243",
        ".lineage.json.tmp-1",
        "train/metrics-rank0.jsonl.trim",
    ]
    for rel in debris:
        (run_dir / rel).write_text("{half")
    (run_dir / ".REQUEST_STOP.tmp-7").write_text("")  # another writer's (torchrelay stop): not ours to remove
    odd = run_dir / ".config.json.tmp-99"  # a folder of a temporary's name is no killed writer's: it stays
    odd.mkdir()
    (odd / "kept").write_text("mine")
    with Run.open(run_dir, None, code_dir=example["code"]):
        pass
    assert not [rel for rel in debris if (run_dir / rel).exists()]
    assert (run_dir / ".REQUEST_STOP.tmp-7").exists() and (odd / "kept").read_text() == "mine"


@pytest.mark.launch
def test_pack_prepare_validate_export_sigkilled_while_writing_then_run_again(
    example: dict[str, Path], baseline: Path, tmp_path: Path
) -> None:
    """Each verb that writes, SIGKILLed (with what it started) at random moments of its writing: the same command
    run again completes (or, for a pack that had finished its bundle, refuses in one line and that bundle
    verifies), its output passes its own check, and no temporary is left (issue 19 defect 7)."""
    from kill_verbs import VerbCampaign

    camp = VerbCampaign(tmp_path, baseline, example["code"], seed=19)
    camp.run(kills_per_verb=2)
    assert len(camp.kills) == 8
    assert not [k for k in camp.kills if k.problem], [k for k in camp.kills if k.problem]
    assert sum(k.killed_while_writing for k in camp.kills) >= 6, camp.kills  # the kills landed mid-write
    assert all(k.next_rc in (0, 2) for k in camp.kills), camp.kills
