"""PyTorch Lightning as a torchrelay run (examples/train_lightning.py, 2 ranks under torchrun, DDP on gloo).

Trained uninterrupted, and stopped mid-epoch by a request, then by a time budget, then by SIGTERM, each launch with
another loader worker count, then finished: every parameter and optimizer tensor torch.equal at the end, the same
per-rank metrics and exposures, the ledger exact. A Trainer setting that an exact resume cannot carry is refused in
one line (in-process, no launch).
"""

from __future__ import annotations

import shutil
import subprocess
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
    sigterm,
    wait_for_update,
)
from torchrelay.cli import main
from torchrelay.ledger.exposure import prove

pytest.importorskip("pytorch_lightning")

U = 12  # the example's schedule: 64 samples, 4 x 2 micro-batches x 2 ranks = 4 updates an epoch, 3 epochs


def _cmd(code: Path, run_dir: Path, *extra: str, script: str = "train_lightning.py") -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / script),
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def _launch(code: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    out = run_tree(_cmd(code, run_dir, *extra), timeout=300, env=clean_env(**(env or {})), cwd=code)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("lightning-code") / "code"
    dest.mkdir()
    shutil.copyfile(REPO / "tests" / "lightning_paced.py", dest / "lightning_paced.py")
    return make_code_repo(dest, scripts=("train_lightning.py",))


@pytest.mark.launch
def test_lightning_stopped_mid_epoch_three_ways_ends_bit_exact(code: Path, tmp_path: Path) -> None:
    ref = tmp_path / "uninterrupted"
    rc, out = _launch(code, ref)
    assert rc == 0, out
    assert [(s["first_update"], s["last_update"], s["ended"]) for s in segments(ref)] == [(1, U, "finished")]

    run = tmp_path / "run"
    run.mkdir()
    # 1. a request file, honoured after update 5: one update into the second epoch
    main(["stop", str(run), "--at-update", "5", "--before-start"])
    rc, out = _launch(code, run)
    assert rc != 0 and "exitcode  : 4" in out, out
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 5
    # 2. a time budget no update fits in: stops at the first boundary, another worker count
    rc, out = _launch(code, run, "--workers", "1", env={"TORCHRELAY_BUDGET_S": "0.5"})
    assert segments(run)[-1]["ended"] == "budget" and segments(run)[-1]["last_update"] == 5, out
    # 3. SIGTERM after update 7 (Lightning's own SIGTERM handler would end the rank without a save)
    proc = subprocess.Popen(
        _cmd(code, run, "--workers", "2", script="lightning_paced.py"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(LIGHTNING_PACE_S="0.3", TORCHRELAY_CHECK_EVERY="1"),
        cwd=code,
        start_new_session=True,
    )
    wait_for_update(run, 7, proc)
    sigterm(proc)
    proc.wait(timeout=120)
    said = proc.stdout.read() if proc.stdout else ""
    seg = segments(run)[-1]
    assert seg["ended"] == "signal" and seg["resumed_from"] == 5 and 7 <= seg["last_update"] < U, said
    assert (run / f"checkpoint-{seg['last_update']}").is_dir(), said
    # 4. finished, on yet another worker count
    rc, out = _launch(code, run, "--workers", "2")
    assert rc == 0, out
    assert [s["ended"] for s in segments(run)] == ["request", "budget", "signal", "finished"]
    assert segments(run)[1]["runtime_changes"] == {"num_workers": [0, 1]}

    assert assert_same_final_state(ref, run, U) >= 12  # every parameter and optimizer tensor
    assert_same_logs(ref, run)  # per-rank metrics (loss, lr) and exposures
    for done in (ref, run):
        ledger = prove(done)
        assert ledger.ok and ledger.exposures == U * 16 and ledger.distinct == 64 and ledger.repeats == 0


def _tiny_fit(tmp_path: Path, **trainer_kwargs: object) -> None:
    """One process, no launch: the example's module and data under a Trainer built with `trainer_kwargs`."""
    import pytorch_lightning as pl

    import torchrelay as tr
    from torchrelay.integrations.lightning import RelayLightning

    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(f'{{"id": "{i}"}}\n' for i in range(8)))
    cfg = tr.RelayConfig(seed=1, micro_batch=2, grad_accum=2, total_updates=2, manifest=str(manifest))
    relay = RelayLightning(tmp_path / "run", cfg)
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[relay],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,  # type: ignore[arg-type]
    )
    trainer.fit(Tiny(), train_dataloaders=relay.dataloader([torch.ones(2) * i for i in range(8)]))


def test_lightning_refuses_an_accumulation_other_than_grad_accum(tmp_path: Path) -> None:
    from torchrelay.errors import ConfigError

    with pytest.raises(ConfigError, match=r"Trainer\(accumulate_grad_batches=3\) .*grad_accum \(2\)"):
        _tiny_fit(tmp_path, accumulate_grad_batches=3)
