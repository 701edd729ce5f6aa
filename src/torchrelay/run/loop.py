"""The loop: one `Step` per update, its micro-batches from the loader at the run's exact position, what each
update leaves in this rank's metric and exposure logs, and the boundaries where the ranks agree on a stop and the
saver saves.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from torchrelay.config import RelayConfig
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import EXIT_FINISHED, ConfigError, PathError, RelayError, from_exception
from torchrelay.log import logger
from torchrelay.run.agreement import StopAgreement
from torchrelay.run.exact_reduce import EXACT, ExactReduction
from torchrelay.run.restore import Restore
from torchrelay.run.saver import Saver
from torchrelay.train_records import RankLog
from torchrelay.util import collective


class Step:
    """One update: its micro-batches and what the loop logs about it."""

    __slots__ = ("update", "_it", "_accum", "_ids", "metrics", "_exact", "_ranks")

    def __init__(
        self,
        update: int,
        it: Iterator[Any],
        accum: int,
        exact: ExactReduction | None = None,
        ranks: collective.Ranks | None = None,
    ) -> None:
        self.update = update
        self._it = it
        self._accum = accum
        self._ranks = ranks or collective.ranks()
        self._ids: list[list[int]] = []
        self.metrics: dict[str, Any] = {}
        self._exact = exact

    def micro_batches(self, model: torch.nn.Module | None = None) -> Iterator[tuple[int, Any]]:
        """(micro_step, batch) for each of the update's gradient-accumulation steps.

        Given the DDP or FSDP2 model, gradients are synchronized only in the last micro-step: the loop body
        of every other one runs under `model.no_sync()` (DDP) or `set_requires_gradient_sync(False)` (FSDP2).
        With `elastic: exact`, no micro-step syncs: each one's gradient is taken apart after its backward and the
        update's gradient is summed in the canonical order (run/exact_reduce.py) once the last one is done.
        """
        exact = self._exact
        params = exact.params(model) if exact is not None else []  # type: ignore[arg-type]  # it refuses None
        deferred = _sync_deferral(model, never=exact is not None)
        for micro in range(self._accum):
            # A sample one rank cannot read fails this micro-batch on every rank, before any rank hands its batch
            # to code that may wait in a collective for the rank that failed (one small all-reduce per batch).
            ids, batch = self._ranks.agree("training", self._next)
            self._ids.append(ids)
            with deferred(micro == self._accum - 1):
                yield micro, batch
            if exact is not None:
                exact.take(params, micro)
        if exact is not None:
            exact.finish(params)

    def _next(self) -> tuple[list[int], Any]:
        try:
            return next(self._it)
        except OSError as exc:  # the dataset could not read a sample (in this process or in a worker)
            raise _sample_error(exc, self.update) from exc

    def log(self, **metrics: Any) -> None:
        """Record this rank's metrics for the update (loss, lr, ...); tensors become floats."""
        for key, value in metrics.items():
            self.metrics[key] = float(value) if isinstance(value, torch.Tensor) else value


class Loop:
    """Drives one segment's updates on one rank, from the update it resumes at to the end or an agreed stop."""

    def __init__(
        self,
        config: RelayConfig,
        order: GlobalOrder,
        *,
        rank: int,
        world_size: int,
        start_update: int,
        global_batch: int,
        logs: tuple[RankLog, RankLog],
        restore: Restore,
        saver: Saver,
        agreement: StopAgreement,
        announce: tuple[str, ...],
        notes: list[str],
    ) -> None:
        self._config = config
        self._order = order
        self._rank = rank
        self._world_size = world_size
        self._start = start_update
        self._global_batch = global_batch
        self._metrics_log, self._exposures_log = logs
        self._restore = restore
        self._saver = saver
        self._agreement = agreement
        self._announce = announce  # this rank's lines before its first update (the gate, the contract)
        self._notes = notes  # the segment's notes, shared with the Run
        self._last_flush = 0.0
        self._ranks = collective.ranks()  # the training thread's exchanges (util/collective.py)

    def run(self, loader: RelayLoader, finish: Callable[[int, int], None]) -> Iterator[Step]:
        """Yield one Step per update until the schedule ends or a stop is agreed, saving on the way; then call
        `finish(exit_code, updates_done)` once the last checkpoint is complete."""
        cfg = self._config
        self._ranks.agree("restoring the random generators", self._restore.generators)
        for line in self._announce:
            logger.info(f"[rank {self._rank}] {line}")
        batches = RankBatches(
            self._order,
            self._start,
            cfg.total_updates,
            self._rank,
            self._world_size,
            cfg.micro_batch,
            cfg.grad_accum,
        )
        context, note = loader.context()
        if note and self._rank == 0:
            logger.warning(f"[torchrelay] {note}")
            self._notes.append(note)
        # Refused here, before the first update, on every rank alike (a layout the canonical sum cannot cover).
        exact = ExactReduction(self._rank, self._world_size, cfg.grad_accum) if cfg.elastic == EXACT else None
        it = loader.start(batches, cfg.seed, context)
        saver = self._saver
        done = self._start
        recent: deque[float] = deque(maxlen=5)
        next_check = done  # the first boundary always agrees
        try:
            while True:
                code = 0
                if done == next_check:
                    code, interval = self._agreement.at(done, recent)
                    next_check = done + interval
                if done >= cfg.total_updates or code:
                    if saver.unsaved(done):
                        saver.save(done)
                    saver.wait()
                    finish(EXIT_FINISHED if done >= cfg.total_updates else code, done)
                    return
                step = Step(done + 1, it, cfg.grad_accum, exact, self._ranks)
                t0 = time.perf_counter()
                yield step
                dt = time.perf_counter() - t0
                recent.append(dt)
                done += 1
                self._record(step, dt)
                if saver.due(done):
                    saver.save(done)
        finally:
            del it  # stops loader workers

    def _record(self, step: Step, dt: float) -> None:
        rec = {"update": step.update, **step.metrics}
        rec["update_time"] = round(dt, 6)
        rec["samples_per_s"] = round(self._global_batch / dt, 3) if dt > 0 else None
        rec["time"] = round(time.time(), 3)
        self._metrics_log.write(rec)
        for micro, ids in enumerate(step._ids):
            self._exposures_log.write({"u": step.update, "m": micro, "i": ids})
        # Lines past the newest checkpoint are trimmed on resume anyway, so flushing about twice a second
        # (and durably before every save) loses nothing a resume needs and keeps syscalls out of the loop.
        now = time.perf_counter()
        if now - self._last_flush > 0.5:
            self._metrics_log.flush()
            self._exposures_log.flush()
            self._last_flush = now


def _sample_error(exc: OSError, update: int) -> RelayError:
    """A sample the dataset could not read, as one message: a worker's error carries the worker's traceback in
    its text, of which the last line says what happened."""
    lines = str(exc).strip().splitlines()
    hint = (
        "a file the manifest names is missing or unreadable: check data_root (a runtime field), or run "
        "`torchrelay prepare --check-files` for a bundle"
    )
    if exc.filename is None and len(lines) > 1:
        text = f"update {update}: reading a sample in a DataLoader worker: {lines[-1].strip()}"
    else:
        text = str(from_exception(exc, f"update {update}: reading a sample").message)
    # A worker's error comes back without its errno: the type says whether the path was wrong.
    wrong_path = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)
    return PathError(text, hint=hint) if isinstance(exc, wrong_path) else RelayError(text, hint=hint)


def _sync_deferral(
    model: torch.nn.Module | None, never: bool = False
) -> Callable[[bool], AbstractContextManager[Any]]:
    """For a micro-step (is it the last?), the context the loop body runs in: gradients sync in the last only
    (never: in none, the exact reduction sums them instead)."""
    if model is None:
        return lambda last: contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return lambda last: contextlib.nullcontext() if last and not never else model.no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 (fully_shard)
    if callable(set_sync):

        @contextlib.contextmanager
        def fsdp(last: bool) -> Iterator[None]:
            set_sync(last)
            try:
                yield
            finally:
                set_sync(True)  # a loop left early must not leave the model unsynchronized

        return fsdp
    if isinstance(model, torch.nn.Module):
        return lambda last: contextlib.nullcontext()  # nothing to synchronize: one process or a plain module
    raise ConfigError(
        f"step.micro_batches(model): expected the DDP or FSDP2 model (a torch.nn.Module), got {type(model).__name__}"
    )
