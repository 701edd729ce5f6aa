"""The zoo (examples/zoo/zoo.py): every CPU member composed into one script, audited under real torchrun.

One audit covers all of them (the members share one model and loop; DeepSpeed's CPU Adam among them where a C++
compiler can build its op), stopped early and late, with the state compared at the first checkpoint after each
resume, so the whole zoo costs four launches. Also the zoo's findings in the library: state shapes that ordinary
training scripts hold.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import EXAMPLES, TORCHRUN, make_code_repo
from torchrelay.audit import AuditSpec, run_audit
from torchrelay.checkpoint.state import load_state, save_state

sys.path.insert(0, str(EXAMPLES / "zoo"))
import zoo  # noqa: E402  (the script under test: its member list)

sys.path.pop(0)


@pytest.fixture(autouse=True)
def verdict_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key in ("TORCHRELAY_RUN_DIR", "TORCHRELAY_OVERRIDES", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.launch
def test_every_cpu_member_composed_is_equal_with_early_and_late_stops(tmp_path: Path) -> None:
    code = make_code_repo(tmp_path / "code", ("zoo/zoo.py", "zoo/samples.jsonl"))
    launch = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / "zoo/zoo.py"),
    ]
    # cpu_adam: DeepSpeed compiles its CPU Adam's op (scripts/env.sh does it once); without a compiler the other
    # members run, and the zoo says which was left out
    members = list(zoo.CPU_MEMBERS)
    if shutil.which("g++") is None and shutil.which("c++") is None:
        members.remove("cpu_adam")
        print(
            "test_zoo: member cpu_adam left out: DeepSpeedCPUAdam needs its C++ op and no C++ compiler is on PATH"
        )
    spec = AuditSpec(
        launch=[*launch, "--member", ",".join(members)],
        updates=12,
        stops=2,
        vary={"num_workers": [2, 0]},  # the workers member's 2 workers, then none: the draws must not care
        work_dir=tmp_path / "work",
        keep=True,
        timeout_s=480,
    )
    verdict = run_audit(spec)
    assert verdict.equal, (verdict.summary(), verdict.causes, verdict.top_tensors, verdict.metrics_detail)
    assert verdict.stops == [1, 11]  # early and late
    assert [c["update"] for c in verdict.checkpoints] == [2, 12]
    assert all(c["differing"] == 0 and c["compared"] > 50 for c in verdict.checkpoints)

    # The members really ran: their state is in the checkpoint and their metrics in the logs.
    run = Path(verdict.run_dirs["interrupted"])
    config = json.loads((run / "config.json").read_text())
    assert config["params"]["members"] == sorted(members)
    stored = json.loads((run / "checkpoint-12" / "relay_state.json").read_text())
    tracked = set(stored["statefuls"]) | set((stored.get("per_rank") or {}).get("statefuls", []))
    assert tracked == {"scheduler", "muon_scheduler", "plateau", "ema", "scaler", "noise"}
    # muon: Muon's momentum for the classifier's matrices beside AdamW's moments for the rest, one list tracked
    from torchrelay.checkpoint.reader import load_tensors

    names = set(load_tensors(run / "checkpoint-12"))
    assert {"optim.fc.0.weight.momentum_buffer", "optim.classify.weight.momentum_buffer"} <= names
    assert "optim.fc.0.bias.exp_avg" in names and "optim.fc.0.weight.exp_avg" not in names
    groups = stored["optimizer"]["param_groups"]
    assert [g.get("adjust_lr_fn") for g in groups if "momentum" in g] == ["match_rms_adamw"]
    rows = [json.loads(x) for x in (run / "train" / "metrics-rank1.jsonl").read_text().splitlines()]
    assert {"grad_norm", "scale", "ema_w", "muon_lr"} <= set(rows[-1]) and "eval_loss" in rows[-1]
    lrs = [r["lr"] for r in rows]
    assert lrs[0] < lrs[2] and lrs[-1] < max(lrs)  # warmup, then cosine (and the plateau's cuts)
    assert len({r["scale"] for r in rows}) > 2  # the GradScaler grew: its state matters on resume
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    assert [s["runtime_changes"].get("num_workers") for s in history[1:]] == [[2, 0], [0, 2]]


def test_a_stateful_with_tied_tensors_round_trips(tmp_path: Path) -> None:
    """An EMA (AveragedModel) of a model whose embedding is its output layer: one tensor under two names."""
    from torch.optim.swa_utils import AveragedModel

    def tied(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        net[1].weight = net[0].weight
        return net

    saved = AveragedModel(tied(0))
    save_state(tmp_path, rank=0, model=None, optimizer=None, statefuls={"ema": saved}, loop={"update": 1})
    loaded = AveragedModel(tied(1))
    load_state(tmp_path, rank=0, model=None, optimizer=None, statefuls={"ema": loaded})
    assert torch.equal(loaded.module[0].weight, saved.module[0].weight)
    assert loaded.module[1].weight is loaded.module[0].weight  # still tied
