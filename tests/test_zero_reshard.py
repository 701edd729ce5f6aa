"""DeepSpeed ZeRO-2 moved to another number of ranks with the same global batch (issue 49, item 1).

In process: partitions cut as DeepSpeed cuts them (each group's flat fp32 vector padded at its end, one equal
slice per rank, the same slices of both Adam moments) moved 4 -> 2 -> 4 and back bit for bit; what is refused.
Launched: examples/train_deepspeed.py (ZeRO-2 on gloo ranks, with and without CPU offload) moved 4 -> 2 -> 4 in
place: each move proven at load (the gathered masters and moments equal the saved ones), the ledger exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrelay.checkpoint.zero_reshard import (
    BASE,
    SINGLE,
    FlatState,
    assemble,
    gather,
    optim_files,
    partition_doc,
    reshard_folder,
)
from torchrelay.errors import CheckpointError, ConfigError


def _deepspeed_partitions(whole: FlatState, world: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Each rank's optimizer_state_dict as DeepSpeed 0.19's ZeRO-2 writes it: a group's flat vector padded to a
    multiple of 2 x world (its nccl_start_alignment_factor), rank r the r-th slice."""
    sizes = [math.ceil(m.numel() / (2 * world)) * 2 for m in whole.masters]
    docs = []
    for rank in range(world):
        singles, state, paddings = [], {}, []
        for g, (m, size) in enumerate(zip(whole.masters, sizes, strict=True)):
            padded = torch.cat([m, m.new_zeros(size * world - m.numel())])
            cut = slice(rank * size, (rank + 1) * size)
            singles.append(padded[cut].clone())
            paddings.append(max(0, (rank + 1) * size - max(rank * size, m.numel())))
            state[g] = {"step": whole.steps[g]}
            for key, moment in whole.moments[g].items():
                state[g][key] = torch.cat([moment, moment.new_zeros(size * world - m.numel())])[cut].clone()
        docs.append(
            {
                SINGLE: singles,
                BASE: {"state": state, "param_groups": [{"params": [g]} for g in range(len(sizes))]},
                "group_paddings": paddings,
                "param_alignment_paddings": [[0, 0]],
                "partition_count": [world] * len(sizes),
                "loss_scaler": "static",
            }
        )
    return docs, sizes


def _whole(numels: tuple[int, ...] = (1001, 37)) -> FlatState:
    gen = torch.Generator().manual_seed(0)
    return FlatState(
        masters=[torch.randn(n, generator=gen) for n in numels],
        moments=[
            {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen)}
            for n in numels
        ],
        steps=[torch.tensor(7.0), torch.tensor(7.0)],
    )


def test_zero2_partitions_move_4_to_2_to_4_bit_for_bit() -> None:
    whole = _whole()
    four, sizes4 = _deepspeed_partitions(whole, 4)
    assert gather(four).equal(whole) == []
    two_expected, sizes2 = _deepspeed_partitions(whole, 2)
    two = [partition_doc(gather(four), four[0], r, 2, sizes2) for r in range(2)]
    for got, want in zip(two, two_expected, strict=True):  # what DeepSpeed itself would have saved on 2 ranks
        assert got["group_paddings"] == want["group_paddings"] and got["partition_count"] == [2, 2]
        for a, b in zip(got[SINGLE], want[SINGLE], strict=True):
            assert torch.equal(a, b)
        for g in range(2):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[BASE]["state"][g][key], want[BASE]["state"][g][key])
    back = [partition_doc(gather(two), two[0], r, 4, sizes4) for r in range(4)]
    for got, want in zip(back, four, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got[SINGLE], want[SINGLE], strict=True))
        assert got["group_paddings"] == want["group_paddings"]
    # the proof the load makes: every rank's live slices and paddings gathered are the saved state
    live = [(d[SINGLE], [d[BASE]["state"][g] for g in range(2)], d["group_paddings"]) for d in two]
    assert assemble(live).equal(whole) == []
    live[1][0][0][3] += 1e-7
    assert assemble(live).equal(whole) == ["group 0 fp32 masters"]


def test_a_group_smaller_than_the_ranks_and_one_rank() -> None:
    whole = _whole((3, 5))
    eight, _ = _deepspeed_partitions(whole, 8)  # most ranks hold only padding
    one, sizes1 = _deepspeed_partitions(whole, 1)
    moved = partition_doc(gather(eight), eight[0], 0, 1, sizes1)
    assert all(torch.equal(a, b) for a, b in zip(moved[SINGLE], one[0][SINGLE], strict=True))
    with pytest.raises(CheckpointError, match="cannot hold"):
        partition_doc(whole, eight[0], 0, 2, [1, 1])


def test_what_is_not_resharded_is_refused(tmp_path: Path) -> None:
    docs, _ = _deepspeed_partitions(_whole(), 2)
    padded = [{**d, "param_alignment_paddings": [[0, 3]]} for d in docs]
    with pytest.raises(ConfigError, match="parameter_alignment"):
        gather(padded)
    with pytest.raises(CheckpointError, match="elastic_checkpoint"):
        gather([{**d, BASE: [d[BASE]]} for d in docs])
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not ranks 0..N-1"):
        optim_files(tmp_path)


def test_a_folder_is_resharded_into_files_deepspeed_names(tmp_path: Path) -> None:
    """reshard_folder on files: rank r of the new world writes its own partition, rank 0 the model states with the
    new dp_world_size; the source folder is left as it was."""
    whole = _whole()
    four, _ = _deepspeed_partitions(whole, 4)
    source, target = tmp_path / "old", tmp_path / "new"
    source.mkdir()
    for rank, doc in enumerate(four):
        torch.save(
            {"optimizer_state_dict": doc, "ds_version": "0.19.8"},
            source / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
    torch.save({"dp_world_size": 4, "module": {}}, source / "mp_rank_00_model_states.pt")
    before = sorted((p.name, p.read_bytes()) for p in source.iterdir())
    _, sizes2 = _deepspeed_partitions(whole, 2)
    for rank in range(2):
        got = reshard_folder(source, target, rank, 2, sizes2, lambda p: torch.load(p, weights_only=False))
        assert got.equal(whole) == []
    assert sorted(p.name for p in target.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert torch.load(target / "mp_rank_00_model_states.pt")["dp_world_size"] == 2
    docs = [torch.load(p, weights_only=False)["optimizer_state_dict"] for p in optim_files(target)]
    assert gather(docs).equal(whole) == []
    assert sorted((p.name, p.read_bytes()) for p in source.iterdir()) == before


# --- launched: examples/train_deepspeed.py moved 4 -> 2 -> 4 ranks in place ------------------------------------


def launch_ds(example: dict[str, Path], code: Path, target: Path, nproc: int, *more: str, **env: str) -> Any:
    """One torchrun launch of examples/train_deepspeed.py: 6 updates, dropout 0 (a rank's dropout masks follow its
    re-derived RNG at a move), to its end or its stop."""
    from helpers import TORCHRUN, clean_env, run_tree

    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "--monitor_interval=0.5"]
    cmd += [
        str(code / "train_deepspeed.py"),
        "--run-dir",
        str(target),
        "--manifest",
        str(example["manifest"]),
    ]
    cmd += ["--data-root", str(example["root"]), "--updates", "6", "--dropout", "0", *more]
    return run_tree(cmd, timeout=900, env=clean_env(DS_ACCELERATOR="cpu", **env), cwd=code)


def stop_on_four(example: dict[str, Path], code: Path, run: Path, *more: str) -> None:
    """The run's first launch, on 4 ranks, stopped by a request after update 2."""
    from torchrelay.policy.stop import write_request

    run.mkdir()
    write_request(run, at_update=2)
    out = launch_ds(example, code, run, 4, *more, TORCHRELAY_RESHARD="1")
    assert (run / "checkpoint-2" / "COMPLETE.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]


def move_4_to_2_to_4(example: dict[str, Path], code: Path, straight: Path, run: Path, *more: str) -> None:
    """`run`, stopped after update 2 on 4 ranks, moved to 2 ranks to update 4 and back to 4 ranks to the end,
    against `straight`, the uninterrupted 4-rank run (launched here): each move proven at load, the ledger exact,
    each parameter within the audit's bound of the reduction order (tests/test_elastic.py's criterion)."""
    from helpers import segments
    from torchrelay.audit.layout_audit import layout_verdict
    from torchrelay.ledger.exposure import prove
    from torchrelay.policy.stop import write_request

    out = launch_ds(example, code, straight, 4, *more, "--set", "keep_updates=[2]", TORCHRELAY_RESHARD="1")
    # its parameters at the move: the audit's reference
    assert (straight / "checkpoint-6" / "COMPLETE.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    for nproc, stop in ((2, 4), (4, None)):
        if stop is not None:
            write_request(run, at_update=stop)
        out = launch_ds(example, code, run, nproc, *more, TORCHRELAY_RESHARD="1")
        assert (run / f"checkpoint-{stop or 6}" / "COMPLETE.json").exists(), (
            out.stdout[-3000:] + out.stderr[-3000:]
        )
    segs = segments(run)
    assert [(s["world_size"], s["last_update"], s["ended"]) for s in segs] == [
        (4, 2, "request"),
        (2, 4, "request"),
        (4, 6, "finished"),
    ]
    for seg, (old, new) in zip(segs[1:], [(4, 2), (2, 4)], strict=True):
        change = seg["layout_change"]
        assert (change["from"]["world_size"], change["to"]["world_size"], change["global_batch"]) == (
            old,
            new,
            32,
        )
        assert change["from"]["grad_accum"] * old == change["to"]["grad_accum"] * new
        assert any("ZeRO-2 optimizer partitions resharded" in n for n in change["notes"]), change["notes"]
    assert prove(run).ok
    assert not list(run.glob(".zero-reshard-*"))  # the moved partitions' folder is gone once loaded
    audit = layout_verdict(straight, run, [4, 2, 4], [2, 4], [4, 6])
    print("\n" + "\n".join(audit.lines()))
    assert audit.ledger.equal and audit.ok, "\n".join(audit.lines())
    assert len(audit.drift[6].judged) == 5  # every parameter of the model, judged by its Adam moments


@pytest.fixture(scope="module")
def stopped_on_four(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The ZeRO-2 run (torch AdamW in the engine) stopped after update 2 on 4 ranks, once for the module: the run
    the move test continues in place, and a bundle packed from a copy of it that the prepare test moves to 1 rank
    (packing marks the packed checkpoint handed off, hence the copy)."""
    import shutil

    from helpers import make_code_repo
    from torchrelay.cli import main

    base = tmp_path_factory.mktemp("zero2-stopped-on-four")
    code, run = make_code_repo(base / "code", ("train_deepspeed.py",)), base / "run"
    stop_on_four(example, code, run)
    shutil.copytree(run, base / "source")
    assert main(["pack", str(base / "source"), str(base / "bundle")]) == 0
    return {"code": code, "run": run, "bundle": base / "bundle"}


@pytest.mark.launch
def test_zero2_moves_4_to_2_to_4_in_place_proven_and_the_ledger_exact(
    example: dict[str, Path], stopped_on_four: dict[str, Path], tmp_path: Path
) -> None:
    """The uninterrupted 4-rank run against the same run moved 4 -> 2 -> 4 after updates 2 and 4: each move proven
    at load, the ledger exact, each parameter within the audit's bound. With CPU offload:
    tests/test_zero_reshard_offload.py."""
    code = stopped_on_four["code"]
    move_4_to_2_to_4(example, code, tmp_path / "straight", stopped_on_four["run"])


def test_the_reshard_benchmark_runs_at_toy_size() -> None:
    """bench_zero_reshard's measure at toy size, so it cannot rot: 4 partitions resharded for 2, proven."""
    from zero_partitions import measure

    row = measure(1001, 4, 2)
    assert (row["elements"], row["old"], row["new"]) == (1001, 4, 2) and row["reshard_s_slowest_rank"] > 0


def test_a_layout_change_accepts_zero2_and_refuses_zero3_naming_it(tmp_path: Path) -> None:
    from torchrelay.checkpoint.resume_check import _per_rank_on_layout_change

    notes = _per_rank_on_layout_change(tmp_path / "checkpoint-4", {"deepspeed": {"zero_stage": 2}})
    assert notes == [
        "DeepSpeed ZeRO-2 optimizer partitions resharded for the new ranks at load, proven bit for bit (fp32 "
        "masters and both moments gathered)"
    ]
    with pytest.raises(ConfigError, match="ZeRO stage 3 engine's checkpoint") as err:
        _per_rank_on_layout_change(tmp_path / "checkpoint-4", {"deepspeed": {"zero_stage": 3}})
    assert "ZeRO-1/2 checkpoints are resharded" in (err.value.hint or "")


@pytest.mark.launch
def test_zero2_prepared_for_one_rank_from_a_bundle_of_four(
    example: dict[str, Path], stopped_on_four: dict[str, Path], tmp_path: Path
) -> None:
    """`prepare --world-size 1` of a ZeRO-2 run stopped on 4 ranks (the module's, packed): the first launch on 1
    rank reshards and finishes it, the move recorded as asked by prepare, the ledger exact."""
    from helpers import segments
    from torchrelay.cli import main
    from torchrelay.ledger.exposure import prove

    there = tmp_path / "there"
    assert (
        main(["prepare", str(stopped_on_four["bundle"]), "--run-dir", str(there), "--world-size", "1"]) == 0
    )
    out = launch_ds(example, next((there / "source").iterdir()), there, 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    segs = segments(there)
    assert [(s["world_size"], s["ended"]) for s in segs] == [(4, "request"), (1, "finished")]
    change = segs[-1]["layout_change"]
    assert change["asked_by"] == "prepare" and (change["from"]["grad_accum"], change["to"]["grad_accum"]) == (
        2,
        8,
    )
    assert prove(there).ok
