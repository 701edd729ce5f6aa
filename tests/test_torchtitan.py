"""torchtitan 0.3 as a torchrelay run: RelayCheckpointManager and RelayTokenLoader under tests/titan_loop.py (the
Trainer's construction order and train loop, by hand: torchtitan's own Trainer needs CUDA and triton), 2 ranks under
torchrun, DDP on gloo.

Uninterrupted, and stopped by a request after update 3, then by a budget, then finished on another loader worker
count: every parameter and optimizer tensor torch.equal, the LR schedulers' and the trainer's state equal, each
rank's RNG after training equal, the ledger exact. torchtitan options that choose what to load are refused in one
line (in-process). Skipped where torchtitan is not installed (`pip install torchtitan==0.3.0`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import (
    REPO,
    TORCHRUN,
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    make_code_repo,
    run_tree,
    segments,
)
from torchrelay.cli import main
from torchrelay.errors import ConfigError
from torchrelay.ledger.exposure import prove

pytest.importorskip("torchtitan.components.checkpointer")

U = 8  # 40 windows, a global batch of 2 x 2 micro-batches x 2 ranks: 5 updates an epoch
SEQ = 16


def _data(root: Path) -> Path:
    import torchrelay as tr

    root.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(7).integers(0, 256, size=40 * SEQ + 1, dtype=np.uint16)
    tokens.tofile(root / "train.bin")
    tr.token_manifest([root / "train.bin"], root / "train.jsonl", block_size=SEQ)
    return root


def _launch(
    code: Path, dump: Path, data: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / "titan_loop.py"),
    ]
    cmd += ["--dump", str(dump), "--data", str(data), "--steps", str(U), *extra]
    out = run_tree(cmd, timeout=300, env=clean_env(**(env or {})), cwd=code)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("titan-code") / "code"
    dest.mkdir()
    shutil.copyfile(REPO / "tests" / "titan_loop.py", dest / "titan_loop.py")
    return make_code_repo(dest, scripts=())


@pytest.mark.launch
def test_torchtitan_stopped_and_resumed_ends_bit_exact(code: Path, tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    ref_dump = tmp_path / "uninterrupted"
    rc, out = _launch(code, ref_dump, data)
    assert rc == 0, out
    ref = ref_dump / "checkpoint"  # the run directory is torchtitan's checkpoint folder
    assert [(s["first_update"], s["last_update"], s["ended"]) for s in segments(ref)] == [(1, U, "finished")]

    dump = tmp_path / "stopped"
    run = dump / "checkpoint"
    run.mkdir(parents=True)
    main(["stop", str(run), "--at-update", "3", "--before-start"])
    rc, out = _launch(code, dump, data)
    assert rc != 0 and "exitcode  : 4" in out, out
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 3, out
    rc, out = _launch(code, dump, data, "--workers", "1", env={"TORCHRELAY_BUDGET_S": "0.5"})
    assert segments(run)[-1]["ended"] == "budget" and segments(run)[-1]["last_update"] == 3, out
    rc, out = _launch(code, dump, data, "--workers", "2")
    assert rc == 0, out
    assert [s["ended"] for s in segments(run)] == ["request", "budget", "finished"]

    # model, AdamW state (the OptimizersContainer's FQN-keyed dict), LR schedulers, the trainer's step and tokens
    assert assert_same_final_state(ref, run, U) >= 4
    assert_same_logs(ref, run)  # per-rank exposures and metrics
    for r in range(2):
        a, b = torch.load(ref_dump / f"rng-rank{r}.pt"), torch.load(dump / f"rng-rank{r}.pt")
        assert torch.equal(a["rand"], b["rand"])  # the rank's RNG, restored, moved alike
        assert (a["step"], a["ntokens_seen"]) == (b["step"], b["ntokens_seen"]) == (U, U * 2 * 2 * SEQ)
    for done in (ref, run):
        ledger = prove(done)
        assert ledger.ok and ledger.exposures == U * 8


@pytest.mark.parametrize(
    "setting,named",
    [
        ({"load_only": True}, "checkpoint.load_only"),
        ({"initial_load_path": "/ckpt"}, "checkpoint.initial_load_path"),
        ({"exclude_from_loading": ["optimizer"]}, "checkpoint.exclude_from_loading"),
        ({"manifest": ""}, "checkpoint.manifest"),
    ],
)
def test_torchtitan_options_that_choose_what_to_load_are_refused(setting: dict, named: str) -> None:
    from torchrelay.integrations.torchtitan import RelayCheckpointManager

    fields = {"enable": True, "manifest": "m.jsonl", **setting}
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        RelayCheckpointManager.Config(**fields).build(
            dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
        )


@pytest.mark.launch
def test_torchtitan_resumes_on_another_data_parallel_size(code: Path, tmp_path: Path) -> None:
    """What torchtitan's own checkpoint refuses: stopped on 2 ranks, finished on 1 (the Trainer's gradient
    accumulation 2 -> 4, the global batch kept); the ledger proves every window of the run's order, once."""
    data = _data(tmp_path / "data")
    dump = tmp_path / "run"
    run = dump / "checkpoint"
    run.mkdir(parents=True)
    main(["stop", str(run), "--at-update", "3", "--before-start"])
    rc, out = _launch(code, dump, data)
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 3, out
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=1", str(code / "titan_loop.py")]
    cmd += ["--dump", str(dump), "--data", str(data), "--steps", str(U)]
    done = run_tree(cmd, timeout=300, env=clean_env(TORCHRELAY_RESHARD="1"), cwd=code)
    assert done.returncode == 0, done.stdout + done.stderr
    last = segments(run)[-1]
    assert (last["ended"], last["resumed_from"], last["last_update"]) == ("finished", 3, U)
    ledger = prove(run)
    assert ledger.ok and ledger.exposures == U * 8 and ledger.repeats == 0
