"""The saver: when a segment saves (every `save_every` updates, at the updates retention keeps, at a stop) and how
(logs made durable, then the commit protocol across ranks, then retention), and how long the last save took.

The loop calls `due(done)` after each update and `save(update)`; a stop saves once more if the update is not
saved yet, then `wait()`s; closing the Run calls `close()`. A save is synchronous today: `wait()` and `close()`
have nothing to wait for. A background persist plugs in behind `save()`: it returns once the state is staged, and
`wait()` / `close()` return once every staged save is committed (or raise what failed), so a segment never records
its end, nor lets go of the lock, before its last checkpoint is complete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.commit import commit_checkpoint
from torchrelay.checkpoint.retention import policy_for
from torchrelay.config import RelayConfig
from torchrelay.data.order import GlobalOrder
from torchrelay.logs import RankLog
from torchrelay.run.restore import Tracked


class Saver:
    """Saves one segment's checkpoints through the commit protocol (every rank holds one)."""

    def __init__(
        self,
        run_dir: Path,
        config: RelayConfig,
        tracked: Tracked,
        *,
        rank: int,
        world_size: int,
        contract_sha: str,
        segment: str,
        order: GlobalOrder,
        global_batch: int,
        logs: tuple[RankLog, ...],
        saved: int | None,
        estimate: float,
    ) -> None:
        self._run_dir = run_dir
        self._config = config
        self._tracked = tracked
        self._rank = rank
        self._world_size = world_size
        self._contract_sha = contract_sha
        self._segment = segment
        self._order = order
        self._global_batch = global_batch
        self._logs = logs
        self._retention = policy_for(
            config
        )  # a checkpoint kept for later (keep_updates, keep_every) is written
        self.last = saved if saved is not None else -1  # the newest update with a checkpoint (resumed from)
        self.estimate = estimate  # seconds a save takes, for the budget policy: the slowest so far

    def due(self, done: int) -> bool:
        """Whether the update just done saves: every `save_every`, or one that retention keeps (not the last:
        the end of the schedule saves as a stop does)."""
        cfg = self._config
        return (done % cfg.save_every == 0 or self._retention.saves_at(done)) and done < cfg.total_updates

    def unsaved(self, done: int) -> bool:
        """Whether a stop after update `done` must save it. Update 0 needs no checkpoint: starting again from
        nothing is the same run, and a checkpoint of an optimizer that never stepped would hold a made-up step."""
        return self.last != done and done > 0

    def save(self, update: int) -> Path:
        """Commit checkpoint-<update>: logs made durable first, then the protocol across ranks, then retention."""
        for log in self._logs:
            log.flush(durable=True)
        loop = {
            "update": update,
            "samples_consumed": self._order.position(update),
            "epoch": update / self._order.updates_per_epoch,
            "world_size": self._world_size,
            "global_batch": self._global_batch,
            "segment": self._segment,
        }
        tracked = self._tracked

        def write(tmp: Path, hook: Any) -> None:
            ckpt_state.save_state(
                tmp,
                rank=self._rank,
                model=tracked.model,
                optimizer=tracked.optimizer,
                statefuls=tracked.statefuls,
                loop=loop,
                kill_hook=hook,
            )

        path, seconds = commit_checkpoint(
            self._run_dir,
            update,
            write,
            rank=self._rank,
            world_size=self._world_size,
            info={"contract_sha256": self._contract_sha, "segment": self._segment, "created": time.time()},
            retention=self._retention,
        )
        self.estimate = max(self.estimate, seconds) if self.estimate else seconds
        self.last = update
        return path

    def wait(self) -> None:
        """Return once every save so far is committed (a stop calls it before it records the segment's end)."""

    def close(self) -> None:
        """Wait for what is pending and let go of what saving holds (closing the Run calls it, on any exit)."""
        self.wait()


def last_save_seconds(ckpt: Path | None) -> float | None:
    """How long the save of `ckpt` took, as its COMPLETE.json records (None when unknown)."""
    if ckpt is None:
        return None
    try:
        return float(json.loads((ckpt / "COMPLETE.json").read_text()).get("save_seconds"))
    except (OSError, ValueError, TypeError):
        return None


def first_estimate(last_save_s: float | None) -> float:
    """The save-time estimate a segment starts with: the cost model's (TORCHRELAY_SAVE_ESTIMATE_S), else how long
    the checkpoint it resumes from took to save, else 0 (unknown until the first save)."""
    return float(os.environ.get("TORCHRELAY_SAVE_ESTIMATE_S", last_save_s or 0.0))
