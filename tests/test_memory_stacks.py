"""The memory tier (issue 52) under training code torchrelay did not write: Hugging Face Trainer (plain, with
DeepSpeed ZeRO-2, with FSDP2 through accelerate), Lightning, FSDP2 with Muon (LingBot's shape) and nanoGPT's token
loop. Each run saves to memory every update and durably less often,
is SIGKILLed whole (launcher, ranks, workers) once its memory tier holds a checkpoint newer than its durable one,
and is launched again: the relaunch resumes from the memory tier, every update's parameter digest on every rank
(records/digests.py) equals the uninterrupted run's, the end is bit for bit the uninterrupted run's and the ledger
is proved. Real torchrun launches on CPU (gloo)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import (
    REPO,
    TORCHRUN,
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    make_code_repo,
    run_tree,
    segments,
    torchrun_cmd,
    write_config,
)
from kill_campaign import kill_job
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.checkpoint.tiers import memory_root
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir
from torchrelay.records.digests import read_digests
from torchrelay.util.proctree import Tree

pytestmark = pytest.mark.launch
# memory every update, durably every 8 (the examples' own cadence is shorter): a kill after 9 leaves memory ahead
TIER = json.dumps({"memory_every": 1, "save_every": 8})


@pytest.fixture
def tier_runs() -> Iterator[list[Path]]:
    """Run directories whose memory tier (in /dev/shm) is removed after the test, whatever it left."""
    runs: list[Path] = []
    yield runs
    for run in runs:
        if (run / "lineage.json").exists():
            shutil.rmtree(_memory_root(run).parent, ignore_errors=True)


def _memory_root(run: Path) -> Path:
    return memory_root(json.loads((run / "lineage.json").read_text())["lineage"], RunDir(run))


def _newest(root: Path) -> int:
    """The newest complete checkpoint under `root` (0: none)."""
    return max((c.update for c in list_checkpoints(root) if c.complete), default=0)


def _kill_once_memory_leads(cmd: list[str], run: Path, env: dict[str, str], cwd: Path, past: int) -> int:
    """Launch `cmd`, SIGKILL the whole job once the memory tier holds a checkpoint past update `past` and past the
    newest durable one; returns the newest memory checkpoint the kill left."""
    log = run.with_name(f"{run.name}-killed.log")  # a file, not a pipe no one reads while the job runs
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(**env), cwd=cwd, start_new_session=True
        )
    tree = Tree(proc.pid)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        tree.collect()
        if (run / "lineage.json").exists():
            memory = _newest(_memory_root(run)) if _memory_root(run).exists() else 0
            if memory > max(past, _newest(run)):
                break
        time.sleep(0.01)
    assert proc.poll() is None, f"the job ended first: {log.read_text()[-4000:]}"
    kill_job(tree, proc)  # type: ignore[arg-type]
    held, durable = _newest(_memory_root(run)), _newest(run)
    assert held > durable, (held, durable)
    return held


def _assert_resumed_from_memory_and_equal(
    ref: Path, run: Path, held: int, total: int, ranks: int = 2
) -> None:
    seg = segments(run)[-1]
    assert (seg["resumed_tier"], seg["resumed_from"], seg["ended"]) == ("memory", held, "finished"), seg
    # every update's parameter digest on every rank, the resumed one's included (those up to `held` were written
    # by the killed launch, the rest by the relaunch from the memory checkpoint)
    want, got = read_digests(RunDir(ref)), read_digests(RunDir(run))
    assert sorted(got) == list(range(ranks)) and all(sorted(got[r]) == list(range(1, total + 1)) for r in got)
    assert got == want
    assert assert_same_final_state(ref, run, total) > 10
    assert_same_logs(ref, run, ranks)
    assert prove(run).ok
    assert not _memory_root(run).exists()  # a finished run's memory tier is given back


# ---------------------------------------------------------------------------------------------- HF Trainer
@pytest.fixture(scope="module")
def trainer_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("trainer-code") / "code"
    return make_code_repo(dest, ("train_hf_trainer.py",), wrappers=("trainer_paced.py",))


def _trainer_cmd(code: Path, run: Path) -> list[str]:
    return [
        TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(code / "trainer_paced.py"),
        "--output-dir", str(run),
    ]  # fmt: skip


def test_trainer_killed_resumes_from_the_memory_tier_bit_exact(
    trainer_code: Path, tmp_path: Path, tier_runs: list[Path]
) -> None:
    """examples/train_hf_trainer.py (12 updates, save_steps 4) with the tier on through TORCHRELAY_OVERRIDES."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    out = run_tree(_trainer_cmd(trainer_code, ref), timeout=300, env=clean_env(), cwd=trainer_code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    env = {"TORCHRELAY_OVERRIDES": TIER, "TRAINER_PACE_S": "0.3"}
    held = _kill_once_memory_leads(_trainer_cmd(trainer_code, run), run, env, trainer_code, past=8)
    out = run_tree(
        _trainer_cmd(trainer_code, run),
        timeout=300,
        env=clean_env(TORCHRELAY_OVERRIDES=TIER),
        cwd=trainer_code,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _assert_resumed_from_memory_and_equal(ref, run, held, 12)


def test_trainer_deepspeed_zero2_killed_resumes_from_the_memory_tier_bit_exact(
    tmp_path: Path, tier_runs: list[Path]
) -> None:
    """examples/train_hf_trainer_deepspeed.py (Trainer(deepspeed=...), ZeRO-2 on CPU): the engine writes its own
    files inline, into the memory tier's checkpoint as into a durable one; on one node the tier runs
    (tiers.tier_at_open turns it off on several, in one line: tests/test_replica_units.py)."""
    pytest.importorskip("deepspeed")
    code = make_code_repo(
        tmp_path / "code", ("train_hf_trainer_deepspeed.py",), wrappers=("trainer_paced.py",)
    )
    ds = {"TRAINER_EXAMPLE": "train_hf_trainer_deepspeed", "DS_ACCELERATOR": "cpu"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    out = run_tree(_trainer_cmd(code, ref), timeout=400, env=clean_env(**ds), cwd=code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    env = {**ds, "TORCHRELAY_OVERRIDES": TIER, "TRAINER_PACE_S": "0.3"}
    held = _kill_once_memory_leads(_trainer_cmd(code, run), run, env, code, past=8)
    out = run_tree(
        _trainer_cmd(code, run), timeout=400, env=clean_env(**ds, TORCHRELAY_OVERRIDES=TIER), cwd=code
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _assert_resumed_from_memory_and_equal(ref, run, held, 12)


def test_trainer_fsdp2_killed_resumes_from_the_memory_tier_bit_exact(
    tmp_path: Path, tier_runs: list[Path]
) -> None:
    """tests/trainer_fsdp2.py's worker: Trainer with FSDP2 through accelerate (fully_shard per decoder layer, each
    rank saving its DTensor shards of the model and AdamW's moments), 12 updates, save_steps 4."""
    import argparse

    import trainer_fsdp2 as bench

    ref, run = tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    opt = argparse.Namespace(nproc=2, device="cpu", pace=0.0)
    assert bench._launch(opt, ref, "fp32", 0, tmp_path / "ref.log") == 0, bench._tail(tmp_path / "ref.log")
    paced = bench._cmd(argparse.Namespace(nproc=2, device="cpu", pace=0.3), run, "fp32", 0)
    held = _kill_once_memory_leads(paced, run, {"TORCHRELAY_OVERRIDES": TIER}, REPO, past=8)
    out = run_tree(
        bench._cmd(opt, run, "fp32", 0), timeout=300, env=clean_env(TORCHRELAY_OVERRIDES=TIER), cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _assert_resumed_from_memory_and_equal(ref, run, held, 12)


# ----------------------------------------------------------------------------------------------- Lightning
@pytest.fixture(scope="module")
def lightning_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pytorch_lightning")
    dest = tmp_path_factory.mktemp("lightning-code") / "code"
    return make_code_repo(dest, ("train_lightning.py",), wrappers=("lightning_paced.py",))


def _lightning_cmd(code: Path, run: Path) -> list[str]:
    return torchrun_cmd(code, run, script="lightning_paced.py")


def test_lightning_killed_resumes_from_the_memory_tier_bit_exact(
    lightning_code: Path, tmp_path: Path, tier_runs: list[Path]
) -> None:
    """examples/train_lightning.py (12 updates over 3 epochs, save_every 4) with the tier on through
    TORCHRELAY_OVERRIDES: killed in its third epoch, resumed there from memory by a launch without the tier."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    out = run_tree(_lightning_cmd(lightning_code, ref), timeout=300, env=clean_env(), cwd=lightning_code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    env = {"TORCHRELAY_OVERRIDES": TIER, "LIGHTNING_PACE_S": "0.3"}
    held = _kill_once_memory_leads(_lightning_cmd(lightning_code, run), run, env, lightning_code, past=8)
    # launched again as the example is (no memory tier, durable every 4): the memory checkpoint still serves
    out = run_tree(_lightning_cmd(lightning_code, run), timeout=300, env=clean_env(), cwd=lightning_code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert segments(run)[-1]["runtime_changes"] == {"memory_every": [1, 0], "save_every": [8, 4]}
    _assert_resumed_from_memory_and_equal(ref, run, held, 12)


# ------------------------------------------------------------------------------------ FSDP2 + Muon (LingBot)
# examples/train_lm.py's LingBot shape: FSDP2 (fully_shard per block and the root: DTensor parameters and
# optimizer state), bf16 compute with fp32 reduction and fp32 shards, torch.optim.Muon on the blocks' matrices
LINGBOT = {
    "params.dropout": 0.0,
    "params.parallel": "fsdp2",
    "params.mixed": "bf16",
    "params.optimizer": "muon",
    "params.muon_lr": 0.02,
}


def test_fsdp2_muon_killed_resumes_from_the_memory_tier_bit_exact(
    example: dict[str, Path], tmp_path: Path, tier_runs: list[Path]
) -> None:
    """examples/train_lm.py on FSDP2 with Muon (16 updates, save_every 8), paced by its runtime min_update_s."""
    config = write_config(tmp_path / "lingbot.yaml", example["manifest"], example["root"], **LINGBOT)
    code, ref, run = example["code"], tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    out = run_tree(torchrun_cmd(code, ref, config=config), timeout=300, env=clean_env(), cwd=code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    paced = {"memory_every": 1, "params.min_update_s": 0.3}
    held = _kill_once_memory_leads(torchrun_cmd(code, run, config=config, sets=paced), run, {}, code, past=8)
    out = run_tree(
        torchrun_cmd(code, run, sets={"params.min_update_s": 0}), timeout=300, env=clean_env(), cwd=code
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _assert_resumed_from_memory_and_equal(ref, run, held, 16)


# ------------------------------------------------------------------------------------- nanoGPT's token loop
def test_tokens_killed_resumes_from_the_memory_tier_bit_exact(tmp_path: Path, tier_runs: list[Path]) -> None:
    """examples/train_tokens.py (16 updates, an evaluation every 4 whose new best saves durably through
    step.save_now, its best loss a stateful of the script's own): killed with memory ahead of every durable save."""
    code = make_code_repo(tmp_path / "code", ("train_tokens.py",), wrappers=("tokens_paced.py",))
    data = tmp_path / "data"
    made = run_tree(
        [sys.executable, str(code / "train_tokens.py"), "--make-data", str(data)],
        timeout=120,
        env=clean_env(),
    )
    assert made.returncode == 0, made.stderr
    ref, run = tmp_path / "ref", tmp_path / "run"
    tier_runs += [ref, run]
    sets, args = {"total_updates": 16, "params.eval_interval": 4}, ("--data", str(data))
    out = run_tree(
        torchrun_cmd(code, ref, sets=sets, script="tokens_paced.py", args=args),
        timeout=300, env=clean_env(), cwd=code,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tier = {**sets, "memory_every": 1, "save_every": 8}
    cmd = torchrun_cmd(code, run, sets=tier, script="tokens_paced.py", args=args)
    held = _kill_once_memory_leads(cmd, run, {"TOKENS_PACE_S": "0.3"}, code, past=8)
    out = run_tree(torchrun_cmd(code, run, script="tokens_paced.py"), timeout=300, env=clean_env(), cwd=code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _assert_resumed_from_memory_and_equal(ref, run, held, 16)
