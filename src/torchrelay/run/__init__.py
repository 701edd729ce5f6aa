"""The Run: opens or resumes a run directory, restores state, drives the update loop, stops cleanly.

A newcomer should read this file top to bottom: `open` (contract, checkpoint choice, history), `track`
(restore), `steps` (the loop and its boundaries), `close` (history, exit); saves are `saver.py`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrelay import __version__
from torchrelay import errors as errors_module
from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.adapters import adapt
from torchrelay.checkpoint.commit import clean_stale
from torchrelay.checkpoint.deepspeed_engine import check_engine, is_engine
from torchrelay.config import RelayConfig
from torchrelay.contract import build_contract, canonical_json, write_contract
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder
from torchrelay.ended import Ended, ended_of
from torchrelay.errors import (
    EXIT_ERROR,
    EXIT_FINISHED,
    EXIT_REFUSED,
    ConfigError,
    PathError,
    RelayError,
    from_exception,
    install_excepthook,
    mark_reported,
    report,
    run_opening,
)
from torchrelay.fsutil import atomic_write_text
from torchrelay.history import close_crashed, new_id, read_history, upsert, write_history
from torchrelay.identity import (
    find_code_dir,
    fingerprint_differences,
    fingerprint_summary,
    node_fingerprint,
    running_files,
    versions,
)
from torchrelay.lock import LOCK_FILES, RunLock
from torchrelay.log import ensure_voice, logger, set_rank
from torchrelay.logs import RankLog, exposures_path, metrics_path, trim_after
from torchrelay.manifest import Manifest
from torchrelay.resume import keep_prepared, schedule_gate, validate_resume
from torchrelay.run.restore import Tracked
from torchrelay.run.saver import Saver, first_estimate, last_save_seconds
from torchrelay.rundir import RunDir
from torchrelay.stop import (
    REQUEST_FILE,
    SignalFlag,
    StopContext,
    StopRequest,
    deadline_from_env,
    decide,
    is_stale,
    job_start,
)
from torchrelay.util.jsonl import iter_records

MANIFEST_IN_RUN = "data/manifest.jsonl"
# A relaunch may start while the previous holder's last DataLoader worker still exits, or while `status` peeks.
LOCK_WAIT_S = float(os.environ.get("TORCHRELAY_LOCK_WAIT_S", "3"))


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Step:
    """One update: its micro-batches and what the loop logs about it."""

    __slots__ = ("update", "_it", "_accum", "_ids", "metrics")

    def __init__(self, update: int, it: Iterator[Any], accum: int) -> None:
        self.update = update
        self._it = it
        self._accum = accum
        self._ids: list[list[int]] = []
        self.metrics: dict[str, Any] = {}

    def micro_batches(self, model: torch.nn.Module | None = None) -> Iterator[tuple[int, Any]]:
        """(micro_step, batch) for each of the update's gradient-accumulation steps.

        Given the DDP or FSDP2 model, gradients are synchronized only in the last micro-step: the loop body
        of every other one runs under `model.no_sync()` (DDP) or `set_requires_gradient_sync(False)` (FSDP2).
        """
        deferred = _sync_deferral(model)
        for micro in range(self._accum):
            try:
                ids, batch = next(self._it)
            except OSError as exc:  # the dataset could not read a sample (in this process or in a worker)
                raise _sample_error(exc, self.update) from exc
            self._ids.append(ids)
            with deferred(micro == self._accum - 1):
                yield micro, batch

    def log(self, **metrics: Any) -> None:
        """Record this rank's metrics for the update (loss, lr, ...); tensors become floats."""
        for key, value in metrics.items():
            self.metrics[key] = float(value) if isinstance(value, torch.Tensor) else value


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


def _sync_deferral(model: torch.nn.Module | None) -> Callable[[bool], AbstractContextManager[Any]]:
    """For a micro-step (is it the last?), the context the loop body runs in: gradients sync in the last only."""
    if model is None:
        return lambda last: contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return lambda last: contextlib.nullcontext() if last else model.no_sync()
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


class Run:
    """A resumable training run in a run directory (see docs/CORE_API.md for the loop)."""

    rank: int
    world_size: int
    distributed: bool
    dir: RunDir
    code_dir: Path | None
    config: RelayConfig
    contract_sha: str
    resume_from: Path | None
    start_update: int
    segment: dict[str, Any]
    gate: str
    hosts: list[Any]
    ranks_by_host: dict[str, list[int]]
    manifest: Manifest
    global_batch: int
    order: GlobalOrder
    metrics_log: RankLog
    exposures_log: RankLog
    exit_code: int
    ended: str
    job: str | None
    _closed: bool
    _stale_reported: bool
    _notes: list[str]
    _rank0_manifest: Manifest | None
    _tracked: Tracked
    _saver: Saver
    _signals: SignalFlag
    _finished_before: bool
    _deadline: float | None
    _margin: float
    _request_cache: tuple[tuple[int, int], StopRequest | None] | None
    _agree_group: Any
    _agree_seconds: float
    _max_interval: int
    _last_flush: float
    _stop_why: str
    _lock: RunLock | None
    _opened_at: float

    def __init__(self) -> None:  # use Run.open
        raise TypeError("use Run.open(run_dir, config)")

    # ---------------------------------------------------------------------------------- opening
    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike[str] | None,
        config: RelayConfig | None = None,
        *,
        code_dir: str | os.PathLike[str] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Run:
        """Create the run, or validate and resume it from its newest complete checkpoint (every rank).

        A refusal reaches every rank as the same RelayError; rank 0 prints it once and records the launch in
        history.jsonl as a segment that ended `refused` (exit 2), unless another writer holds the run.
        """
        install_excepthook()  # an uncaught refusal: one message and its exit code, not a traceback per rank
        ensure_voice()  # the library logs; a script that configured no logging still sees its lines
        run_opening()
        self = object.__new__(cls)
        self.rank, self.world_size = _dist()
        set_rank(self.rank)
        self.distributed = self.world_size > 1
        self._opened_at = time.time()
        env_dir = os.environ.get("TORCHRELAY_RUN_DIR")
        if env_dir:
            run_dir = env_dir
        if run_dir is None:
            raise self._everywhere(ConfigError("no run directory given (argument or TORCHRELAY_RUN_DIR)"))
        self.dir = RunDir(Path(run_dir).resolve())
        self.code_dir = Path(code_dir) if code_dir else find_code_dir()
        self.exit_code = EXIT_ERROR
        self.ended = Ended.RUNNING
        self._closed = False
        self._stale_reported = False
        self._notes = []
        self._rank0_manifest = None
        self._lock = None
        overrides = dict(overrides or {})
        if os.environ.get("TORCHRELAY_OVERRIDES"):
            try:
                overrides.update(json.loads(os.environ["TORCHRELAY_OVERRIDES"]))
            except (ValueError, TypeError) as exc:
                raise self._everywhere(
                    ConfigError(f"TORCHRELAY_OVERRIDES is not a JSON object ({exc})")
                ) from None
        try:  # fixed once for the job (see job_start); a bad value refuses here, before anything is touched
            deadline = deadline_from_env(os.environ, job_start())
        except ConfigError as exc:
            raise self._everywhere(exc) from None

        # Rank 0 validates and prepares the directory; the outcome, or whatever it raised, reaches every rank, so
        # that no rank waits for an answer that never comes.
        outcome: dict[str, Any] = {}
        raised: BaseException | None = None  # what rank 0 raises when it failed
        if self.rank == 0:
            try:
                outcome = self._prepare_dir(config, overrides)
            except BaseException as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
                err = _as_relay_error(exc, 0)
                self._refuse(err, record=isinstance(exc, Exception))
                if _plain(exc):
                    report(err, 0)  # said now: once the others raise, torchrun may end this process
                raised = err if _plain(exc) else exc  # a bug keeps its traceback
                outcome = {"error": _wire(err)}
        outcome = self._broadcast(outcome)
        if "error" in outcome:
            raise raised if raised is not None else mark_reported(_unwire(0, outcome["error"]))
        self.segment = outcome["segment"]
        # What every rank does on its own (read the manifest, open its logs) can fail on one rank only: the
        # ranks agree on it in the same gather that collects the hosts.
        local: BaseException | None = None
        fingerprint: dict[str, Any] | None = None
        try:
            self._open_locally(outcome)
            # Each node has its own environment and maybe its own checkout: compared with rank 0's below.
            fingerprint = node_fingerprint(self.code_dir, self.config.pins) if self.distributed else None
        except Exception as exc:  # noqa: BLE001 - as above
            local = exc
        mine = None if local is None else _as_relay_error(local, self.rank)
        host = socket.gethostname()
        summary = None if fingerprint is None else fingerprint_summary(fingerprint)
        gathered = self._gather_all((host, None if mine is None else _wire(mine), summary))
        self.hosts = sorted({h for h, _, _ in gathered})
        self.ranks_by_host = {h: [r for r, g in enumerate(gathered) if g[0] == h] for h in self.hosts}
        failed = [(rank, wire) for rank, (_, wire, _) in enumerate(gathered) if wire is not None]
        other = None
        if not failed and self.distributed:
            if len({g[2]["code_sha256"] for g in gathered}) > 1:  # every rank sees it: all gather the files
                full = self._gather_all(fingerprint)
                gathered = [(h, w, f) for (h, w, _), f in zip(gathered, full, strict=True)]
            other = _other_node(gathered)
        if failed or other is not None:
            first = _unwire(*failed[0]) if failed else other
            assert first is not None
            if self.rank == 0:
                self._refuse(mine or first, record=True, segment={**self.segment, "hosts": self.hosts})
            if local is not None and mine is not None:
                raise mine if _plain(local) else local  # said by the hook, on this rank
            raise first if self.rank == 0 and other is not None else mark_reported(first)  # one rank says it
        self._signals = SignalFlag()
        self._signals.install()
        self._deadline = deadline.at if deadline else None
        # A relaunch of a finished run trains nothing and records nothing (steps() says so).
        self._finished_before = self.start_update >= self.config.total_updates
        self._tracked = Tracked()
        self._saver = Saver(
            self.dir.path,
            self.config,
            self._tracked,
            rank=self.rank,
            world_size=self.world_size,
            contract_sha=self.contract_sha,
            segment=self.segment["segment"],
            order=self.order,
            global_batch=self.global_batch,
            logs=(self.metrics_log, self.exposures_log),
            saved=self.start_update if self.resume_from is not None else None,
            estimate=first_estimate(outcome["last_save_s"]),
        )
        self._margin = float(os.environ.get("TORCHRELAY_MARGIN_S", "1.0"))
        self._request_cache = None
        self.job = os.environ.get("SLURM_JOB_ID")
        self._agree_group = dist.new_group(backend="gloo") if self.distributed else None
        self._agree_seconds = 0.0
        self._max_interval = int(os.environ.get("TORCHRELAY_CHECK_EVERY", "64"))
        self._last_flush = 0.0
        if self.rank == 0 and not self._finished_before:
            self.segment["hosts"] = self.hosts
            self.segment["ranks_by_host"] = self.ranks_by_host
            self.segment["deadline"] = self._deadline
            if deadline:
                left = deadline.at - time.time()
                logger.info(f"[torchrelay] deadline in {left:.1f}s ({deadline.source})")
            upsert(self.dir.path, self.segment)
        return self

    def _open_locally(self, outcome: dict[str, Any]) -> None:
        """This rank's part of opening: the configuration rank 0 settled, the manifest, the order, the logs."""
        self.config = RelayConfig.from_dict(outcome["config"])
        self.contract_sha = outcome["contract_sha"]
        self.resume_from = Path(outcome["checkpoint"]) if outcome["checkpoint"] else None
        self.start_update = int(outcome["update"])
        self.gate = outcome["gate"]
        # Rank 0 read the manifest to check the contract and left its index; the others read only that.
        self.manifest = (
            self._rank0_manifest
            if self._rank0_manifest is not None
            else Manifest.load(
                self._manifest_path(self.config),
                self.config.data_root,
                index=self.dir.manifest_index_path,
                sha256=outcome.get("manifest_sha256"),
            )
        )
        self._rank0_manifest = None
        self.global_batch = self.config.global_batch_for(self.world_size)
        self.order = GlobalOrder(
            num_samples=len(self.manifest),
            seed=self.config.seed,
            global_batch=self.global_batch,
            kind=self.config.sampler,
            lengths=self.manifest.lengths() if self.config.sampler == "length_bucketed" else None,
            bucket_size=self.config.bucket_size,
        )
        self.metrics_log = RankLog(metrics_path(self.dir.train_dir, self.rank))
        self.exposures_log = RankLog(exposures_path(self.dir.train_dir, self.rank))

    def _everywhere(self, err: RelayError) -> RelayError:
        """An error every rank raises alike before any collective: rank 0 says it, the others stay quiet."""
        return mark_reported(err) if self.rank != 0 else err

    def _refuse(self, err: RelayError, *, record: bool, segment: dict[str, Any] | None = None) -> None:
        """Rank 0, when opening failed: record the launch (if this process holds the run), let go of the lock."""
        if record:
            self._record_failed_launch(err, segment)
        self._unlock()

    def _record_failed_launch(self, err: RelayError, segment: dict[str, Any] | None) -> None:
        """A launch that refused (or failed) before its first update is a segment of its own, `refused` with exit
        2 (or `error`), so that `status --last-exit` and `torchrelay launch` read how it ended. Only while this
        process holds the run's lock: a RunBusy refusal leaves the history to the writer that owns it."""
        if self._lock is None or not self.dir.exists():
            return
        code = err.exit_code
        try:
            history = read_history(self.dir.path)
            if segment is None:
                last = next(
                    (s["last_update"] for s in reversed(history) if isinstance(s.get("last_update"), int)), 0
                )
                lineage = _read_lineage(self.dir.path)
                segment = {
                    "segment": new_id(),
                    "parent": _parent(history),
                    "lineage": lineage.get("lineage"),
                    "parent_lineage": lineage.get("parent_lineage"),
                    "job": os.environ.get("SLURM_JOB_ID"),
                    "command": [sys.executable, *sys.argv],
                    "hosts": [socket.gethostname()],
                    "world_size": self.world_size,
                    "first_update": last + 1,  # no update ran: an empty range, as for a launch that had none
                    "last_update": last,
                    "resumed_from": None,
                    "started": self._opened_at,
                    "contract_sha256": None,
                    "code": {"script": _script()},
                    "versions": {"torchrelay": __version__},
                    "runtime_changes": {},
                    "notes": [],
                }
            else:
                segment = dict(segment, last_update=segment["first_update"] - 1)
            segment.update(
                ended="refused" if code == EXIT_REFUSED else "error",
                exit_code=code,
                stopped=time.time(),
                notes=[*segment.get("notes", []), err.message[:2000]],
            )
            write_history(self.dir.path, [*close_crashed(history, None), segment])
        except (OSError, RelayError) as exc:
            logger.warning(f"[torchrelay] could not record the refused launch in history.jsonl: {exc}")

    def _manifest_path(self, cfg: RelayConfig) -> Path:
        p = Path(cfg.manifest)
        return p if p.is_absolute() else self.dir.path / p

    def _prepare_dir(self, config: RelayConfig | None, overrides: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: create a new run, or check the contract and choose the checkpoint to resume."""
        rd = self.dir
        if config is None and not rd.exists():
            raise ConfigError(f"{rd.path} holds no run yet, and no configuration was given to create one")
        # One writer per run directory, from here to the end of the segment (a second launch is refused).
        self._lock = RunLock(rd.path, "train").acquire(wait_s=LOCK_WAIT_S, create_dir=True)
        if rd.exists():
            stored = rd.load_config()
            cfg = config if config is not None else stored
            kept: list[str] = []
            if config is not None and cfg.manifest != stored.manifest:
                cfg = cfg.replace(manifest=stored.manifest)  # the run's own copy, unless overridden below
            if config is not None:
                cfg, kept = keep_prepared(rd.path, stored, cfg, overrides)  # prepare's fields win
                for note in kept:
                    logger.warning(f"[torchrelay] warning: {note}")
            cfg = cfg.with_overrides(overrides) if overrides else cfg
            clean_stale(rd.path)  # our own leftovers (a killed save or pack) are removed, never refused
            # The script and the modules it imported from the code directory, tracked by git or not.
            # Names and sizes only here: every rank hashes the files it loads as it reads them (run.track), so no
            # rank waits while this one reads the whole checkpoint
            check = validate_resume(
                rd.path,
                cfg,
                self.world_size,
                self.code_dir,
                code_files=running_files(self.code_dir),
                deep=False,
            )
            rd.remove_stale_temps()
            history = read_history(rd.path)
            last_logged = max(
                (int(r["update"]) for r in iter_records(metrics_path(rd.train_dir, 0))), default=None
            )
            write_history(rd.path, close_crashed(history, last_logged))
            archived = trim_after(rd.train_dir, check.update)
            if check.runtime_changes:
                atomic_write_text(rd.config_path, json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
            contract_sha = check.recorded["sha256"]  # the run's one digest (see resume.validate_resume)
            code_fields = check.recorded["fields"]
            self._rank0_manifest = check.manifest
            if not check.manifest.indexed:  # the next launch, and the other ranks now, read no line
                check.manifest.save_index(rd.manifest_index_path)
            update, ckpt = check.update, check.checkpoint
            reclaim_note = _reclaim(rd.path, ckpt) if ckpt is not None else None
            changes = check.runtime_changes
            gate = check.passed[-1]
            last_save = last_save_seconds(ckpt)
            parent = _parent(history)
            notes = (
                [f"trimmed logs past update {update} into {archived.relative_to(rd.path)}"]
                if archived
                else []
            )
            if reclaim_note:
                notes.append(reclaim_note)
            notes += kept
        else:
            assert config is not None
            cfg = config.with_overrides(overrides) if overrides else config
            # A stop request may be written before the first launch (audits stop at chosen updates), a
            # controller may have recorded its attempts there, and a creation killed before it wrote the
            # contract leaves files that this creation overwrites.
            leftovers = (
                rd.unexplained_entries((REQUEST_FILE, "attempts", *LOCK_FILES))[:5]
                if rd.path.exists()
                else []
            )
            if leftovers:
                raise ConfigError(
                    f"{rd.path} is not empty ({leftovers}) and holds no torchrelay run",
                    hint="choose an empty or new run directory",
                )
            # Everything that can refuse (the manifest, the code identity) is checked before anything is written.
            source_manifest = cfg.manifest
            self._rank0_manifest = Manifest.load(source_manifest, cfg.data_root)
            cfg = cfg.replace(manifest=MANIFEST_IN_RUN)
            contract = build_contract(
                cfg,
                self.world_size,
                self.code_dir,
                self._rank0_manifest,
                code_files=running_files(self.code_dir),
            )
            code_fields = contract["fields"]
            (rd.path / "data").mkdir(parents=True, exist_ok=True)
            rd.train_dir.mkdir(exist_ok=True)
            rd.remove_stale_temps()
            shutil.copyfile(source_manifest, rd.path / MANIFEST_IN_RUN)
            self._rank0_manifest.save_index(rd.manifest_index_path)
            self._rank0_manifest = Manifest.load(  # the run's copy, found by its index
                rd.path / MANIFEST_IN_RUN,
                cfg.data_root,
                index=rd.manifest_index_path,
                sha256=self._rank0_manifest.sha256(),
            )
            atomic_write_text(rd.config_path, json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
            atomic_write_text(
                rd.path / "lineage.json", json.dumps({"lineage": new_id(), "parent_lineage": None})
            )
            write_contract(rd.path, contract)  # last: from here on the directory holds a run
            contract_sha, update, ckpt, changes, last_save, parent, notes = (
                contract["sha256"],
                0,
                None,
                {},
                None,
                None,
                [],
            )
            gate = schedule_gate(cfg, 0, str(rd.path))
        lineage = _read_lineage(rd.path)
        segment = {
            "segment": new_id(),
            "parent": parent,
            "lineage": lineage.get("lineage"),
            "parent_lineage": lineage.get("parent_lineage"),
            "job": os.environ.get("SLURM_JOB_ID"),
            "command": [sys.executable, *sys.argv],
            "hosts": [],
            "world_size": self.world_size,
            "first_update": update + 1,
            "last_update": None,
            "resumed_from": update if ckpt else None,
            "ended": "running",
            "exit_code": None,
            "started": time.time(),
            "stopped": None,
            "contract_sha256": contract_sha,
            "code": {
                **{k.removeprefix("code."): v for k, v in code_fields.items() if k.startswith("code.")},
                "script": _script(),
            },
            "versions": versions([]) | {"torchrelay": __version__},
            "runtime_changes": changes,
            "notes": notes,
        }
        return {
            "config": cfg.to_dict(),
            "contract_sha": contract_sha,
            "checkpoint": str(ckpt) if ckpt else None,
            "update": update,
            "segment": segment,
            "gate": gate,
            "last_save_s": last_save,
            "manifest_sha256": self._rank0_manifest.sha256(),
        }

    # ---------------------------------------------------------------------------------- collectives
    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather_all(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _agree(self, code: int, interval: int) -> tuple[int, int]:
        """(largest stop code, smallest interval) over ranks: one all-reduce of two integers, on a CPU group
        of its own so that a CUDA run never synchronizes its stream for it."""
        if not self.distributed:
            return code, interval
        t0 = time.perf_counter()
        t = torch.tensor([code, -interval], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_group)
        spent = time.perf_counter() - t0
        self._agree_seconds = spent if not self._agree_seconds else 0.8 * self._agree_seconds + 0.2 * spent
        return int(t[0]), -int(t[1])

    # ---------------------------------------------------------------------------------- state
    def track(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **statefuls: Any,
    ) -> None:
        """Register what must resume (model, optimizer, scheduler, scaler, generators, ...) and restore it if
        resuming; each rank's own values come back to it (see checkpoint/ranks.py)."""
        if is_engine(model):  # a DeepSpeed engine: its configuration must be the contract's
            check_engine(model, optimizer, self.config)
        tracked = self._tracked
        tracked.model, tracked.optimizer = model, optimizer
        tracked.statefuls = {name: adapt(name, obj) for name, obj in statefuls.items()}
        if self.resume_from is not None:
            loop = ckpt_state.load_state(
                self.resume_from,
                rank=self.rank,
                model=model,
                optimizer=optimizer,
                statefuls=tracked.statefuls,
                verify=True,
            )
            if int(loop["update"]) != self.start_update:
                raise RelayError(f"{self.resume_from}: trainer state says update {loop['update']}")

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
        Workers start from a forkserver when the script has a main guard and the dataset pickles, else by fork
        (`multiprocessing_context` chooses: "forkserver", "spawn" or "fork"); they survive the stop signals.
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

    # ---------------------------------------------------------------------------------- the loop
    def steps(self, loader: RelayLoader) -> Iterator[Step]:
        """Yield one Step per update until the schedule ends or a stop is agreed; saves on the way."""
        cfg = self.config
        if self._finished_before:
            if self.rank == 0:
                logger.info(
                    f"[torchrelay] {self.dir.path} is finished (update {self.start_update} of "
                    f"{cfg.total_updates}): nothing to train, nothing recorded"
                )
            self.exit_code, self.ended = EXIT_FINISHED, Ended.FINISHED
            self._end_segment(self.start_update)
            return
        if self.resume_from is not None:
            ckpt_state.load_rng(self.resume_from, self.rank)
        logger.info(f"[rank {self.rank}] {self.gate}")
        logger.info(f"[rank {self.rank}] TRAINING_CONTRACT {self.contract_sha}")
        batches = RankBatches(
            self.order,
            self.start_update,
            cfg.total_updates,
            self.rank,
            self.world_size,
            cfg.micro_batch,
            cfg.grad_accum,
        )
        context, note = loader.context()
        if note and self.rank == 0:
            logger.warning(f"[torchrelay] {note}")
            self._notes.append(note)
        it = loader.start(batches, cfg.seed, context)
        saver = self._saver
        done = self.start_update
        recent: deque[float] = deque(maxlen=5)
        next_check = done  # the first boundary always agrees
        try:
            while True:
                code = 0
                if done == next_check:
                    code, interval = self._agree(*self._propose(done, recent))
                    next_check = done + interval
                if done >= cfg.total_updates or code:
                    if saver.unsaved(done):
                        saver.save(done)
                    saver.wait()
                    self._finish(EXIT_FINISHED if done >= cfg.total_updates else code, done)
                    return
                step = Step(done + 1, it, cfg.grad_accum)
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

    def _propose(self, done: int, recent: deque[float]) -> tuple[int, int]:
        """This rank's stop code and the number of updates until the next agreement.

        Agreeing costs one small all-reduce; when updates are short the ranks agree every few updates, so
        that agreement stays under 0.1 % of update time and a stop lands within about a second.
        """
        update_s = max(recent) if recent else 0.0
        interval = 1
        if update_s > 0 and self._agree_seconds > 0:
            interval = math.ceil(self._agree_seconds / (0.001 * update_s))
            interval = max(1, min(interval, int(1.0 / update_s) or 1, self._max_interval))
        request = self._read_request() if self.rank == 0 else None
        if (
            request is not None
            and request.at_update is not None
            and request.at_update > done
            and not is_stale(request, self.job)
        ):
            interval = min(interval, request.at_update - done)  # land exactly on the requested update
        interval = min(interval, max(1, self.config.total_updates - done))
        return self._local_stop_code(done, update_s, interval, request), interval

    def _local_stop_code(self, done: int, update_s: float, interval: int, request: StopRequest | None) -> int:
        """This rank's stop proposal at an agreement boundary; only rank 0 reads the request file."""
        if request is not None and request.note and request.note not in self._notes:
            logger.warning(f"[torchrelay] {request.note}")
            self._notes.append(request.note)
        if request is not None and is_stale(request, self.job):
            if not self._stale_reported:
                note = f"ignored stale stop request for job {request.job} (this job: {self.job})"
                logger.warning(f"[torchrelay] {note}")
                self._notes.append(note)
                self._stale_reported = True
            request = None
        ctx = StopContext(
            updates_done=done,
            now=time.time(),
            job=self.job,
            request=request,
            signal_name=self._signals.received,
            deadline=self._deadline,
            update_seconds=update_s,
            save_seconds=self._saver.budget_seconds(),
            margin_seconds=self._margin,
            updates_to_next_check=interval,
        )
        verdict = decide(ctx)
        if verdict is None:
            return 0
        self._stop_why = verdict.why
        return verdict.code

    def _read_request(self) -> StopRequest | None:
        path = self.dir.path / REQUEST_FILE
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if self._request_cache is None or self._request_cache[0] != key:
            self._request_cache = (key, StopRequest.read(path))
        return self._request_cache[1]

    def _record(self, step: Step, dt: float) -> None:
        rec = {"update": step.update, **step.metrics}
        rec["update_time"] = round(dt, 6)
        rec["samples_per_s"] = round(self.global_batch / dt, 3) if dt > 0 else None
        rec["time"] = round(time.time(), 3)
        self.metrics_log.write(rec)
        for micro, ids in enumerate(step._ids):
            self.exposures_log.write({"u": step.update, "m": micro, "i": ids})
        # Lines past the newest checkpoint are trimmed on resume anyway, so flushing about twice a second
        # (and durably before every save) loses nothing a resume needs and keeps syscalls out of the loop.
        now = time.perf_counter()
        if now - self._last_flush > 0.5:
            self.metrics_log.flush()
            self.exposures_log.flush()
            self._last_flush = now

    # ---------------------------------------------------------------------------------- ending
    def _finish(self, code: int, done: int) -> None:
        self.exit_code = code
        self.ended = ended_of(code)
        if self.rank == 0:
            why = getattr(self, "_stop_why", "")
            logger.info(f"[torchrelay] stopped at update {done}: {self.ended} {why}".rstrip())
            if code and self.ended in (Ended.REQUEST, Ended.MEMORY):
                self._consume_request()
        self._end_segment(done)

    def _consume_request(self) -> None:
        src = self.dir.path / REQUEST_FILE
        if src.exists():
            dst = self.dir.train_dir / "stop-requests"
            dst.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst / f"REQUEST_STOP-{int(time.time() * 1000)}.json")

    def _end_segment(self, last_update: int | None) -> None:
        self._saver.close()  # the segment's end is recorded only once its last checkpoint is complete
        self.metrics_log.close()
        self.exposures_log.close()
        if self.rank == 0 and not (self._finished_before and self.ended == Ended.FINISHED):
            seg = self.segment
            seg.update(
                ended=self.ended,
                exit_code=self.exit_code,
                stopped=time.time(),
                last_update=last_update,
                notes=seg["notes"] + self._notes,
            )
            try:
                upsert(self.dir.path, seg)
            except (OSError, RelayError) as exc:  # a full disk must not hide the error that ended the run
                logger.warning(f"[torchrelay] could not record the segment in history.jsonl: {exc}")
        self._unlock()
        self._signals.restore()
        self._closed = True

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self, error: BaseException | None = None) -> int:
        """Finish the segment's history record and return the process exit code."""
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
                self._notes.append(f"rank {self.rank}: {type(error).__name__}: {str(error)[:300]}")
            self._end_segment(last)
        return self.exit_code

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(exc)


def _script() -> str | None:
    return str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else None


def _parent(history: list[dict[str, Any]]) -> str | None:
    """The segment a new one continues: the last that ran (a refused launch continued nothing)."""
    return next((s.get("segment") for s in reversed(history) if s.get("ended") != "refused"), None)


def _other_node(gathered: list[tuple[str, Any, dict[str, Any] | None]]) -> ConfigError | None:
    """A refusal naming the first rank whose versions or program files differ from rank 0's, or None."""
    host0, _, reference = gathered[0]
    for rank, (host, _, fingerprint) in enumerate(gathered):
        if rank == 0 or reference is None or fingerprint is None:
            continue
        differ = fingerprint_differences(reference, fingerprint)
        if differ:
            more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
            return ConfigError(
                f"rank {rank} on {host} does not run what rank 0 on {host0} runs: {'; '.join(differ[:5])}{more}",
                hint="every node must run the same code and versions: sync that node's checkout or environment "
                "with rank 0's and launch again",
            )
    return None


def _plain(exc: BaseException) -> bool:
    """An error that one message explains: the library's own, a path, a full disk, a file that is not text."""
    return isinstance(exc, (RelayError, OSError, UnicodeDecodeError))


def _as_relay_error(exc: BaseException, rank: int) -> RelayError:
    """The error as it travels to the other ranks: a plain one as itself (an OSError on a path is refused naming
    the path), any other (a bug) as a note that points to the traceback on the rank that raised it."""
    if _plain(exc):
        return from_exception(exc, "opening the run")
    return RelayError(
        f"opening the run failed on rank {rank} with {type(exc).__name__}: {str(exc)[:500]}",
        hint=f"rank {rank}'s output holds the traceback",
    )


def _wire(err: RelayError) -> tuple[str, str, str | None, int]:
    return (type(err).__name__, err.message, err.hint, err.exit_code)


def _unwire(rank: int, wire: tuple[str, str, str | None, int]) -> RelayError:
    """The error another rank raised, as the same class here, whatever its constructor takes."""
    name, message, hint, code = wire
    cls_ = getattr(errors_module, name, RelayError)
    if not (isinstance(cls_, type) and issubclass(cls_, RelayError)):
        cls_ = RelayError
    err = cls_.__new__(cls_)
    RelayError.__init__(err, message if rank == 0 else f"rank {rank}: {message}", hint)
    err.exit_code = code
    return err


def _reclaim(run_dir: Path, ckpt: Path) -> str | None:
    """Continuing a handed-off checkpoint on purpose (TORCHRELAY_RECLAIM=1) starts a new lineage, on record."""
    marker = ckpt / "HANDED_OFF.json"
    if not marker.exists():
        return None
    try:
        handed = json.loads(marker.read_text())
    except (OSError, ValueError):
        handed = {}
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    os.replace(marker, ckpt / f"HANDED_OFF.reclaimed-{stamp}.json")
    old = _read_lineage(run_dir)
    new = {"lineage": new_id(), "parent_lineage": old.get("lineage")}
    atomic_write_text(run_dir / "lineage.json", json.dumps(new))
    return (
        f"reclaimed {ckpt.name}, handed off to bundle lineage {handed.get('lineage', '?')}: "
        f"new lineage {new['lineage']} (parent {old.get('lineage')})"
    )


def _read_lineage(run_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((run_dir / "lineage.json").read_text()))
    except (OSError, ValueError, TypeError):  # unreadable, not UTF-8, not JSON, not an object
        return {}


__all__ = ["Run", "Step", "canonical_json"]
