"""`torchrelay audit` under real torchrun: the good example is equal bit for bit; each broken one is caught."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import TORCHRUN, make_code_repo
from torchrelay.audit import (
    DATA_ORDER,
    NOT_RESTORED,
    RANK_STATE,
    RNG,
    UNREGISTERED,
    UNSEEDED,
    AuditError,
    AuditSpec,
    last_verdict,
    run_audit,
    verdict_for_run,
)
from torchrelay.audit.orchestrator import _check_vary
from torchrelay.cli import main
from torchrelay.paths.rundir import RunDir

BROKEN = {
    "broken/unregistered_generator.py": RNG,
    "broken/own_shuffle.py": DATA_ORDER,
    "broken/unregistered_scheduler.py": UNREGISTERED,
    "broken/unregistered_counter.py": UNREGISTERED,
    "broken/rank_divergent_state.py": RANK_STATE,
}


@pytest.fixture(scope="module")
def code(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repo with the good example and the broken ones next to it (they import its model and data)."""
    return make_code_repo(
        tmp_path_factory.mktemp("audit") / "code", ("train_lm.py", *BROKEN, "broken/forgotten_value.py")
    )


@pytest.fixture(autouse=True)
def verdict_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep verdicts out of the real ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key in ("TORCHRELAY_RUN_DIR", "TORCHRELAY_OVERRIDES", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "cache"


def launch_cmd(code: Path, script: str, config: Path) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / script),
        "--config",
        str(config),
    ]


@pytest.mark.launch
def test_good_example_is_equal_with_three_stops(code, example, tmp_path, capsys):
    work = tmp_path / "work"
    cmd = launch_cmd(code, "train_lm.py", example["config"])
    argv = ["audit", "--updates", "8", "--stops", "3", "--vary", "num_workers=0,2"]
    argv += ["--work-dir", str(work), "--json"]
    assert main([*argv, "--", *cmd]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["equal"] is True and verdict["causes"] == []
    # Stops from early to late, and the state compared at the first checkpoint after each resume.
    assert verdict["stops"] == [1, 4, 7] and verdict["vary"] == {"num_workers": [0, 2]}
    assert [(c["update"], c["after_stop"], c["differing"]) for c in verdict["checkpoints"]] == [
        (2, 1, 0),
        (5, 4, 0),
        (8, 7, 0),
    ]
    assert verdict["tensors_compared"] > 20 and verdict["tensors_differing"] == 0
    assert verdict["metrics_equal"] and verdict["ledger_equal"]

    # The interrupted run really was four launches, with num_workers cycling 0, 2, 0, 2.
    history = [json.loads(x) for x in (work / "interrupted" / "history.jsonl").read_text().splitlines()]
    assert [(s["first_update"], s["last_update"], s["ended"]) for s in history] == [
        (1, 1, "request"),
        (2, 4, "request"),
        (5, 7, "request"),
        (8, 8, "request"),
    ]
    assert any("num_workers" in (s.get("runtime_changes") or {}) for s in history[1:])

    # The verdict is kept for the script, in each audited run directory, and found for status.
    kept = last_verdict(code / "train_lm.py")
    assert kept is not None and kept["equal"] is True and kept["stale"] is False
    assert json.loads((work / "interrupted" / "AUDIT.json").read_text())["equal"] is True
    shown = verdict_for_run(work / "interrupted")
    assert shown is not None and shown["verdict"].startswith("equal (8 updates, 3 stops)")

    # Varying a contract field would only get the resume refused: the audit says so before launching again.
    with pytest.raises(AuditError, match="--vary seed: not a runtime field of this run"):
        _check_vary(RunDir(work / "interrupted"), {"seed": [1, 2]})


@pytest.mark.launch
@pytest.mark.parametrize("script", list(BROKEN))
def test_broken_example_fails_with_its_cause(code, example, tmp_path, script):
    # Two updates past the stop, not four: a scheduler left out is restored with the optimizer's lr, so it shows in
    # the logged lr at update 5 and in the tensors from update 6 (with 5 updates they were still equal).
    spec = AuditSpec(
        launch=launch_cmd(code, script, example["config"]), updates=6, stop_at=[4], work_dir=tmp_path / "work"
    )
    verdict = run_audit(spec)
    assert not verdict.equal
    assert verdict.cause == BROKEN[script], verdict.causes
    assert "uninterrupted-again" not in verdict.run_dirs  # the evidence sufficed: no second uninterrupted run
    # They all part at the first update after the resume, and the final tensors differ.
    assert verdict.metrics_first_update == 5
    assert not verdict.tensors_equal and verdict.top_tensors and verdict.top_tensors[0]["max_abs"] > 0
    if script.endswith("own_shuffle.py"):
        assert verdict.ledger_equal  # torchrelay's ledger is blind to the script's own loader ...
        assert (
            verdict.own_loaders == ["RandomSampler"] and verdict.own_batches_first_update == 5
        )  # ... the probe is not
    if script.endswith("unregistered_scheduler.py"):
        assert "lr" in verdict.metrics_keys
    # The probe's digests of the script's random streams at the resume tell the two hidden-state causes apart.
    if script.endswith("unregistered_generator.py"):
        assert len(verdict.causes) == 1 and "random stream(s) the script holds (torch.Generator)" in str(
            verdict.causes[0]
        )
    if script.endswith("unregistered_counter.py"):
        assert "lr" not in verdict.metrics_keys and "non-random state read there" in str(verdict.causes[0])
    # A statistic that differs by rank, saved as one value: named as such, with the tensor, not "not registered".
    if script.endswith("rank_divergent_state.py"):
        evidence = verdict.causes[0]["evidence"]
        assert "norm.mean differ between the ranks of the uninterrupted run at the stop" in evidence, evidence
        assert "starts update 5 with other values of them on rank(s) 0, 1" in evidence, evidence
    # A failed audit keeps its run directories for a look, and status finds the verdict for the script's code.
    kept = last_verdict(code / script)
    assert kept is not None and kept["equal"] is False
    assert (tmp_path / "work" / "interrupted" / "AUDIT.json").is_file()


@pytest.mark.launch
def test_a_number_a_stateful_forgets_to_restore_is_not_equal_by_its_key(code, example, tmp_path):
    # nanoGPT's best_val_loss in a registered stateful whose load_state_dict forgets it: no tensor and no logged
    # value differs, the restored number does.
    spec = AuditSpec(
        launch=launch_cmd(code, "broken/forgotten_value.py", example["config"]),
        updates=6,
        stop_at=[4],
        work_dir=tmp_path / "work",
    )
    verdict = run_audit(spec)
    assert not verdict.equal and verdict.metrics_equal and verdict.ledger_equal
    assert verdict.tensors_first_update == 5 and verdict.values_compared > 10
    # The loss differs by rank, so the number is kept per rank: each rank's is named, with both values.
    names = sorted(t["name"] for t in verdict.top_tensors)
    assert names == ["state/best@rank0.best_val_loss", "state/best@rank1.best_val_loss"], verdict.top_tensors
    assert all(t["note"].endswith(" vs 1000000000.0") for t in verdict.top_tensors)
    assert verdict.cause == NOT_RESTORED, verdict.causes
    assert "uninterrupted-again" not in verdict.run_dirs
    # the parameters never part: the per-update digests of all 6 updates agree
    assert verdict.digests_compared == 6 and verdict.digests_first_update is None


def test_audit_explains_a_launch_that_does_not_stop(tmp_path, capsys):
    # A command that never opens the run: the audit says which segment, what history says, and shows the log.
    cmd = [sys.executable, "-c", "print('no torchrelay here'); raise SystemExit(3)"]
    assert (
        main(["audit", "--updates", "4", "--stop-at", "2", "--work-dir", str(tmp_path / "w"), "--", *cmd])
        == 1
    )
    err = capsys.readouterr().err
    assert "uninterrupted run, segment 1: asked to stop after update 4, the launch exited 3" in err
    assert "ended None at update None" in err and "no torchrelay here" in err


def test_audit_refuses_a_used_work_dir(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "old").write_text("x")
    assert main(["audit", "--work-dir", str(tmp_path / "w"), "--", "true"]) == 2  # refused: bad input
    assert "the audit's work directory is not empty" in capsys.readouterr().err


# An unseeded stream differs between two launches from update 1: named as such from the probe's digests at the
# start of update 1, without a second run, and never "non-deterministic kernels" (issue 50).
UNSEEDED_VARIANTS = {
    # a generator of the script's own, seeded from the OS
    "torch.Generator": ("augment = torch.Generator()\n" + " " * 12 + "augment.seed()", None),
    # the global `random`, reseeded from the OS after Run.open, drawn from in every micro-step
    "random (global)": (
        "import random\n"
        + " " * 12
        + "random.seed()\n"
        + " " * 12
        + "augment = torch.Generator().manual_seed(1)",
        "torch.full(xs.shape, random.randrange(256))",
    ),
}


@pytest.mark.launch
@pytest.mark.parametrize("stream", list(UNSEEDED_VARIANTS))
def test_an_unseeded_stream_is_named_from_the_first_update(code, example, tmp_path, stream):
    source = (code / "broken" / "unregistered_generator.py").read_text()
    seeded = "augment = torch.Generator().manual_seed(cfg.seed + dist.get_rank())"
    drawn = "torch.randint(0, 256, xs.shape, generator=augment)"
    assert seeded in source and drawn in source
    setup, noise = UNSEEDED_VARIANTS[stream]
    (code / "broken" / "unseeded.py").write_text(source.replace(seeded, setup).replace(drawn, noise or drawn))
    spec = AuditSpec(
        launch=launch_cmd(code, "broken/unseeded.py", example["config"]),
        updates=4,
        stop_at=[2],
        work_dir=tmp_path / "work",
    )
    verdict = run_audit(spec)
    assert not verdict.equal and verdict.metrics_first_update == 1
    assert verdict.cause == UNSEEDED and len(verdict.causes) == 1, verdict.causes
    assert f"{stream} start update 1 in another state" in verdict.causes[0]["evidence"], verdict.causes
    assert "uninterrupted-again" not in verdict.run_dirs  # the probe's evidence sufficed
    assert verdict.digests_first_update == 1  # the parameters part after the first update


def test_probe_finds_the_scripts_own_random_streams_only() -> None:
    """Locals of the script's frames and one level inside them; not the global RNGs, not a library's streams."""
    import random
    import tempfile

    import numpy as np
    import torch

    from torchrelay.audit.probe import random_streams

    tempfile._get_candidate_names()  # the stdlib's own Random, seeded from the OS: not the script's
    baseline = random_streams()

    class Augment:
        def __init__(self) -> None:
            self.gen = torch.Generator().manual_seed(7)

    aug, rng, np_rng = Augment(), random.Random(3), np.random.default_rng(5)
    found = random_streams()
    kinds = sorted(k for k, _ in found if (k, _) not in baseline)
    assert kinds == ["numpy Generator", "random.Random", "torch.Generator"], found
    before = dict(found)
    torch.rand(3, generator=aug.gen)
    rng.random()
    np_rng.random()
    after = dict(random_streams())
    assert all(after[k] != before[k] for k in ("torch.Generator", "random.Random", "numpy Generator"))
    assert torch.default_generator is not None and len(random_streams()) == len(found)
