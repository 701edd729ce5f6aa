"""The loop: one `Step` per update, its micro-batches from the loader at the run's exact position, what each
update leaves in this rank's metric and exposure logs, and the boundaries where the ranks agree on a stop and the
saver saves.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from torchrelay.checkpoint.policy import SaveContext
from torchrelay.checkpoint.tiers import MEMORY
from torchrelay.config.relay import RelayConfig
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import EXIT_FINISHED, ConfigError, PathError, RelayError, from_exception
from torchrelay.log import logger
from torchrelay.records.digests import DigestLog
from torchrelay.records.train import ExposureLog, RankLog
from torchrelay.run.agreement import StopAgreement
from torchrelay.run.exact_reduce import EXACT, ExactReduction
from torchrelay.run.restore import Restore, Tracked
from torchrelay.run.saver import Saver
from torchrelay.util import collective


class Feed:
    """This rank's micro-batches from the loader, and what happens when one cannot be read.

    A sample this rank cannot read (a missing data file) must end every rank with the same error, but its peers
    are already on their way into the update's own collectives (DDP's gradient all-reduce, FSDP's all-gathers),
    which the protocol's exchange cannot join. Agreeing on every micro-batch would cost one all-reduce each
    (1.5-2.6 ms on gloo at load: RESULTS.md); instead the failing rank holds its failure (collective.Ranks.defer)
    and goes on with the last batch it read standing in, so that it enters every collective its peers enter,
    logs nothing more, and raises with them in the next exchange, which every rank reaches at the same update:
    the stop agreement (at most about a second of updates away), a save, or the segment's end. Only the launch's
    first batch, for which nothing can stand in, is agreed on.
    """

    __slots__ = ("_it", "_ranks", "_spare")

    def __init__(self, it: Iterator[Any], ranks: collective.Ranks) -> None:
        self._it = it
        self._ranks = ranks
        self._spare: Any = None  # the last batch read: what stands in once a read failed

    @property
    def failed(self) -> bool:
        """Whether this rank holds a failure: its batches stand in, its updates are not logged."""
        return collective.deferred()

    def next(self, update: int) -> tuple[list[int], Any]:
        """(indices, batch) of this rank's next micro-batch of update `update`."""
        if self._spare is None:
            ids, batch = self._ranks.agree("training", lambda: self._read(update))
        elif self.failed:
            return [], self._spare
        else:
            try:
                ids, batch = self._read(update)
            except BaseException as exc:  # noqa: BLE001 - held for the peers (or raised at once: see defer)
                self._ranks.defer("training", exc)
                return [], self._spare
        self._spare = batch
        return ids, batch

    def close(self) -> None:
        """Let go of the loader's iterator (its workers stop) and of the batch kept."""
        self._it, self._spare = iter(()), None

    def _read(self, update: int) -> tuple[list[int], Any]:
        try:
            return next(self._it)
        except OSError as exc:  # the dataset could not read a sample (in this process or in a worker)
            raise _sample_error(exc, update) from exc
        except RelayError as exc:  # a refusal of the dataset's (TokenWindows): one line, a worker's too
            said = _from_worker(exc, update)
            if said is None:
                raise
            raise said from exc


def _from_worker(exc: RelayError, update: int) -> RelayError | None:
    """A RelayError a DataLoader worker raised, as torch raises it again in the rank (the same class, its message
    the worker's whole traceback), back to its own message and hint; None for one raised in this process."""
    text = exc.message
    if "in DataLoader worker process" not in text.split("\n", 1)[0]:
        return None
    marker = f"\n{type(exc).__module__}.{type(exc).__qualname__}: "
    at = text.rfind(marker)
    if at < 0:
        return None
    message, _, hint = text[at + len(marker) :].partition("\n  hint: ")
    said = copy.copy(exc)
    said.message, said.hint = f"update {update}: {message.strip()}", hint.strip() or exc.hint
    said.args = (said.message,)
    return said


class Step:
    """One update: its micro-batches and what the loop logs about it."""

    __slots__ = ("update", "_feed", "_accum", "_ids", "metrics", "_exact", "_ranks", "saving")

    def __init__(
        self,
        update: int,
        it: Iterator[Any] | Feed,
        accum: int,
        exact: ExactReduction | None = None,
        ranks: collective.Ranks | None = None,
    ) -> None:
        self.update = update
        self._feed = it if isinstance(it, Feed) else Feed(it, ranks or collective.ranks())
        self._accum = accum
        self._ids: list[list[int]] = []
        self.metrics: dict[str, Any] = {}
        self._exact = exact
        self._ranks = ranks or collective.ranks()
        self.saving: str | None = None  # why every rank saves after this update (save_now), or None

    def save_now(self, wanted: bool = True, reason: str = "save_now") -> bool:
        """Ask every rank to save a checkpoint after this update, kept by retention like `keep_updates` (a new
        best validation loss, say). Call it on every rank at the same update, as a collective: the ranks agree,
        and one that wants it makes all of them save; returns whether they will. `reason` is recorded in the
        checkpoint's COMPLETE.json (`saved_now`) and shown by `status`."""
        asked = [False]

        def propose() -> list[int]:
            asked[0] = bool(wanted)  # a tensor or numpy bool too; a failure here is agreed like any
            return [1 if asked[0] else 0]

        agreed = self._ranks.agree_max(
            f"step.save_now in update {self.update}",
            propose,
            lost_hint="step.save_now is a collective: call it on every rank in the same update (wanted=False where "
            "a rank wants no save)",
        )
        if agreed[0] and self.saving is None:
            # Rank 0 writes COMPLETE.json: the reason recorded is that of the first rank that asked, not its own
            # (the ranks' reasons differ when each names its own value; one that did not ask has none).
            mine = (str(reason)[:200] or "save_now") if asked[0] else None
            reasons = self._ranks.all_gather(f"step.save_now in update {self.update}", lambda: mine)
            self.saving = next(r for r in reasons if r is not None)
        return self.saving is not None

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
            ids, batch = self._feed.next(self.update)  # a rank that cannot read one goes on: see Feed
            self._ids.append(ids)
            with deferred(micro == self._accum - 1):
                yield micro, batch
            if exact is not None:
                exact.take(params, micro)
        if exact is not None:
            exact.finish(params)

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
        logs: tuple[RankLog, ExposureLog],
        restore: Restore,
        saver: Saver,
        agreement: StopAgreement,
        announce: tuple[str, ...],
        notes: list[str],
        on_refusal: Callable[[RelayError], None] | None = None,
        tracked: Tracked | None = None,
        digests: DigestLog | None = None,
    ) -> None:
        self._config = config
        self._tracked, self._digests = tracked, digests  # the parameters' digest after each update
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
        self._on_refusal = on_refusal  # amends a refusal agreed in the loop before any rank says it
        self._last_flush = 0.0
        self.current: int | None = None  # the update in progress (what a caught OOM is counted against)
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
        if context is not None:
            logger.info(f"[rank {self._rank}] {loader.describe(context)}")
        if note and self._rank == 0:
            logger.warning(f"[torchrelay] {note}")
            self._notes.append(note)
        # Refused here, before the first update, on every rank alike (a layout the canonical sum cannot cover).
        exact = (
            ExactReduction(self._rank, self._world_size, cfg.grad_accum, on_refusal=self._on_refusal)
            if cfg.elastic == EXACT
            else None
        )
        it = Feed(loader.start(batches, cfg.seed, context), self._ranks)
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
                self.current = step.update
                t0 = time.perf_counter()
                yield step
                dt = time.perf_counter() - t0
                recent.append(dt)
                done += 1
                # step.save_now, agreed among the ranks, saves durably whatever the schedule says
                verdict = saver.policy.decide(SaveContext(done, cfg.total_updates, step.saving is not None))
                if verdict.durable or verdict.memory:
                    # The save before commits (and replicates) before this update is logged, where this save
                    # would wait for it anyway: a kill then loses at most the updates since the last save point.
                    saver.wait()
                if not it.failed:  # a rank that holds a failure logs nothing it did not read
                    self._record(step, dt)
                saver.after_update(done)  # the warm-up's side effects
                if verdict.durable:
                    saver.save(done, saved_now=step.saving)
                elif verdict.memory:
                    saver.save(done, MEMORY)
        finally:
            it.close()  # stops loader workers (a Step the script still holds keeps only the Feed)

    def _record(self, step: Step, dt: float) -> None:
        rec = {"update": step.update, **step.metrics}
        rec["update_time"] = round(dt, 6)
        rec["samples_per_s"] = round(self._global_batch / dt, 3) if dt > 0 else None
        rec["time"] = round(time.time(), 3)
        self._metrics_log.write(rec)
        for micro, ids in enumerate(step._ids):
            self._exposures_log.write_exposure(step.update, micro, ids)
        if self._digests is not None and self._tracked is not None:
            self._digests.record(step.update, self._tracked.model)
        # Lines past the newest checkpoint are trimmed on resume anyway, so flushing about twice a second
        # (and durably before every save) loses nothing a resume needs and keeps syscalls out of the loop.
        now = time.perf_counter()
        if now - self._last_flush > 0.5:
            self._metrics_log.flush()
            self._exposures_log.flush()
            if self._digests is not None:
                self._digests.flush()
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
