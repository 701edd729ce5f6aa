"""Hugging Face Trainer + DeepSpeed ZeRO-2 moved to another number of ranks with the same global batch (issue 49).

examples/train_hf_trainer_offload.py (a tiny Qwen3 with an adapter at 10x the learning rate, no dropout) on gloo
ranks without offload (torch AdamW inside the ZeRO optimizer): moved 4 -> 2 -> 4 in place, and 4 -> 2 through
`prepare --world-size`, both from one launch stopped on 4 ranks; with `offload_optimizer: cpu` (DeepSpeedCPUAdam):
tests/test_trainer_zero_offload.py, through move_4_to_2_to_4 here. RelayTrainer derives Trainer's and the
DeepSpeed configuration's gradient accumulation from the run (2 -> 4 -> 2), the engine's partitions are resharded
and proven at load (gathered masters and both moments bit-equal), the ledger is exact and the continued run is
within the audit's criterion of the uninterrupted 4-rank run.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO, TORCHRUN, clean_env, make_code_repo, run_tree, segments

SCRIPT = "train_hf_trainer_offload.py"


def trainer_code(tmp_path: Path) -> Path:
    (tmp_path / "code").mkdir()
    shutil.copyfile(REPO / "tests" / "trainer_paced.py", tmp_path / "code" / "trainer_paced.py")
    return make_code_repo(tmp_path / "code", (SCRIPT,))


def launch_trainer(code: Path, run: Path, nproc: int, *args: str, **env: str) -> Any:
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "--monitor_interval=0.5"]
    cmd += [str(code / "trainer_paced.py"), "--output-dir", str(run), *args]
    environ = clean_env(DS_ACCELERATOR="cpu", TRAINER_EXAMPLE=SCRIPT.removesuffix(".py"), **env)
    return run_tree(cmd, timeout=900, env=environ, cwd=code)


def tail_of(out: Any) -> str:
    return str(out.stdout[-4000:] + out.stderr[-4000:])


@pytest.fixture(scope="module")
def stopped_on_four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Trainer run without offload stopped by a request after update 2 on 4 ranks, once for the module: the
    run the move test continues in place, and a bundle packed from a copy of it that the prepare test moves to 2
    ranks (the same launch both tests began with; packing marks its checkpoint handed off, hence the copy)."""
    from torchrelay.cli import main
    from torchrelay.policy.stop import write_request

    base = tmp_path_factory.mktemp("stopped-on-four")
    code, run = trainer_code(base), base / "run"
    run.mkdir()
    write_request(run, at_update=2)
    out = launch_trainer(code, run, 4, "--offload", "none")
    assert segments(run)[-1]["last_update"] == 2, tail_of(out)
    assert (run / "checkpoint-2" / "COMPLETE.json").exists(), tail_of(out)
    shutil.copytree(run, base / "source")
    assert main(["pack", str(base / "source"), str(base / "bundle")]) == 0
    return {"code": code, "run": run, "bundle": base / "bundle"}


def move_4_to_2_to_4(
    code: Path, straight: Path, run: Path, offload: bool, capsys: pytest.CaptureFixture[str], shown: list[str]
) -> None:
    """`run`, stopped by a request after update 2 on 4 ranks, moved to 2 ranks to update 4 and back to 4 ranks to
    the end, against `straight` (the uninterrupted 4-rank run, checkpoints every 2): the moves recorded and
    proven, the ledger exact, every parameter within the audit's bound, `status` showing the move."""
    from torchrelay.audit.layout_audit import layout_verdict
    from torchrelay.cli import main
    from torchrelay.ledger.exposure import prove
    from torchrelay.policy.stop import write_request

    mode = ["--offload", "cpu" if offload else "none"]
    # asked for by the variable (what `launch --reshard` sets), then by the script's RelayOptions(reshard=True)
    for nproc, stop, flag, env in ((2, 4, [], {"TORCHRELAY_RESHARD": "1"}), (4, None, ["--reshard"], {})):
        if stop is not None:
            write_request(run, at_update=stop)
        started = time.monotonic()
        out = launch_trainer(code, run, nproc, *mode, *flag, **env)
        shown.append(f"{nproc} ranks to update {stop or 6}: {time.monotonic() - started:.0f} s")
        assert (run / f"checkpoint-{stop or 6}" / "COMPLETE.json").exists(), tail_of(out)
    segs = segments(run)
    assert [(s["world_size"], s["last_update"], s["ended"]) for s in segs] == [
        (4, 2, "request"),
        (2, 4, "request"),
        (4, 6, "finished"),
    ]
    for seg, (old, new) in zip(segs[1:], [(4, 2), (2, 4)], strict=True):
        change = seg["layout_change"]
        moved = [(change[side]["world_size"], change[side]["grad_accum"]) for side in ("from", "to")]
        assert moved == [(old, 8 // old), (new, 8 // new)] and change["global_batch"] == 16, change
        assert change["asked_by"] == "reshard"
        assert any("ZeRO-2 optimizer partitions resharded" in n for n in change["notes"]), change["notes"]
    assert prove(run).ok
    assert not list(run.glob(".zero-reshard-*"))
    audit = layout_verdict(straight, run, [4, 2, 4], [2, 4], [4, 6])
    shown += audit.lines()
    with capsys.disabled():
        print("\n" + "\n".join(shown))
    assert audit.ledger.equal and audit.ok, "\n".join(audit.lines())
    assert len(audit.drift[6].judged) >= 10  # every parameter of the model, judged by its Adam moments
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    assert "layout change at update 4 (reshard)" in capsys.readouterr().out


@pytest.mark.launch
@pytest.mark.timeout(1800)  # launches of 4 and 2 ranks that each import transformers and DeepSpeed
def test_trainer_zero2_moves_4_to_2_to_4_in_place_proven_and_the_ledger_exact(
    stopped_on_four: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The uninterrupted 4-rank Trainer run (torch AdamW inside the ZeRO optimizer) against the same run stopped at
    updates 2 and 4 and moved 4 -> 2 -> 4 (TORCHRELAY_RESHARD=1, what `launch --reshard` sets): Trainer's
    accumulation follows the run, each move is proven at load, recorded and shown by `status`; the ledger exact,
    every parameter within the audit's bound. Before RelayTrainer derived the accumulation, the 2-rank launch
    trained 8-sample updates against the run's 16 (DeepSpeed's gradient_accumulation_steps 2, the run's grad_accum
    4: refused when the engine was tracked). With offload: tests/test_trainer_zero_offload.py."""
    code, straight = stopped_on_four["code"], tmp_path / "straight"
    started = time.monotonic()
    out = launch_trainer(code, straight, 4, "--offload", "none", "--save-steps", "2")  # checkpoints 2, 4, 6
    shown = [f"uninterrupted, 4 ranks: {time.monotonic() - started:.0f} s"]
    assert out.returncode == 0, tail_of(out)
    assert out.stdout.count("DeepSpeedZeroOptimizer > AdamW") == 4, tail_of(out)
    move_4_to_2_to_4(code, straight, stopped_on_four["run"], False, capsys, shown)


@pytest.mark.launch
@pytest.mark.timeout(1200)
def test_trainer_zero2_prepared_for_two_ranks_from_a_bundle_of_four(
    stopped_on_four: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prepare --world-size 2` of a Trainer ZeRO-2 run stopped on 4 ranks: the launch of the bundle's code on 2
    ranks (no flag) reshards, derives accumulation 4 and finishes; the move recorded as asked by prepare and shown
    by `status`; the ledger exact."""
    from torchrelay.cli import main
    from torchrelay.ledger.exposure import prove

    there = tmp_path / "there"
    assert (
        main(["prepare", str(stopped_on_four["bundle"]), "--run-dir", str(there), "--world-size", "2"]) == 0
    )
    out = launch_trainer(next((there / "source").iterdir()), there, 2, "--offload", "none")
    assert out.returncode == 0, tail_of(out)
    segs = segments(there)
    assert [(s["world_size"], s["ended"]) for s in segs] == [(4, "request"), (2, "finished")]
    change = segs[-1]["layout_change"]
    assert change["asked_by"] == "prepare"
    assert (change["from"]["grad_accum"], change["to"]["grad_accum"]) == (2, 4)
    assert prove(there).ok
    capsys.readouterr()
    assert main(["status", str(there)]) == 0
    assert "layout change at update 2 (prepare)" in capsys.readouterr().out


MIRROR = "params.training_args.gradient_accumulation_steps"


def _fields(world: int, accum: int, mirror: int) -> dict[str, Any]:
    return {
        "world_size": world,
        "micro_batch": 2,
        "grad_accum": accum,
        "global_batch": world * 2 * accum,
        MIRROR: mirror,
        "params.training_args.learning_rate": 1e-3,
    }


def test_trainer_accumulation_is_layout_while_the_global_batch_is_kept(tmp_path: Path) -> None:
    """The contract's training_args.gradient_accumulation_steps follows the world size under a move: a launch on 2
    ranks that passes 4 (or the script's 2, derived to 4) for a run made on 4 ranks with 2 is a layout change, and
    once moved it needs no flag; another global batch is refused naming its product, another LR as math. Before,
    the field was math: `gradient_accumulation_steps: 2 -> 4` refused the 2-rank launch that kept the batch."""
    from torchrelay.checkpoint.resume_check import _check_math_and_layout
    from torchrelay.errors import ContractMismatch
    from torchrelay.records.reshard import Layout

    def check(recomputed: dict[str, Any], current: Layout, new: Layout, reshard: bool) -> None:
        recorded = _fields(4, 2, 2)
        path, manifest = tmp_path / "contract.json", tmp_path / "manifest.jsonl"
        _check_math_and_layout(path, recorded, recomputed, current, new, reshard, False, manifest)

    four, two = Layout(4, 2, 2), Layout(2, 2, 4)
    check(_fields(2, 4, 4), four, two, reshard=True)  # the script says 4 for 2 ranks
    check(_fields(2, 4, 2), four, two, reshard=True)  # the script's 2, the run derived 4
    check(_fields(2, 4, 4), two, two, reshard=False)  # later launches on the new layout
    check(_fields(4, 2, 4), two, four, reshard=True)  # and back
    with pytest.raises(ContractMismatch, match="only when asked"):
        check(_fields(2, 4, 4), four, two, reshard=False)
    with pytest.raises(ContractMismatch, match=r"global batch is the product .* = 8"):
        check(_fields(2, 2, 2), four, Layout(2, 2, 2), reshard=True)
    with pytest.raises(ContractMismatch, match="learning_rate"):
        check({**_fields(2, 4, 4), "params.training_args.learning_rate": 2e-3}, four, two, reshard=True)
