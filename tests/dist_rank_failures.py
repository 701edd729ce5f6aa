"""Run under torchrun (2 or 4 ranks, gloo) by test_rank_failures.py: one failure on one rank in each collective
phase, in one launch; every rank must raise the same error, with the same exit code, at once.

`dist_rank_failures.py BASE CONFIG ENDING`: trains BASE/run to a checkpoint, then runs each phase on a copy of it
with a failure injected on one rank (a function of this process wrapped, or a file of that rank's planted), and
writes what each rank raised, and how long after the phase began, to BASE/seen-rank<r>.json. At last (ENDING) a
data file of one rank goes missing mid-update, uncaught, and the excepthook ends every rank; or that rank is
SIGKILLed while reading it, and the others, waiting for it, end (BASE/final-start holds when it began).
A rank left waiting for a failed peer would sit out the script's gloo timeout (120 s) instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

import torchrelay as tr
from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.state import rng
from torchrelay.controller.validation import ValidationSpec, validate_checkpoints
from torchrelay.errors import ConfigError
from torchrelay.export import ExportOptions, export_weights
from torchrelay.run import agreement, opening


class Files(torch.utils.data.Dataset):
    """Sample i: the bytes of the file its manifest line names (one file per sample)."""

    def __init__(self, records: Any) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.records[i]["path"], "rb") as f:
            return torch.tensor(list(f.read(8)), dtype=torch.float32)


def train(run_dir: Path, cfg: tr.RelayConfig | None, *, until: int | None = None) -> None:
    """Open (or resume) the run and train it, to update `until` (left with a checkpoint before it) or the end."""
    with tr.Run.open(run_dir, cfg) as run:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(Files(run.manifest.records))):
            if until is not None and step.update > until:
                break
            for _, batch in step.micro_batches(model):
                model(batch).sum().backward()
            opt.step()
            opt.zero_grad()


def copy_of(base: Path, name: str, damage: Callable[[Path], None] | None = None) -> Path:
    """Rank 0 copies the trained run (and damages the copy); every rank waits for it."""
    dst = base / name
    if dist.get_rank() == 0:
        shutil.copytree(base / "run", dst)
        if damage is not None:
            damage(dst)
    dist.barrier()
    return dst


def sample_files(run_dir: Path, update: int, rank: int) -> list[Path]:
    """The files rank `rank` reads in update `update` (1-based), from the run's own order."""
    cfg = tr.RelayConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    with tr.Run.open(run_dir) as run:  # only to read the order: nothing is trained
        files = [
            Path(run.manifest.records[i]["path"])
            for m in range(cfg.grad_accum)
            for i in run.order.slot(update - 1, m, rank, dist.get_world_size(), cfg.micro_batch)
        ]
        run.exit_code = 0
    return files


def main() -> None:
    base, config_path, ending = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = world - 1  # the rank that fails, in each phase where one rank acts alone: rank 0
    cfg = tr.RelayConfig.from_dict(yaml.safe_load(config_path.read_text()))
    train(base / "run", cfg, until=3)  # checkpoint-2, and no further
    seen: dict[str, Any] = {}

    def phase(name: str, run: Callable[[], None]) -> None:
        dist.barrier()  # every rank starts the phase together
        started = time.time()
        try:
            run()
            seen[name] = {"raised": False}
        except BaseException as exc:  # noqa: BLE001 - what each rank raised is the point
            seen[name] = {
                "raised": True,
                "type": type(exc).__name__,
                "code": getattr(exc, "exit_code", None),
                "reported": bool(getattr(exc, "reported", False)),
                "message": str(exc).splitlines()[0],
            }
        seen[name]["seconds"] = round(time.time() - started, 3)

    # open: the victim cannot open its metrics log
    real_log = opening.RankLog

    def unopenable(path: Path) -> Any:
        if "metrics" in path.name:
            raise PermissionError(13, "Permission denied", str(path))
        return real_log(path)

    if rank == victim:
        opening.RankLog = unopenable  # type: ignore[assignment,misc]
    phase("open", lambda: train(copy_of(base, "open"), None))
    opening.RankLog = real_log  # type: ignore[misc]

    # track (load): one byte of the victim's random state flipped, its size kept: the verified load refuses it
    def flip(run_dir: Path) -> None:
        path = rng.rank_file(run_dir / "checkpoint-2", victim)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))

    phase("track", lambda: train(copy_of(base, "track", flip), None))

    # save: the victim's staging fails (training thread), then another's write fails (persist thread)
    real_capture, real_write = ckpt_state.capture_state, ckpt_state.write_snapshot

    def no_staging(**_: Any) -> Any:
        raise OSError(12, "Cannot allocate memory (injected)")

    def no_write(*_: Any, **__: Any) -> Any:
        raise OSError(5, "Input/output error", "injected")

    if rank == victim:
        ckpt_state.capture_state = no_staging  # type: ignore[assignment]
    phase("save-staging", lambda: train(copy_of(base, "staging"), None))
    ckpt_state.capture_state = real_capture
    if rank == victim:
        ckpt_state.write_snapshot = no_write  # type: ignore[assignment]
    phase("save-commit", lambda: train(copy_of(base, "commit"), None))
    ckpt_state.write_snapshot = real_write

    # the stop agreement: the victim's policy fails
    real_decide = agreement.decide

    def undecided(ctx: Any) -> Any:
        raise ConfigError("injected: the stop policy could not decide")

    if rank == victim:
        agreement.decide = undecided  # type: ignore[assignment]
    phase("stop", lambda: train(copy_of(base, "stop"), None))
    agreement.decide = real_decide

    # a data file of the victim's, gone before update 4
    data = copy_of(base, "data")
    gone = sample_files(data, 4, victim)
    dist.barrier()
    if rank == victim:
        for path in gone:
            os.replace(path, path.with_suffix(".gone"))
    phase("data", lambda: train(data, None))
    dist.barrier()
    if rank == victim:
        for path in gone:
            os.replace(path.with_suffix(".gone"), path)

    # validation and export run in one process: a script that runs one on one rank agrees on it
    def validation_blocked(run_dir: Path) -> None:
        (run_dir / "validation").write_text("not a folder")

    validated = copy_of(base, "validate", validation_blocked)
    phase(
        "validation",
        lambda: tr.agree(
            "validating",
            lambda: validate_checkpoints(validated, ValidationSpec(command="true")) if rank == 0 else None,
        ),
    )

    def metadata_planted(run_dir: Path) -> None:
        (run_dir / "checkpoint-2" / "model" / ".metadata").write_bytes(b"\x80\x04planted")

    exported = copy_of(base, "export", metadata_planted)
    phase(
        "export",
        lambda: tr.agree(
            "exporting",
            lambda: export_weights(exported, base / "weights", ExportOptions()) if rank == victim else None,
        ),
    )

    (base / f"seen-rank{rank}.json").write_text(json.dumps(seen, indent=1))
    final = copy_of(base, "final")
    gone = sample_files(final, 4, victim)
    dist.barrier()
    if rank == victim and ending == "uncaught":
        for path in gone:
            path.unlink()
    if rank == victim and ending == "kill":  # the victim dies reading its first sample of update 4
        real_getitem = Files.__getitem__

        def killed(self: Files, i: int) -> torch.Tensor:
            if Path(self.records[i]["path"]) in gone:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_getitem(self, i)

        Files.__getitem__ = killed  # type: ignore[method-assign]
    if rank == 0:
        (base / "final-start").write_text(str(time.time()))
    dist.barrier()
    train(final, None)  # not caught: every rank's excepthook ends it
    raise AssertionError("unreachable: the data file is missing, or a rank was killed")


if __name__ == "__main__":
    main()
