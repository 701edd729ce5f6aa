"""The audit's pieces without launches: tensor comparison, the cause heuristics, the plan, the kept verdict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torchrelay.audit import (
    DATA_ORDER,
    NONDETERMINISM,
    RNG,
    UNREGISTERED,
    AuditError,
    AuditSpec,
    Verdict,
    describe,
    last_verdict,
)
from torchrelay.audit.compare import (
    LogComparison,
    TensorComparison,
    TensorDiff,
    compare_ledgers,
    compare_metrics,
    compare_tensors,
)
from torchrelay.audit.diagnose import Evidence, diagnose
from torchrelay.audit.orchestrator import comparison_points
from torchrelay.audit.runner import choose_stops
from torchrelay.audit.verdict import save
from torchrelay.cli import main
from torchrelay.commands.audit import parse_vary
from torchrelay.paths.rundir import RunDir


def test_tensors_bit_for_bit_and_within_atol():
    a = {"w": torch.ones(3), "z": torch.zeros(1), "gone": torch.zeros(2)}
    b = {"w": torch.ones(3) + torch.tensor([0.0, 1e-6, 0.0]), "z": -torch.zeros(1), "new": torch.zeros(2)}
    exact = compare_tensors(a, b)
    assert [d.name for d in exact.differing] == ["gone", "new", "w", "z"]  # missing first (inf), then by size
    assert math.isinf(exact.differing[0].max_abs) and "missing" in exact.differing[0].note
    assert "signed zero" in exact.differing[3].note
    loose = compare_tensors({"w": a["w"]}, {"w": b["w"]}, atol=1e-5)
    assert loose.equal and loose.compared == 1
    shaped = compare_tensors({"w": torch.ones(2)}, {"w": torch.ones(3)})
    assert "shape" in shaped.differing[0].note


def _write_logs(run: Path, lrs: list[float], losses: list[float], ledger: list[list[int]]) -> None:
    (run / "train").mkdir(parents=True)
    with (run / "train" / "metrics-rank0.jsonl").open("w") as f:
        for u, (lr, loss) in enumerate(zip(lrs, losses), start=1):
            f.write(
                json.dumps({"update": u, "loss": loss, "lr": lr, "update_time": u * 0.1, "time": 1e9 + u})
                + "\n"
            )
    with (run / "train" / "exposures-rank0.jsonl").open("w") as f:
        for u, ids in enumerate(ledger, start=1):
            f.write(json.dumps({"u": u, "m": 0, "i": ids}) + "\n")


def test_logs_part_where_they_differ_and_ignore_timing(tmp_path):
    _write_logs(tmp_path / "a", [1.0] * 4, [4.0, 3.0, 2.0, 1.0], [[0], [1], [2], [3]])
    _write_logs(tmp_path / "b", [1.0, 1.0, 0.5, 0.5], [4.0, 3.0, 2.0, 1.5], [[0], [1], [3], [2]])
    metrics = compare_metrics(RunDir(tmp_path / "a"), RunDir(tmp_path / "a"))
    assert metrics.equal
    metrics = compare_metrics(RunDir(tmp_path / "a"), RunDir(tmp_path / "b"))
    assert (metrics.first_update, metrics.keys, metrics.first_by_key) == (3, ["lr"], {"lr": 3, "loss": 4})
    assert (
        compare_metrics(RunDir(tmp_path / "a"), RunDir(tmp_path / "b"), ignore=frozenset({"lr"})).first_update
        == 4
    )
    ledger = compare_ledgers(RunDir(tmp_path / "a"), RunDir(tmp_path / "b"))
    assert ledger.first_update == 3 and "rank 0 update 3" in ledger.detail


def _parted(update: int | None, keys: tuple[str, ...] = ("loss",)) -> LogComparison:
    if update is None:
        return LogComparison(what="x")
    return LogComparison(
        what="x", first_update=update, rank=0, keys=list(keys), first_by_key=dict.fromkeys(keys, update)
    )


def _tensors(differ: bool = True) -> TensorComparison:
    return TensorComparison(compared=2, differing=[TensorDiff("model.w", 0.1)] if differ else [])


@pytest.mark.parametrize(
    ("metrics", "ledger", "rerun", "expected"),
    [
        (_parted(5), _parted(5, ("i",)), None, DATA_ORDER),  # the samples differ after the resume at 5
        (_parted(5, ("loss", "lr")), _parted(None), None, UNREGISTERED),  # LR starts over at the resume
        (_parted(5), _parted(None), None, RNG),  # only the random stream after the resume
        (
            _parted(2),
            _parted(None),
            "update 2 differs",
            NONDETERMINISM,
        ),  # before any stop: not a resume issue
        (
            _parted(7),
            _parted(None),
            "update 7 differs",
            NONDETERMINISM,
        ),  # mid-segment, and a rerun differs too
        (_parted(7), _parted(None), None, UNREGISTERED),  # mid-segment, reruns agree: lost state used later
    ],
)
def test_cause_heuristics(metrics, ledger, rerun, expected):
    calls = []

    def again():
        calls.append(1)
        return rerun

    causes = diagnose(Evidence(stops=[4, 8], metrics=metrics, ledger=ledger, tensors=_tensors()), again)
    assert causes[0].name == expected, causes
    # The costly second run is launched only when the evidence alone cannot tell.
    assert bool(calls) == (expected == NONDETERMINISM or metrics.first_update == 7)


def test_equal_runs_have_no_cause():
    assert (
        diagnose(Evidence(stops=[3], metrics=_parted(None), ledger=_parted(None), tensors=_tensors(False)))
        == []
    )


def test_stops_are_planned_inside_the_run_from_early_to_late():
    # The first stop after update 1, the last one update before the end (a late resume leaves nothing to fade).
    assert choose_stops(12, 3) == [1, 6, 11]
    assert choose_stops(10, 3) == [1, 5, 9]
    assert choose_stops(12, 1) == [11] and choose_stops(3, 2) == [1, 2]
    assert len(choose_stops(12, 11)) == 11
    # Both runs are compared at the first checkpoint after each resume, and at the end.
    assert comparison_points([1, 6, 11], 12) == [2, 7, 12]
    assert comparison_points([4, 5], 8) == [5, 6, 8]
    import random

    drawn = choose_stops(10, 3, rng=random.Random(1))
    assert len(drawn) == 3 and all(1 <= a < 10 for a in drawn)
    with pytest.raises(AuditError, match="between 1 and 9"):
        choose_stops(10, 10)
    with pytest.raises(AuditError, match="every stop must lie in 1..9"):
        AuditSpec(launch=["x"], updates=10, stop_at=[0, 3]).stop_updates()
    with pytest.raises(AuditError, match="no launch command"):
        AuditSpec(launch=[])


def test_vary_parsing():
    assert parse_vary(["num_workers=0,2", "mode=fast"]) == {"num_workers": [0, 2], "mode": ["fast"]}
    with pytest.raises(AuditError, match="expected FIELD=V1,V2"):
        parse_vary(["num_workers"])


def test_cli_refuses_a_missing_launch(capsys):
    assert main(["audit", "--updates", "4"]) == 1
    assert "no launch command" in capsys.readouterr().err


def test_verdict_is_kept_per_script_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    v = Verdict(
        equal=False,
        launch=["torchrun", str(script)],
        script=str(script),
        script_sha256=None,
        updates=8,
        stops=[4],
        causes=[{"name": RNG, "evidence": "e", "fix": "f"}],
        run_dirs={"interrupted": str(run_dir)},
    )
    save(v)
    assert json.loads((run_dir / "AUDIT.json").read_text())["causes"][0]["name"] == RNG
    found = last_verdict(script)
    assert found is not None and found["equal"] is False and "NOT equal; likely cause: RNG" in describe(found)
    script.write_text("print('v2')\n")
    assert last_verdict(script) is None  # the verdict was for another version of the script
    stale = last_verdict(script, any_version=True)
    assert stale is not None and stale["stale"] is True and "script changed since" in describe(stale)
    assert last_verdict(tmp_path / "never.py") is None


def test_status_finds_the_verdict_for_a_run_of_the_audited_code(tmp_path, monkeypatch):
    from torchrelay.audit import verdict_for_run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = {"commit": "abc", "tree": "def", "dirty": False, "dirty_sha256": None}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "history.jsonl").write_text(json.dumps({"segment": "s1", "code": code}) + "\n")
    assert verdict_for_run(run_dir) is None
    for name, equal, when in (("a.py", True, 1.0), ("b.py", False, 2.0)):
        save(
            Verdict(
                equal=equal,
                launch=[name],
                script=str(tmp_path / name),
                script_sha256=None,
                updates=8,
                stops=[4],
                code=code,
                time=when,
            )
        )
    shown = verdict_for_run(run_dir)
    assert shown is not None and shown["script"] == str(tmp_path / "b.py")
    assert "newest of 2 scripts audited at this code" in shown["verdict"]
    (run_dir / "history.jsonl").write_text(
        json.dumps({"segment": "s1", "code": {**code, "commit": "zzz"}}) + "\n"
    )
    assert verdict_for_run(run_dir) is None  # other code: no verdict applies


def test_stream_digests_separate_a_restarted_generator_from_lost_state(tmp_path):
    from torchrelay.audit.compare import compare_streams

    def write(run: str, rank: int, streams: list[list[str]]) -> None:
        folder = tmp_path / run
        folder.mkdir(exist_ok=True)
        with open(folder / f"streams-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"update": 5, "streams": streams}) + "\n")

    for rank in (0, 1):
        write("a", rank, [["torch.Generator", f"g{rank}-advanced"], ["random.Random", "same"]])
        write("b", rank, [["torch.Generator", f"g{rank}-restarted"], ["random.Random", "same"]])
        write("c", rank, [["random.Random", "same"], ["torch.Generator", f"g{rank}-advanced"]])
    restarted, continued = (
        compare_streams(tmp_path / "a", tmp_path / "b"),
        compare_streams(tmp_path / "a", tmp_path / "c"),
    )
    assert restarted.at[5] == (4, ["torch.Generator", "torch.Generator"])
    assert continued.at[5] == (4, []) and continued.seen(5) and not continued.seen(6)

    def cause(streams):
        ev = Evidence(
            stops=[4], metrics=_parted(5), ledger=_parted(None), tensors=_tensors(), streams=streams
        )
        return diagnose(ev)

    assert [c.name for c in cause(restarted)] == [RNG]
    assert "2 random stream(s) the script holds (torch.Generator)" in cause(restarted)[0].evidence
    assert [c.name for c in cause(continued)] == [UNREGISTERED, RNG]
    assert (
        "all 4 random stream(s) the script holds start it in the same state" in cause(continued)[0].evidence
    )
    assert [c.name for c in cause(None)] == [RNG, UNREGISTERED]  # without the probe: both, RNG first


def test_state_tensors_name_state_that_differs_by_rank(tmp_path):
    """A tensor that differs between the uninterrupted run's ranks and comes back otherwise is named as such; one
    that is equal on every rank and comes back otherwise is unregistered state, by name."""
    from torchrelay.audit.compare import compare_streams
    from torchrelay.audit.diagnose import RANK_STATE

    def write(run: str, rank: int, tensors: dict[str, str]) -> None:
        folder = tmp_path / run
        folder.mkdir(exist_ok=True)
        line = {"update": 5, "streams": [], "tensors": tensors}
        (folder / f"streams-rank{rank}.jsonl").write_text(json.dumps(line) + "\n")

    # BatchNorm statistics under DDP as torchrelay 0.1.0 saved them: one rank's copy (here rank 0's) for all.
    for rank in (0, 1):
        write("straight", rank, {"model.bn.running_mean": f"rank{rank}", "model.mask": "same"})
        write("one-copy", rank, {"model.bn.running_mean": "rank0", "model.mask": "same"})
        write("per-rank", rank, {"model.bn.running_mean": f"rank{rank}", "model.mask": "same"})
        write("lost", rank, {"model.bn.running_mean": f"rank{rank}", "model.mask": "fresh"})
    one_copy = compare_streams(tmp_path / "straight", tmp_path / "one-copy")
    assert one_copy.across_ranks[5] == ["model.bn.running_mean"]
    assert one_copy.lost_tensors(5) == [(1, "model.bn.running_mean")]
    assert compare_streams(tmp_path / "straight", tmp_path / "per-rank").lost_tensors(5) == []

    def cause(run: str) -> list:
        streams = compare_streams(tmp_path / "straight", tmp_path / run)
        return diagnose(
            Evidence(stops=[4], metrics=_parted(5), ledger=_parted(None), tensors=_tensors(), streams=streams)
        )

    named = cause("one-copy")
    assert [c.name for c in named] == [RANK_STATE]
    assert (
        "model.bn.running_mean differ between the ranks of the uninterrupted run at the stop"
        in named[0].evidence
    )
    assert "other values of them on rank(s) 1" in named[0].evidence and "run.track" in named[0].fix
    lost = cause("lost")
    assert [c.name for c in lost] == [UNREGISTERED]
    assert "model.mask start update 5 in another state" in lost[0].evidence
    # BatchNorm in training mode normalizes with the batch's statistics: the logs agree, only the saved tensors
    # differ. The probe still names the cause, and no second uninterrupted run is needed for it.
    quiet = Evidence(
        stops=[4],
        metrics=_parted(None),
        ledger=_parted(None),
        tensors=_tensors(),
        streams=compare_streams(tmp_path / "straight", tmp_path / "one-copy"),
    )
    causes = diagnose(quiet, rerun=lambda: pytest.fail("no rerun needed"))
    assert [c.name for c in causes] == [RANK_STATE] and "the logs agree but 1 tensor(s) differ" in causes[
        0
    ].evidence


class _BestLoss:
    """nanoGPT's `best_val_loss` kept in a registered stateful; `forget` makes its load_state_dict drop it."""

    def __init__(self, best: float, evals: int = 3, tag: str = "val") -> None:
        self.best, self.evals, self.tag = best, evals, tag

    def state_dict(self) -> dict[str, object]:
        return {"best_val_loss": self.best, "evals": self.evals, "meta": {"tag": self.tag, "hist": [1, 2]}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.best, self.evals = state["best_val_loss"], state["evals"]  # type: ignore[assignment]


def _saved(path: Path, holder: _BestLoss, lr: float = 0.1) -> Path:
    from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory
    from torchrelay.checkpoint.state import save_state

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path.mkdir(parents=True)
    torch.manual_seed(1)
    save_state(path, rank=0, model=model, optimizer=opt, statefuls={"best": holder}, loop={"update": 4})
    write_inventory(path, inventory_entries(path, list_files(path)), update=4)
    return path


def test_a_forgotten_number_of_a_registered_stateful_is_named_by_its_key(tmp_path):
    from torchrelay.audit.compare import compare_checkpoints

    a = _saved(tmp_path / "a", _BestLoss(3.975))
    same = compare_checkpoints(a, _saved(tmp_path / "same", _BestLoss(3.975)))
    assert same.equal and same.values_compared >= 6 and same.compared >= 3  # values and tensors, rng included
    b = _saved(tmp_path / "b", _BestLoss(1e9))
    found = compare_checkpoints(a, b)
    assert [d.name for d in found.differing] == ["state/best.best_val_loss"]
    assert found.differing[0].note == "value 3.975 vs 1000000000.0"
    # a string in a nested container, an int, the optimizer's param groups: each named by its path
    c = _saved(tmp_path / "c", _BestLoss(3.975, evals=4, tag="train"), lr=0.2)
    names = {d.name for d in compare_checkpoints(a, c).differing}
    assert {"state/best.evals", "state/best.meta.tag", "optim.param_groups.0.lr"} <= names
    # -0.0 is not 0.0, as for tensors; within --atol a number may differ
    d = _saved(tmp_path / "d", _BestLoss(3.975 + 1e-9))
    assert compare_checkpoints(a, d, atol=1e-6).equal and not compare_checkpoints(a, d).equal


def test_a_value_that_only_a_stateful_lost_at_the_resume_is_named_not_restored():
    from torchrelay.audit import NOT_RESTORED

    diff = TensorDiff("state/best.best_val_loss", 1e9, "value 3.975 vs 1000000000.0")
    other = TensorDiff("state/best@rank1.best_val_loss", 1e9, "value 3.5 vs 1000000000.0")
    ev = Evidence(
        stops=[4],
        metrics=LogComparison(what="metrics"),
        ledger=LogComparison(what="ledger"),
        tensors=TensorComparison(compared=10, differing=[diff, other], values_compared=5),
        tensors_at=5,
        final_equal=False,
    )
    causes = diagnose(ev, rerun=lambda: pytest.fail("the evidence suffices: no rerun"))
    assert causes[0].name == NOT_RESTORED
    assert "state/best.best_val_loss (value 3.975 vs 1000000000.0)" in causes[0].evidence
    assert "the registered best saved these values" in causes[0].evidence


def test_a_stream_unseeded_in_both_launches_is_named_without_a_second_run():
    from torchrelay.audit import UNSEEDED
    from torchrelay.audit.compare import StreamComparison

    # Both runs' first launches hold the global `random` in another state at the start of update 1.
    streams = StreamComparison(at={1: (0, ["random (global)"]), 2: (0, ["random (global)"])})
    ev = Evidence(stops=[4], metrics=_parted(1), ledger=_parted(None), tensors=_tensors(), streams=streams)
    causes = diagnose(ev, rerun=lambda: pytest.fail("the probe's evidence suffices"))
    assert [c.name for c in causes] == [UNSEEDED]
    assert "random (global) start update 1 in another state in two launches" in causes[0].evidence
    # Every stream alike at update 1 and a second run differs: then, and only then, the launches do not repeat.
    alike = StreamComparison(at={1: (2, [])})
    ev = Evidence(stops=[4], metrics=_parted(1), ledger=_parted(None), tensors=_tensors(), streams=alike)
    causes = diagnose(ev, rerun=lambda: "update 1 differs")
    assert causes[0].name == NONDETERMINISM
    assert "the global generators start update 1 in the same state" in causes[0].evidence


def test_no_cause_is_guessed_where_the_evidence_names_none():
    from torchrelay.audit import UNKNOWN

    # Parting mid-segment with no second run to tell: "unknown", with the first differing values; no dropout.
    ev = Evidence(
        stops=[4],
        metrics=_parted(7),
        ledger=_parted(None),
        tensors=_tensors(),
        tensors_at=8,
        final_equal=False,
    )
    causes = diagnose(ev, rerun=None)
    assert [c.name for c in causes] == [UNKNOWN]
    assert "first differing values in checkpoint-8: model.w by 0.1" in causes[0].evidence
    # At a resume without the probe: a restarted stream, never dropout (the model may have none).
    ev = Evidence(stops=[4], metrics=_parted(5), ledger=_parted(None), tensors=_tensors())
    assert all("dropout" not in c.evidence for c in diagnose(ev))


def test_the_probes_global_generators_tell_unseeded_streams_and_the_updates_that_draw(tmp_path):
    from torchrelay.audit.compare import compare_streams

    def write(run: str, rows: list[dict[str, object]]) -> Path:
        folder = tmp_path / run
        folder.mkdir()
        (folder / "streams-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    base = {"random": "r1", "numpy": "n1", "torch": "t1"}
    a = write(
        "a",
        [
            {"update": 1, "streams": [], "globals": base, "dropout": []},
            {"update": 2, "streams": [], "globals": {**base, "random": "r2"}, "dropout": []},
        ],
    )
    b = write(
        "b",
        [
            {"update": 1, "streams": [], "globals": {**base, "random": "x1"}, "dropout": []},
            {"update": 2, "streams": [], "globals": {**base, "random": "x2"}, "dropout": []},
        ],
    )
    found = compare_streams(a, b)
    assert found.unseeded() == ["random (global)"]  # the two fresh launches hold `random` apart at update 1
    assert found.drawn == ["random"]  # an update draws from it (torch's stays)
    assert found.dropout == []  # the probe looked: no dropout module
    assert compare_streams(tmp_path / "none", tmp_path / "none").dropout is None  # no probe: nothing claimed


def test_the_probe_lists_dropout_that_draws_and_digests_the_global_generators():
    import random

    from torchrelay.audit.probe import dropout_modules, global_streams

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.25), torch.nn.Dropout(0.0))
    assert "net.1 p=0.25" in dropout_modules() and not any(m.startswith("net.2") for m in dropout_modules())
    before = global_streams()
    assert {"random", "numpy", "torch"} <= set(before)
    random.random()
    after = global_streams()
    assert after["random"] != before["random"] and after["torch"] == before["torch"]
    del net


def test_the_audit_names_the_first_update_after_which_the_parameters_part(tmp_path):
    from torchrelay.audit.compare import compare_digests

    def write(run: str, digests: dict[int, list[str]]) -> RunDir:
        (tmp_path / run / "train").mkdir(parents=True)
        for rank, rows in digests.items():
            lines = [json.dumps({"u": u, "params": d, "n": 4}) for u, d in enumerate(rows, start=1)]
            (tmp_path / run / "train" / f"digests-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
        return RunDir(tmp_path / run)

    a = write("a", {0: ["a1", "a2", "a3", "a4"], 1: ["b1", "b2", "b3", "b4"]})
    assert compare_digests(a, write("same", {0: ["a1", "a2", "a3", "a4"], 1: ["b1", "b2", "b3", "b4"]})).equal
    parted = compare_digests(a, write("b", {0: ["a1", "a2", "a3", "x4"], 1: ["b1", "b2", "y3", "y4"]}))
    assert (parted.first_update, parted.rank) == (3, 1)
    assert parted.detail == "the parameters after update 3 differ on rank(s) 1"


def test_a_refused_segment_is_said_by_the_rank_s_own_line_not_torchrun_s_report(tmp_path: Path) -> None:
    from torchrelay.audit.runner import said

    # the head of a real log: certify replaying a 1-rank checkpoint on 2 ranks without TORCHRELAY_RESHARD
    log = tmp_path / "certify-segment1.log"
    log.write_text(
        "torchrelay: resume refused: the training contract in /r/resume_contract.json differs in 2 field(s):\n"
        "  global_batch: 8 -> 16\n"
        "  world_size: 1 -> 2\n"
        "  hint: continue with the same global batch: on 2 rank(s) with micro_batch 2 keep it with grad_accum 2 "
        "(`launch --reshard` or TORCHRELAY_RESHARD=1 derives grad_accum)\n"
        "W1207 07:16:06.115000 32578 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1\n"
        "Traceback (most recent call last):\n"
        + '  File "/venv/bin/torchrun", line 8, in <module>\n' * 30
        + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    message, hint = said(log) or ("", None)
    assert message == (
        "resume refused: the training contract in /r/resume_contract.json differs in 2 field(s): "
        "global_batch: 8 -> 16; world_size: 1 -> 2"
    )
    assert hint is not None and hint.startswith("continue with the same global batch: on 2 rank(s)")
    (tmp_path / "rank1.log").write_text(
        "x\ntorchrelay [rank 1]: training: rank 1 lost its peers (closed)\nend\n"
    )
    assert said(tmp_path / "rank1.log") == ("training: rank 1 lost its peers (closed)", None)
    assert said(tmp_path / "none.log") is None
