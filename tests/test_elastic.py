"""A run moved to another number of ranks (issue 13): the same samples in the same updates, the parameters apart only
by the floating-point reduction order, a layout change only when asked for, another global batch never.

One relayed run per variant: 2 ranks stopped after update 4, continued on 1 rank (TORCHRELAY_RESHARD=1) and stopped
after update 8, finished on 4 ranks (DDP, float32) or on 2 (FSDP2, float64), against the same run uninterrupted on
2 ranks. Dropout is 0: dropout drawn from a rank's torch RNG is per rank and cannot follow a layout change (README).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from handoff_fixtures import STOP_AT, Packed
from handoff_fixtures import TOTAL as PACKED_TOTAL
from helpers import EXAMPLES, clean_env, git, launch, segments, torchrun_cmd, write_config
from torchrelay.audit.drift import (
    TOLERANCE_FACTOR,
    Drift,
    LedgerDiff,
    TensorDrift,
    compare_ledgers,
    drift_of,
    measure_drift,
    micro_batches_by_update,
)
from torchrelay.audit.layout_audit import layout_verdict, likely_causes, with_world_size
from torchrelay.audit.runner import AuditError
from torchrelay.checkpoint.resume_check import validate_resume
from torchrelay.cli import main
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.errors import EXIT_REFUSED, ConfigError, ContractMismatch
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import write_request
from torchrelay.run.exact_reduce import ExactReduction, check_layout, check_model

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
    """float32 under DDP and float64 under FSDP2, each through `torchrelay audit --vary world_size=...` (its own
    verdict, which must answer on either wrapper); both leave the uninterrupted and the relayed run directory."""
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
    work = base / "audit"
    argv = ["audit", "--json", "--updates", str(TOTAL), "--stop-at", ",".join(map(str, STOPS))]
    argv += ["--vary", "world_size=" + ",".join(map(str, worlds)), "--work-dir", str(work), "--"]
    argv += torchrun_cmd(example["code"], base / "unused", nproc=worlds[0], config=config)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in clean_env().items():
            mp.setenv(key, value)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(argv)
    assert code == 0, (out.getvalue()[-3000:], sorted(work.glob("logs/*")))
    return {
        "straight": work / "uninterrupted",
        "moved": work / "interrupted",
        "worlds": worlds,
        "dtype": dtype,
        "verdict": json.loads(out.getvalue()),
    }


@pytest.mark.launch
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

    ledger = compare_ledgers(RunDir(straight), RunDir(moved))
    drift = measure_drift(
        straight / f"checkpoint-{TOTAL}",
        moved / f"checkpoint-{TOTAL}",
        TOTAL - STOPS[0],
        straight / f"checkpoint-{STOPS[0]}",  # kept by the audit: the parameters at the move
    )
    print(
        f"\n[{relayed['dtype']}, ranks {worlds}] ledger: {len(ledger.differing)} of {ledger.compared} updates differ"
    )
    print(f"[{relayed['dtype']}, ranks {worlds}] {drift.line()}")
    assert ledger.compared == TOTAL and ledger.equal, ledger.detail
    assert (
        len(micro_batches_by_update(RunDir(moved))[TOTAL]) == 4
    )  # 4 micro-batches of 4 samples, on any layout
    assert prove(moved).ok
    assert drift.dtype == relayed["dtype"]
    assert drift.within, drift.line()
    assert relayed["verdict"]["ok"] and not relayed["verdict"]["exact"]
    # The attention key bias has an exact gradient of zero (softmax ignores a constant added to every key): its
    # rounding noise, normalized by Adam into full steps, is set aside by the optimizer's own second moment,
    # element by element (it is packed with the query's and value's, which are judged).
    bias = next(t for t in drift.judged if t.name == "model.blocks.layers.0.self_attn.in_proj_bias")
    assert bias.detail.startswith("32 of 96 elements"), drift.line()  # the key third of q, k, v


@pytest.mark.launch
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


@pytest.mark.launch
def test_a_layout_change_is_refused_unless_asked_and_another_global_batch_always(
    relayed: dict[str, Any], example: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(relayed["straight"], run)
    cfg = stored_config(RunDir(run))
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


@pytest.mark.launch
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
    by_update = micro_batches_by_update(RunDir(run))
    baseline = micro_batches_by_update(RunDir(packed.baseline))
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


# --- a tiny CNN (tests/elastic_net.py): a correct move passes, a real change fails, elastic: exact is bit for bit ---

NET_TOTAL, NET_STOP = 8, 4


def _net_repo(dest: Path) -> Path:
    """A code repo holding the tiny CNN and the zoo's 64 labels."""
    dest.mkdir(parents=True)
    shutil.copyfile(Path(__file__).with_name("elastic_net.py"), dest / "elastic_net.py")
    shutil.copyfile(EXAMPLES / "zoo" / "samples.jsonl", dest / "samples.jsonl")
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "net")
    return dest


def _net(
    code: Path,
    run_dir: Path,
    nproc: int,
    until: int,
    sets: dict[str, Any] | None = None,
    reshard: bool = False,
) -> None:
    """One launch of the CNN, to checkpoint-`until` (a requested stop: torchrun then exits 1, the rank 4)."""
    out = launch(
        code,
        run_dir,
        nproc=nproc,
        sets=sets,
        env={"TORCHRELAY_RESHARD": "1"} if reshard else None,
        script="elastic_net.py",
    )
    assert (run_dir / f"checkpoint-{until}" / "COMPLETE.json").exists(), out.stdout + out.stderr[-3000:]


@pytest.fixture(scope="module")
def moves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The CNN with a BatchNorm (per-rank statistics; the convolution bias before it gets only rounding noise):
    uninterrupted on 2 ranks, and moved to 1 rank after update 4 correctly and with one real change each."""
    base = tmp_path_factory.mktemp("moves")
    code = _net_repo(base / "code")
    runs = {name: base / name for name in ("straight", "moved", "lr", "skip", "regroup")}
    runs["moved"].mkdir()
    write_request(runs["moved"], at_update=NET_STOP)
    with ThreadPoolExecutor(2) as pool:
        first = [
            pool.submit(_net, code, runs["straight"], 2, NET_TOTAL),
            pool.submit(_net, code, runs["moved"], 2, NET_STOP),
        ]
        for job in first:
            job.result()
    for name in ("lr", "skip", "regroup"):
        shutil.copytree(runs["moved"], runs[name])
    changes: dict[str, dict[str, Any]] = {
        "moved": {},
        "lr": {"params.lr_scale": 1.01},  # the learning rate 1% higher from the move on
        "skip": {"params.skip_update": 6},  # one sample of update 6 left out
        "regroup": {"micro_batch": 2},  # the same samples in micro-batches of 2 (BatchNorm makes that math)
    }
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_net, code, runs[n], 1, NET_TOTAL, sets, True) for n, sets in changes.items()]
        for job in jobs:
            job.result()
    return runs


def _verdict(moves: dict[str, Path], name: str) -> Any:
    return layout_verdict(moves["straight"], moves[name], [2, 1], [NET_STOP], [NET_TOTAL])


@pytest.mark.launch
def test_a_correct_move_passes_per_tensor_with_the_noise_and_the_buffers_set_aside(
    moves: dict[str, Path],
) -> None:
    audit = _verdict(moves, "moved")
    drift = audit.drift[NET_TOTAL]
    print("\n" + "\n".join(audit.lines()))
    assert audit.ok and drift.within, drift.line()
    worst = drift.worst
    assert worst is not None and 0 < worst.drift < 10, drift.line()  # not bit for bit: the default reduction
    # model.0 is the convolution whose bias feeds the BatchNorm: its exact gradient is zero, its rounding noise
    # Adam's full-size steps; under the old global criterion it alone put the move outside.
    assert [t.name for t in drift.of_kind("noise")] == ["model.0.bias"], drift.line()
    noise = next(t for t in drift.tensors if t.name == "model.0.bias")
    assert "rounding noise" in noise.detail
    buffers = {t.name: t for t in drift.of_kind("buffer")}
    assert set(buffers) == {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}
    # 2 micro-steps an update on each of 2 ranks, then 4 on 1 rank: the count differs by design, and says why.
    assert "16 vs 24" in buffers["model.1.num_batches_tracked"].detail
    assert "grad_accum per update" in buffers["model.1.num_batches_tracked"].detail
    assert "per rank in the run on 2 rank(s), merged as their mean" in buffers["model.1.running_mean"].detail
    assert buffers["model.1.running_mean"].drift > 0.01  # another rank's statistics, not rounding
    assert "WITHIN TOLERANCE" in audit.lines()[-1]


@pytest.mark.launch
@pytest.mark.parametrize("change", ["lr", "skip", "regroup"])
def test_a_real_change_at_the_move_is_outside_with_a_cause(moves: dict[str, Path], change: str) -> None:
    audit = _verdict(moves, change)
    drift = audit.drift[NET_TOTAL]
    assert not audit.ok and not drift.within, drift.line()
    worst = drift.worst
    assert worst is not None and worst.drift > 10 * TOLERANCE_FACTOR, drift.line()  # far, not at the edge
    assert "OUTSIDE TOLERANCE" in "\n".join(audit.lines())
    causes = [c["name"] for c in audit.causes]
    if change == "regroup":
        assert audit.ledger.differing and causes == ["a changed micro-batch"], audit.causes
    else:
        assert audit.ledger.equal  # the ledger cannot see these: only the drift can
        # The net's dropout has p 0: dropout is never the cause; its BatchNorm statistics are kept per rank.
        assert causes[:2] == ["per-rank buffers", "a hyper-parameter computed from the layout"], audit.causes


@pytest.mark.launch
def test_exact_mode_is_bit_for_bit_after_moving_2_1_4(tmp_path: Path) -> None:
    """`elastic: exact` through the audit: uninterrupted on 2 ranks against 2 -> 1 -> 4 (stops after 2 and 5)."""
    code = _net_repo(tmp_path / "code")
    work = tmp_path / "audit"
    argv = ["audit", "--json", "--updates", str(NET_TOTAL), "--stop-at", "2,5"]
    argv += ["--vary", "world_size=2,1,4", "--work-dir", str(work), "--"]
    sets = {"elastic": "exact", "params.norm": "group"}
    argv += torchrun_cmd(code, tmp_path / "unused", nproc=2, sets=sets, script="elastic_net.py")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in clean_env().items():
            mp.setenv(key, value)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code_ = main(argv)
    verdict = json.loads(out.getvalue())
    assert code_ == 0 and verdict["ok"] and verdict["exact"], out.getvalue()[-3000:]
    assert verdict["bit_differing"] == {"3": [], "6": [], "8": []}
    moved = work / "interrupted"
    assert [s["world_size"] for s in segments(moved)] == [2, 1, 4]
    # clipping saw the same norm on every layout: the reduced gradient is the same bits everywhere
    norms = [
        [json.loads(x)["grad_norm"] for x in (r / "train" / "metrics-rank0.jsonl").open()]
        for r in (
            work / "uninterrupted",
            moved,
        )
    ]
    assert norms[0] == norms[1] and len(norms[0]) == NET_TOTAL


# --- in process: the canonical sum, the refusals of exact mode, the drift rules on each wrapper's tensors ---


def _reduce_on(world: int, leaves: list[list[torch.Tensor]]) -> torch.Tensor:
    """What every rank of `world` ranks ends with, the all-gather done by hand (global micro-batch g = m x W + r)."""
    accum = len(leaves) // world
    subtrees = []
    for rank in range(world):
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in leaves[0]]
        reduction = ExactReduction(rank, world, accum)
        for micro in range(accum):
            for p, g in zip(params, leaves[micro * world + rank], strict=True):
                p.grad = g.clone() / accum  # the script's loss / grad_accum: exact for a power of two
            reduction.take(params, micro)
        subtrees.append(reduction.local_sum(params))
    return ExactReduction.combine(subtrees)


def _sequential_on(world: int, leaves: list[list[torch.Tensor]]) -> torch.Tensor:
    """DDP's order: a rank accumulates its micro-batches one after the other, then the ranks are summed."""
    accum = len(leaves) // world
    ranks = [
        sum(torch.cat([t.reshape(-1) for t in leaves[m * world + r]]) / accum for m in range(accum))
        for r in range(world)
    ]
    total = ranks[0]
    for r in ranks[1:]:
        total = total + r
    return total / world


def test_the_canonical_sum_is_the_same_bits_on_every_power_of_two_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    leaves = [
        [torch.randn(64, 3, generator=gen) * 10.0 ** (g % 3), torch.randn(7, generator=gen)] for g in range(8)
    ]
    exact = [_reduce_on(world, leaves) for world in (1, 2, 4, 8)]
    assert all(torch.equal(exact[0].view(torch.int32), e.view(torch.int32)) for e in exact[1:])
    sequential = [_sequential_on(world, leaves) for world in (1, 2, 4, 8)]
    assert not all(torch.equal(sequential[0], s) for s in sequential[1:])  # the order matters: DDP's differs


def test_exact_mode_refuses_what_it_cannot_keep_exact() -> None:
    with pytest.raises(ConfigError, match="power-of-two world_size, got 3") as err:
        ExactReduction(0, 3, 2)
    assert "elastic" in err.value.message and err.value.exit_code == EXIT_REFUSED
    with pytest.raises(ConfigError, match="power-of-two grad_accum, got 6"):
        check_layout(2, 6)
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ConfigError, match="1 is a BatchNorm that tracks running statistics") as err:
        check_model(bn)
    assert "track_running_stats=False" in (err.value.hint or "")
    check_model(
        torch.nn.Sequential(torch.nn.BatchNorm2d(4, track_running_stats=False))
    )  # batch statistics only
    with pytest.raises(ConfigError, match="0 is a Dropout") as err:
        check_model(torch.nn.Sequential(torch.nn.Dropout(0.1)))
    assert "tr.sample_dropout" in (err.value.hint or "")
    check_model(torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.GroupNorm(2, 4)))
    with pytest.raises(ConfigError, match="0 is a SyncBatchNorm"):
        check_model(torch.nn.Sequential(torch.nn.SyncBatchNorm(4)))

    class Sharded(torch.nn.Linear):  # what fully_shard makes: a module that can defer its reduce-scatter
        def set_requires_gradient_sync(self, on: bool) -> None: ...

    with pytest.raises(ConfigError, match="FSDP2"):
        check_model(Sharded(2, 2))

    class Engine(torch.nn.Linear):  # what deepspeed.initialize returns: a module that reduces by itself
        def zero_optimization_stage(self) -> int:
            return 2

    with pytest.raises(ConfigError, match="DeepSpeed engine"):
        check_model(Engine(2, 2))
    with pytest.raises(ConfigError, match="needs the model"):
        check_model(None)  # type: ignore[arg-type]  # step.micro_batches() without it (the Trainer's loop)
    with pytest.raises(
        ConfigError,
        match=r"^config\.elastic: must be one of 'default', 'exact', got 'exactly'; did you mean 'exact'\?",
    ):
        RelayConfig(seed=1, micro_batch=1, total_updates=1, manifest="m.jsonl", elastic="exactly")


def _adam_like(params: dict[str, torch.Tensor], grad_rms: dict[str, float]) -> dict[str, torch.Tensor]:
    out = {f"model.{n}": t for n, t in params.items()}
    for n, t in params.items():
        out[f"optim.{n}.exp_avg_sq"] = torch.full_like(t, grad_rms.get(n, 1.0) ** 2)
    return out


def test_the_drift_rules_on_the_tensors_of_each_wrapper() -> None:
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    # SyncBatchNorm, FSDP2 (gathered) or no wrapper on one rank: the buffers once on both sides, by design apart
    a = _adam_like({"w": w}, {}) | {
        "model.bn.running_mean": torch.ones(4),
        "model.bn.num_batches_tracked": torch.tensor(8),
    }
    b = dict(a) | {
        "model.bn.running_mean": torch.ones(4) * 1.5,
        "model.bn.num_batches_tracked": torch.tensor(16),
    }
    drift = drift_of(a, b, 4)
    assert drift.within and [t.name for t in drift.judged] == ["model.w"]
    assert "8 vs 16" in next(t.detail for t in drift.tensors if t.name.endswith("num_batches_tracked"))
    # DDP's per-rank buffers on one side only: merged as their mean and compared, never a traceback
    per_rank = {k: v for k, v in a.items() if "running_mean" not in k}
    per_rank |= {
        "model.bn.running_mean@rank0": torch.ones(4),
        "model.bn.running_mean@rank1": torch.ones(4) * 3,
    }
    drift = drift_of(per_rank, a, 4)
    mean = next(t for t in drift.tensors if t.name == "model.bn.running_mean")
    assert (
        mean.kind == "buffer" and mean.drift == pytest.approx(0.5) and "merged as their mean" in mean.detail
    )
    # no wrapper on 2 ranks: the parameters themselves per rank, the ranks trained apart: outside, saying so
    apart = {k: v for k, v in a.items() if k != "model.w"} | {"model.w@rank0": w, "model.w@rank1": w + 1}
    drift = drift_of(apart, a, 4)
    assert not drift.within and "ranks train apart" in next(t.detail for t in drift.judged)
    # a packed bias whose middle third has a zero true gradient (attention's key bias in in_proj_bias):
    # those elements set aside by the optimizer's second moment, the rest judged
    bias = torch.ones(6)
    a = _adam_like({"bias": bias, "w": w}, {}) | {
        "optim.bias.exp_avg_sq": torch.tensor([1.0, 1, 1e-30, 1e-30, 1, 1])
    }
    b = dict(a) | {"model.bias": bias + torch.tensor([0, 0, 1e-3, -1e-3, 0, 0])}
    drift = drift_of(a, b, 4)
    assert drift.within and "2 of 6 elements" in next(
        t.detail for t in drift.judged if t.name == "model.bias"
    )
    b["model.bias"] = b["model.bias"] + torch.tensor([1e-4, 0, 0, 0, 0, 0])
    assert not drift_of(a, b, 4).within
    # missing tensors: outside, naming the side
    drift = drift_of(a, {k: v for k, v in a.items() if k != "model.w"}, 4)
    assert not drift.within and "missing in the relayed run" in next(
        t.detail for t in drift.of_kind("missing")
    )


def test_the_likely_cause_of_an_outside_drift() -> None:
    from torchrelay.audit.compare import StreamComparison

    outside = Drift(
        "float32",
        4,
        [TensorDrift("model.w", "parameter", 1e4), TensorDrift("model.b", "parameter", 0.0)],
        1e-3,
        0.0,
        True,
    )
    # Nothing seen inside the processes: dropout is not named, the first differing tensors are, and "unknown".
    causes = likely_causes(LedgerDiff(8, []), {8: outside})
    assert [c["name"] for c in causes] == ["unknown", "a hyper-parameter computed from the layout"]
    assert "outside first: model.w; bit-equal: model.b" in causes[0]["evidence"], causes[0]
    # A model without dropout (the probe looked): never blamed on dropout, and the evidence says so.
    plain = StreamComparison(dropout=[], drawn=[])
    causes = likely_causes(LedgerDiff(8, []), {8: outside}, plain)
    assert causes[0]["name"] == "unknown" and "the model holds no dropout" in causes[0]["evidence"]
    # Dropout held, and updates draw from torch's generator: dropout named, with the module.
    dropped = StreamComparison(dropout=["model.drop p=0.1"], drawn=["torch"])
    causes = likely_causes(LedgerDiff(8, []), {8: outside}, dropped)
    assert [c["name"] for c in causes] == [
        "per-rank random numbers",
        "a hyper-parameter computed from the layout",
    ]
    assert (
        "tr.sample_dropout" in causes[0]["fix"]
        and "1 of 2 parameter tensors outside" in causes[0]["evidence"]
        and "model.drop p=0.1" in causes[0]["evidence"]
    )
    regrouped = LedgerDiff(
        8, [5], "update 5: the same samples, split into other micro-batches (micro_batch changed)"
    )
    assert [c["name"] for c in likely_causes(regrouped, {8: outside})] == ["a changed micro-batch"]
