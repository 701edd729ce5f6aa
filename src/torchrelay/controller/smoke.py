"""The smoke run: a few updates of the real command on all ranks, in a throwaway run directory.

It runs the formal configuration untouched (same schedule, same world size) and is stopped by a request file
with `at_update`, so it also times a real save. It fails on a crash or a non-finite loss; it measures the update
time (train/metrics-rank0.jsonl `update_time`), the save time (COMPLETE.json `save_seconds`), the start-up time
and the checkpoint size that the cost model and the disk check use.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from typing import Any

from torchrelay.checkpoint.inventory import read_inventory
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.errors import EXIT_ERROR, RelayError
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import Measurements
from torchrelay.records.history import read_history
from torchrelay.records.train import metrics_path
from torchrelay.util.jsonl import iter_records

# The last line of a Python traceback: "RuntimeError: ...", "torch.OutOfMemoryError: ...".
_ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]+\.)?\w*(Error|Exception)\b.*:")


class SmokeFailed(RelayError):
    """The smoke run crashed, went non-finite or did not reach its updates; the formal run was not started."""

    exit_code = EXIT_ERROR


@dataclass(slots=True)
class SmokeResult:
    measurements: Measurements
    updates: int
    losses: list[float]
    ended: str


def smoke_overrides(base: dict[str, Any], smoke: dict[str, Any], save_every: int) -> dict[str, Any]:
    """TORCHRELAY_OVERRIDES of the smoke: the formal run's, the smoke's own, and when to save."""
    return {**base, **smoke, "save_every": save_every}


def evaluate(
    smoke: RunDir, launched_at: float, updates: int, returncode: int, tail: list[str]
) -> SmokeResult:
    """Judge a finished smoke run from its run directory; raises SmokeFailed naming what went wrong."""
    smoke_dir = smoke.path
    train = smoke.train_dir
    rows = list(iter_records(metrics_path(train, 0))) if train.exists() else []
    history = read_history(smoke_dir)
    ended = history[-1].get("ended", "crash") if history else "crash"
    output = "\n".join(f"  | {line}" for line in tail[-25:]) or "  (no output)"
    causes = [
        re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        for line in tail
        if _ERROR_LINE.match(line.strip()) and "ChildFailedError" not in line
    ]
    cause = f"; the error: {causes[-1]}" if causes else ""
    bad = [r for r in rows if not _finite(r.get("loss"))]
    if bad:
        raise SmokeFailed(
            f"smoke run in {smoke_dir}: non-finite loss {bad[0].get('loss')} at update {bad[0].get('update')}",
            hint="the formal run was not started; check the learning rate, data and numerics of the first updates",
        )
    if ended not in ("request", "finished"):
        raise SmokeFailed(
            f"smoke run in {smoke_dir} ended {ended!r} (torchrun exit {returncode}) after {len(rows)} update(s)"
            f"{cause}; last output:\n{output}",
            hint="the formal run was not started; fix the crash the output shows and launch again",
        )
    if len(rows) < min(2, updates):
        raise SmokeFailed(f"smoke run in {smoke_dir} logged {len(rows)} update(s), fewer than 2 to time")
    times = [float(r["update_time"]) for r in rows]
    update_s = max(times[1:]) if len(times) > 1 else times[0]  # the first update pays for warm-up
    first = rows[0]
    startup_s = max(0.0, float(first["time"]) - float(first["update_time"]) - launched_at)
    saves = []
    for ckpt in list_checkpoints(smoke_dir):
        if ckpt.complete:
            doc = read_inventory(ckpt.path)
            saves.append(float(doc.get("save_seconds", 0.0)))
    complete = [c for c in list_checkpoints(smoke_dir) if c.complete]
    if not complete:
        raise SmokeFailed(f"smoke run in {smoke_dir} wrote no complete checkpoint; a save could not be timed")
    m = Measurements(
        update_s=update_s,
        save_s=max(saves),
        startup_s=startup_s,
        checkpoint_bytes=complete[-1].size,
        source="smoke",
    )
    return SmokeResult(m, len(rows), [float(r["loss"]) for r in rows], ended)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def discard(smoke: RunDir) -> None:
    """Remove the smoke's checkpoints (the logs and history stay for the record)."""
    for ckpt in smoke.checkpoint_dirs():
        shutil.rmtree(ckpt, ignore_errors=True)
