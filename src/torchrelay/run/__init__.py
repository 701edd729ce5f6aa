"""The Run: opens or resumes a run directory, restores state, drives the update loop, stops cleanly.

A small facade over the modules of this package, in the order a segment uses them:
`opening.py` (rank 0 opens the directory: `directory.py`, every rank opens its part, any failure reaches every rank),
`restore.py` (tracked state, generators, the update cross-check), `loop.py` (one `Step` per update, the logs),
`agreement.py` (the ranks agree on a stop) and `saver.py` (when and how a checkpoint is committed).
The Run wires them together and records how the segment ended.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.checkpoint.deepspeed_engine import check_engine, is_engine
from torchrelay.checkpoint.state import rng
from torchrelay.checkpoint.torch_compat import settle_ddp_buckets
from torchrelay.config.relay import RelayConfig
from torchrelay.data.loader import RelayLoader
from torchrelay.errors import (
    EXIT_ERROR,
    EXIT_FINISHED,
    EXIT_REFUSED,
    RelayError,
    install_excepthook,
    run_opening,
)
from torchrelay.identity import find_code_dir
from torchrelay.log import ensure_voice, logger, set_rank
from torchrelay.records.contract import canonical_json
from torchrelay.records.digests import DigestLog, digests_path
from torchrelay.records.ended import Ended, ended_of
from torchrelay.records.history import upsert
from torchrelay.records.reshard import rank_stream_seed, reshard_asked, reshard_asker
from torchrelay.records.train import record_oom
from torchrelay.run.agreement import StopAgreement
from torchrelay.run.loop import Loop, Step
from torchrelay.run.opening import SegmentOpener, start_over
from torchrelay.run.restore import Restore, Tracked
from torchrelay.run.saver import Saver, first_estimate
from torchrelay.util import collective
from torchrelay.util.finalize import freeze_at_exit
from torchrelay.util.jsonl import iter_records


class Run:
    """A resumable training run in a run directory (see docs/CORE_API.md for the loop)."""

    def __init__(self) -> None:  # use Run.open
        raise TypeError("use Run.open(run_dir, config)")

    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike[str] | None,
        config: RelayConfig | None = None,
        *,
        code_dir: str | os.PathLike[str] | None = None,
        overrides: dict[str, Any] | None = None,
        reshard: bool | None = None,
    ) -> Run:
        """Create the run, or validate and resume it from its newest complete checkpoint (every rank).

        reshard: this launch may continue on another layout (world size, micro_batch x grad_accum) with the same
        global batch (records/reshard.py); None reads TORCHRELAY_RESHARD.

        A refusal reaches every rank as the same RelayError; rank 0 prints it once and records the launch in
        history.jsonl as a segment that ended `refused` (exit 2), unless another writer holds the run.
        """
        install_excepthook()  # an uncaught refusal: one message and its exit code, not a traceback per rank
        freeze_at_exit()  # a rank ends in under a second, not 3-4 s of collecting torch's heap (util/finalize.py)
        ensure_voice()  # the library logs; a script that configured no logging still sees its lines
        run_opening()
        self = object.__new__(cls)
        self._open(run_dir, config, code_dir, overrides, reshard_asked() if reshard is None else reshard)
        return self

    def _open(
        self,
        run_dir: str | os.PathLike[str] | None,
        config: RelayConfig | None,
        code_dir: str | os.PathLike[str] | None,
        overrides: dict[str, Any] | None,
        reshard: bool = False,
    ) -> None:
        on = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        set_rank(self.rank)
        self.distributed = self.world_size > 1
        self.code_dir = Path(code_dir) if code_dir else find_code_dir()
        self.exit_code, self.ended, self._closed = EXIT_ERROR, Ended.RUNNING, False
        self._opener = SegmentOpener(
            run_dir,
            rank=self.rank,
            world_size=self.world_size,
            code_dir=self.code_dir,
            reshard=reshard,
            asked_by=reshard_asker(),
        )
        opened = self._opener.open(config, overrides)
        self.dir = self._opener.dir
        self.config, self.contract_sha, self.segment = opened.config, opened.contract_sha, opened.segment
        self.resume_from, self.start_update, self.gate = opened.resume_from, opened.start_update, opened.gate
        self.hosts, self.ranks_by_host = opened.hosts, opened.ranks_by_host
        # Python's `random` and numpy's global generator start from the OS's entropy in every process: a script
        # that draws from them would differ between two uninterrupted runs. Seeded here, per rank, in every
        # launch (a resume then restores the saved streams right before its first update); a script that wants
        # its own seeds sets them after Run.open (docs/LOOP.md).
        rng.seed_script_streams(rank_stream_seed(self.config.seed, 0, self.rank, self.world_size))
        self.manifest, self.order = opened.manifest, opened.order
        self.global_batch = opened.global_batch
        self.metrics_log, self.exposures_log = opened.metrics_log, opened.exposures_log
        self._notes: list[str] = []
        # A relaunch of a finished run trains nothing and records nothing (steps() says so).
        self._finished_before = self.start_update >= self.config.total_updates
        self._tracked = Tracked()
        # the parameters' digest after every update (records/digests.py): runs compared update by update
        self._digests = DigestLog(digests_path(self.dir.train_dir, self.rank))
        change = self.segment.layout_change
        self.layout_change = change if isinstance(change, dict) else None
        # several nodes: the chosen parts, assembled in each node's memory while opening (opening.py); the line each
        # rank says names that, not where rank 0's node held node 0's part (a path a replacement node never had)
        if self._opener.assembled is not None:
            self.resume_from = self._opener.assembled
            self.gate = f"resuming from the {self.segment.resumed_tier} tier: {self.resume_from}"
        rederive = (
            rank_stream_seed(self.config.seed, self.start_update, self.rank, self.world_size)
            if self.layout_change
            else None
        )
        self._restore = Restore(
            self.resume_from,
            self.start_update,
            self.rank,
            rederive,
            self.config.load_tuning,
            verified=self.segment.resumed_tier in ("memory", "replica"),
            digests=digests_path(self.dir.train_dir, self.rank),
        )
        self._saver = Saver(
            self.dir,
            self.config,
            self._tracked,
            rank=self.rank,
            world_size=self.world_size,
            contract_sha=self.contract_sha,
            segment=self.segment.segment,
            order=self.order,
            global_batch=self.global_batch,
            # every log a resume trims at its checkpoint is on disk up to it before the checkpoint counts
            logs=(self.metrics_log, self.exposures_log, self._digests),
            # a stop saves durably even at the update a memory checkpoint holds (the node may not come back)
            saved=self.start_update
            if self.resume_from is not None and self.segment.resumed_tier not in ("memory", "replica")
            else None,
            estimate=first_estimate(opened.last_save_s),
            lineage=self.segment.lineage,
            hosts=len(self.hosts),
            notes=self._notes,
        )
        deadline = opened.deadline
        self._agreement = StopAgreement(
            self.dir,
            rank=self.rank,
            world_size=self.world_size,
            total_updates=self.config.total_updates,
            deadline=deadline.at if deadline else None,
            save_estimate=self._saver.budget_seconds,
            notes=self._notes,
        )
        self._loop = Loop(
            self.config,
            self.order,
            rank=self.rank,
            world_size=self.world_size,
            start_update=self.start_update,
            global_batch=self.global_batch,
            logs=(self.metrics_log, self.exposures_log),
            restore=self._restore,
            saver=self._saver,
            agreement=self._agreement,
            announce=(self.gate, f"TRAINING_CONTRACT {self.contract_sha}"),
            notes=self._notes,
            on_refusal=self._start_over,
            tracked=self._tracked,
            digests=self._digests,
        )
        if self.rank == 0 and not self._finished_before:
            self.segment.hosts = self.hosts
            self.segment.ranks_by_host = self.ranks_by_host
            self.segment.deadline = deadline.at if deadline else None
            if deadline:
                left = deadline.at - time.time()
                logger.info(f"[torchrelay] deadline in {left:.1f}s ({deadline.source})")
            upsert(self.dir, self.segment.to_dict())

    @property
    def manifest_path(self) -> Path:
        """The manifest this run reads, the file `run.manifest` was read from: the run's own copy
        (RUN_DIR/data/manifest.jsonl), its paths re-pointed by `prepare --set data_root=...`; not the file
        `config.manifest` named when the run was made (docs/RUN.md)."""
        return Path(self.manifest.path)

    def track(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **statefuls: Any,
    ) -> None:
        """Register what must resume (model, optimizer, scheduler, scaler, generators, ...) and restore it if
        resuming; each rank's own values come back to it (see checkpoint/ranks.py)."""
        # Every rank registers and loads, or all raise the same error (util/collective.py): a rank whose load
        # failed never leaves the others waiting in the next collective.
        with collective.phase("run.track"):
            if is_engine(model):  # a DeepSpeed engine: its configuration must be the contract's
                check_engine(model, optimizer, self.config)
            # Two terms add alike in any order: only more ranks see DDP's bucket layout (docs/LOOP.md).
            if self.world_size > 2:
                settle_ddp_buckets(model)
            self._tracked.register(model, optimizer, statefuls)
            self._restore.state(self._tracked)

    def note_oom(self, error: BaseException | None = None) -> None:
        """Count a CUDA out-of-memory error this rank caught and went on from (a skipped or retried batch): kept
        per segment in train/ooms-rank<r>.jsonl and shown by `status` and the packed training_progress.json. An
        OOM that ends the process is counted by `close` (the `with` block or the Trainer) as fatal."""
        self._record_oom(error, fatal=False)

    def _record_oom(self, error: BaseException | None, *, fatal: bool) -> None:
        record = {
            "update": self._loop.current,
            "segment": self.segment.segment,
            "fatal": fatal,
            "time": round(time.time(), 3),
            "message": str(error).splitlines()[0][:200] if error is not None and str(error) else "",
        }
        try:
            record_oom(self.dir.train_dir, self.rank, record)
        except OSError as exc:  # a full disk must not hide the error being counted
            logger.warning(f"[torchrelay] could not record an out-of-memory error: {exc}")

    def dataloader(
        self,
        dataset: Any,
        collate_fn: Any = None,
        *,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: str | None = None,
    ) -> RelayLoader:
        """A loader over `dataset[i]` (i = manifest index) in the run's exact order; workers from the config.

        A dataset with `wants_context = True` gets `dataset[ctx]`, a SampleContext (index, epoch, update, seed).
        Workers are forked, or started by a forkserver while another thread runs Python (data/loader.py;
        `multiprocessing_context` chooses: "forkserver", "spawn" or "fork"); they survive the stop signals.
        """
        return RelayLoader(
            dataset,
            collate_fn,
            self.config.num_workers,
            pin_memory,
            prefetch_factor,
            persistent_workers,
            multiprocessing_context,
        )

    def steps(self, loader: RelayLoader) -> Iterator[Step]:
        """Yield one Step per update until the schedule ends or a stop is agreed; saves on the way."""
        if self._finished_before:
            if self.rank == 0:
                logger.info(
                    f"[torchrelay] {self.dir.path} is finished (update {self.start_update} of "
                    f"{self.config.total_updates}): nothing to train, nothing recorded"
                )
            self.exit_code, self.ended = EXIT_FINISHED, Ended.FINISHED
            self._end_segment(self.start_update)
            return
        yield from self._loop.run(loader, self._finish)

    def _finish(self, code: int, done: int) -> None:
        """The loop ended after update `done` (the schedule's end or an agreed stop), its checkpoint complete."""
        self.exit_code = code
        self.ended = ended_of(code)
        if self.rank == 0:
            why = self._agreement.why
            logger.info(f"[torchrelay] stopped at update {done}: {self.ended} {why}".rstrip())
            if code and self.ended in (Ended.REQUEST, Ended.MEMORY):
                self._agreement.consume_request(self.dir.train_dir / "stop-requests")
        self._end_segment(done)

    def _end_segment(self, last_update: int | None) -> None:
        self._saver.close()  # the segment's end is recorded only once its last checkpoint is complete
        self.metrics_log.close()
        self.exposures_log.close()
        self._digests.close()
        if self.rank == 0 and not (self._finished_before and self.ended == Ended.FINISHED):
            seg = self.segment
            seg.ended, seg.exit_code, seg.stopped = self.ended, self.exit_code, time.time()
            seg.last_update = last_update
            seg.notes = seg.notes + self._notes
            try:
                upsert(self.dir, seg.to_dict())
            except (OSError, RelayError) as exc:  # a full disk must not hide the error that ended the run
                logger.warning(f"[torchrelay] could not record the segment in history.jsonl: {exc}")
        self._opener.unlock()
        self._agreement.close()
        self._closed = True

    def close(self, error: BaseException | None = None) -> int:
        """Finish the segment's history record and return the process exit code."""
        # A failure this rank held for its peers' next exchange (run/loop.py's Feed), when the script left the
        # loop before any came: raised here, by this rank alone, rather than lost.
        held = collective.take_deferred()
        if held is not None and error is None:
            error = held
        if not self._closed:
            try:
                self._saver.wait()  # a checkpoint being written is committed before the segment ends
            except BaseException as exc:  # noqa: BLE001 - the error that ended the run comes first
                self._notes.append(f"rank {self.rank}: the background save failed: {str(exc)[:300]}")
                error = error if error is not None else exc
            last = max((int(r["update"]) for r in iter_records(self.metrics_log.path)), default=None)
            # A refusal met inside the loop (a tracked set that differs from the checkpoint's) ends `refused`.
            self.exit_code = error.exit_code if isinstance(error, RelayError) else EXIT_ERROR
            self.ended = Ended.REFUSED if self.exit_code == EXIT_REFUSED else Ended.ERROR
            if error is not None:
                # whole (a contract refusal is several lines): `status --last-exit` shows it
                self._notes.append(f"rank {self.rank}: {type(error).__name__}: {str(error)[:2000]}")
            else:  # the script left run.steps (a break, a return) before the schedule's end or an agreed stop
                why = "the script left run.steps before the schedule's end or an agreed stop"
                self._notes.append(f"rank {self.rank}: {why}")
                if self.rank == 0:
                    logger.warning(
                        f"[torchrelay] {why} (after update {last}): ended {self.ended}, exit {self.exit_code}; "
                        "a resume continues from the newest complete checkpoint. To end early and keep every "
                        "update, request a stop (`torchrelay stop RUN_DIR`, or a REQUEST_STOP file) and let "
                        "the loop end"
                    )
            if isinstance(error, torch.OutOfMemoryError):
                self._record_oom(error, fatal=True)
            self._end_segment(last)
        if held is not None and error is held:
            raise held
        return self.exit_code

    def _start_over(self, error: RelayError) -> None:
        """A refusal agreed in the loop before any checkpoint: the run directory holds the refused settings (its
        contract), so a launch with the hint's other setting would be refused again, as a change. The hint says
        so (on every rank, before rank 0 says it)."""
        if self._saver.last < 0:
            start_over(error, self.dir)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(exc)


__all__ = ["Run", "Step", "canonical_json"]
