"""A run moved to another number of ranks (issue 13): the same samples in the same updates, the parameters apart only
by the floating-point reduction order, a layout change only when asked for, another global batch never.

One relayed run per variant: 2 ranks stopped after update 4, continued on 1 rank (TORCHRELAY_RESHARD=1) and stopped
after update 8, finished on 4 ranks (DDP, float32) or on 2 (FSDP2, float64), against the same run uninterrupted on
2 ranks. Dropout is 0: dropout drawn from a rank's torch RNG is per rank and cannot follow a layout change (README).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from handoff_fixtures import STOP_AT, Packed
from handoff_fixtures import TOTAL as PACKED_TOTAL
from helpers import clean_env, launch, segments, torchrun_cmd, write_config
from torchrelay.audit.drift import (
    compare_ledgers,
    measure_drift,
    micro_batches_by_update,
    with_world_size,
)
from torchrelay.audit.runner import AuditError
from torchrelay.cli import main
from torchrelay.errors import EXIT_REFUSED, ContractMismatch
from torchrelay.ledger import prove
from torchrelay.resume import validate_resume
from torchrelay.rundir import RunDir
from torchrelay.stop import write_request

TOTAL = 12
STOPS = (4, 8)
VARIANTS = {
    "ddp-float32": ("ddp", "float32", (2, 1, 4)),
    "fsdp2-float64": ("fsdp2", "float64", (2, 1, 2)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def relayed(
    request: pytest.FixtureRequest, example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """float32 under DDP through `torchrelay audit --vary world_size=2,1,4` (its own verdict); float64 under FSDP2
    launched by hand; both leave the uninterrupted and the relayed run directory."""
    parallel, dtype, worlds = VARIANTS[request.param]
    base = tmp_path_factory.mktemp(request.param)
    config = write_config(
        base / "lm.yaml",
        example["manifest"],
        example["root"],
        total_updates=TOTAL,
        save_every=TOTAL,
        **{"params.dropout": 0.0, "params.parallel": parallel, "params.dtype": dtype},
    )
    if parallel == "ddp":
        work = base / "audit"
        argv = ["audit", "--updates", str(TOTAL), "--stop-at", ",".join(map(str, STOPS))]
        argv += ["--vary", "world_size=" + ",".join(map(str, worlds)), "--work-dir", str(work), "--"]
        argv += torchrun_cmd(example["code"], base / "unused", nproc=worlds[0], config=config)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in clean_env().items():
                mp.setenv(key, value)
            code = main(argv)
        assert code == 0, sorted(work.glob("logs/*"))
        return {
            "straight": work / "uninterrupted",
            "moved": work / "interrupted",
            "worlds": worlds,
            "dtype": dtype,
        }
    straight = base / "straight"
    out = launch(example["code"], straight, config=config)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    moved = base / "moved"
    moved.mkdir()
    for i, world in enumerate(worlds):
        if i < len(STOPS):
            write_request(moved, at_update=STOPS[i])
        env = {"TORCHRELAY_RESHARD": "1"} if i else {}
        out = launch(example["code"], moved, nproc=world, config=config, env=env)
        assert (moved / f"checkpoint-{([*STOPS, TOTAL])[i]}" / "COMPLETE.json").exists(), (
            out.stdout + out.stderr[-3000:]
        )
    return {"straight": straight, "moved": moved, "worlds": worlds, "dtype": dtype}


def test_a_moved_run_sees_the_same_samples_and_drifts_only_by_rounding(relayed: dict[str, Any]) -> None:
    straight, moved, worlds = relayed["straight"], relayed["moved"], relayed["worlds"]
    segs = segments(moved)
    assert [(s["world_size"], s["ended"]) for s in segs] == list(
        zip(worlds, ["request", "request", "finished"], strict=True)
    )
    assert "layout_change" not in segs[0]
    for seg, at, (old, new) in zip(segs[1:], STOPS, zip(worlds, worlds[1:], strict=False), strict=True):
        change = seg["layout_change"]
        assert (change["at_update"], change["asked_by"], change["global_batch"]) == (at, "reshard", 16)
        assert (change["from"]["world_size"], change["to"]["world_size"]) == (old, new)
        assert change["to"]["micro_batch"] == 4  # kept, so the micro-batches themselves are the same
        assert change["to"]["world_size"] * change["to"]["grad_accum"] == 4
        assert change["rng"].startswith("re-derived")

    ledger = compare_ledgers(straight, moved)
    drift = measure_drift(straight / f"checkpoint-{TOTAL}", moved / f"checkpoint-{TOTAL}", TOTAL - STOPS[0])
    print(
        f"\n[{relayed['dtype']}, ranks {worlds}] ledger: {len(ledger.differing)} of {ledger.compared} updates differ"
    )
    print(f"[{relayed['dtype']}, ranks {worlds}] {drift.line()}")
    assert ledger.compared == TOTAL and ledger.equal, ledger.detail
    assert len(micro_batches_by_update(moved)[TOTAL]) == 4  # 4 micro-batches of 4 samples, on any layout
    assert prove(moved).ok
    assert drift.dtype == relayed["dtype"]
    assert drift.within, drift.line()


def test_status_and_report_show_the_layout_change(
    relayed: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    moved = relayed["moved"]
    assert main(["status", str(moved)]) == 0
    out = capsys.readouterr().out
    assert f"layout change at update {STOPS[0]} (reshard): 2 rank(s)" in " ".join(out.split())
    assert main(["status", "--json", str(moved)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [s.get("layout_change") is not None for s in shown["segments"]] == [False, True, True]
    assert main(["report", str(moved), "--out", str(tmp_path / "report")]) == 0
    page = next((tmp_path / "report").glob("*.html")).read_text()
    assert f"layout change at update {STOPS[1]} (reshard)" in page


def test_a_layout_change_is_refused_unless_asked_and_another_global_batch_always(
    relayed: dict[str, Any], example: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(relayed["straight"], run)
    cfg = RunDir(run).load_config()
    # not asked for: the checkpoint's layout, field by field
    with pytest.raises(ContractMismatch) as unasked:
        validate_resume(run, cfg.replace(grad_accum=4), 1, example["code"])
    assert unasked.value.exit_code == EXIT_REFUSED
    assert "world_size: 2 -> 1" in unasked.value.message and "grad_accum: 2 -> 4" in unasked.value.message
    assert "accepted only when asked for" in unasked.value.message and "TORCHRELAY_RESHARD=1" in (
        unasked.value.hint or ""
    )
    # asked for, but the product is another global batch: refused naming it and the factor that changed
    with pytest.raises(ContractMismatch) as other:
        validate_resume(
            run, cfg.replace(grad_accum=1), 3, example["code"], reshard=True, explicit={"grad_accum"}
        )
    msg = other.value.message
    assert "global_batch: 16 -> 12" in msg, msg
    assert "micro_batch 4 x grad_accum 1 x world_size 3 = 12" in msg and "world_size 2 -> 3" in msg, msg
    assert "16 is not a multiple of world_size x micro_batch = 12" in (other.value.hint or "")
    # asked for, the same global batch: accepted, grad_accum derived
    check = validate_resume(run, cfg, 4, example["code"], reshard=True)
    assert check.layout_change is not None and check.config is not None
    assert (check.config.micro_batch, check.config.grad_accum) == (4, 1)


def test_prepare_moves_a_bundle_to_one_rank_with_the_same_samples(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 ranks cannot make a global batch of 16 from micro-batches of 4: refused, exit 2, nothing written
    refused = tmp_path / "three"
    assert (
        main(["prepare", str(packed.bundle), "--run-dir", str(refused), "--world-size", "3"]) == EXIT_REFUSED
    )
    out = capsys.readouterr().out
    assert "global_batch: 16 -> 24" in out and "micro_batch 4 x grad_accum 2 x world_size 3 = 24" in out, out
    assert not refused.exists()

    run = tmp_path / "one"
    assert (
        main(
            ["prepare", str(packed.bundle), "--run-dir", str(run), "--world-size", "1", "--micro-batch", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "layout change: 2 -> 1 rank(s), micro_batch 4 -> 2, grad_accum 2 -> 8" in out, out
    record = json.loads((run / "REBASE_RECORD.json").read_text())
    assert record["layout_change"]["to"] == {"world_size": 1, "micro_batch": 2, "grad_accum": 8}
    assert record["changes"]["micro_batch"] == [4, 2]
    code = next((run / "source").iterdir())
    out_launch = launch(code, run, nproc=1, config=packed.config)  # the script passes its original 4 x 2
    assert out_launch.returncode == 0, out_launch.stdout + out_launch.stderr[-3000:]
    seg = segments(run)[-1]
    assert (seg["resumed_from"], seg["ended"], seg["world_size"]) == (STOP_AT, "finished", 1)
    assert seg["layout_change"]["asked_by"] == "prepare"
    # the same samples in the same updates as the uninterrupted 2-rank run (micro-batches of 2 now, not 4)
    by_update = micro_batches_by_update(run)
    baseline = micro_batches_by_update(packed.baseline)
    assert by_update.keys() == baseline.keys() == set(range(1, PACKED_TOTAL + 1))
    assert all(
        sorted(i for g in by_update[u] for i in g) == sorted(i for g in baseline[u] for i in g)
        for u in by_update
    )
    assert all(len(by_update[u]) == 8 for u in range(STOP_AT + 1, PACKED_TOTAL + 1))
    assert prove(run).ok


def test_the_audit_varies_the_world_size_of_the_launch_command() -> None:
    assert with_world_size(["torchrun", "--nproc_per_node=2", "t.py"], 1) == [
        "torchrun",
        "--nproc_per_node=1",
        "t.py",
    ]
    assert with_world_size(["torchrun", "--nproc-per-node", "2", "t.py"], 4)[2] == "4"
    with pytest.raises(AuditError, match="names no --nproc_per_node"):
        with_world_size(["python", "t.py"], 2)
