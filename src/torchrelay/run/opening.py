"""The segment opener: rank 0 prepares the run directory (writer lock, configuration, resume validation, stale
cleanup, crash repair, log trim, lineage and reclaim, the segment's record), every rank opens its own part (the
manifest, the data order, its logs), and whatever fails on any rank reaches every rank as the same error, so that
no rank waits for an answer that never comes and all refuse together.

A launch that fails here is on record in history.jsonl as a segment that ended `refused` (exit 2) or `error`,
unless another writer holds the run (docs/FORMATS.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchrelay import __version__, envvars
from torchrelay.checkpoint.commit import clean_stale
from torchrelay.checkpoint.handed_off import HANDED_OFF, RECLAIMED_PREFIX
from torchrelay.config import RelayConfig
from torchrelay.contract import build_contract, write_contract
from torchrelay.data.order import GlobalOrder
from torchrelay.ended import Ended
from torchrelay.errors import (
    EXIT_REFUSED,
    ConfigError,
    RelayError,
    mark_reported,
)
from torchrelay.fsutil import atomic_write_text
from torchrelay.history import ABSENT, Segment, close_crashed, new_id, read_history, write_history
from torchrelay.identity import (
    fingerprint_differences,
    fingerprint_summary,
    node_fingerprint,
    running_files,
    tree_note,
    versions,
)
from torchrelay.layout import LINEAGE_FILE, MANIFEST_REL
from torchrelay.lock import LOCK_FILES, RunLock
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.numerics import check_resume, gather
from torchrelay.reshard import Layout
from torchrelay.resume import keep_prepared, schedule_gate, validate_resume
from torchrelay.run.saver import last_save_seconds
from torchrelay.rundir import RunDir
from torchrelay.stop import REQUEST_FILE, Deadline, deadline_from_env, job_start
from torchrelay.train_records import RankLog, exposures_path, metrics_path, trim_after
from torchrelay.util import collective
from torchrelay.util.jsonl import iter_records
from torchrelay.util.records import read_json_or_none


@dataclass(frozen=True, slots=True)
class Prepared:
    """What rank 0 settled, as it travels to every rank."""

    config: dict[str, Any]
    contract_sha: str
    checkpoint: str | None  # the checkpoint to resume from
    update: int  # the update it holds (0: a new run)
    segment: Segment
    gate: str  # the line that says which resume gate passed
    last_save_s: float | None  # how long that checkpoint took to save
    manifest_sha256: str  # the manifest's, so that the other ranks read only its index


@dataclass(slots=True)
class Opened:
    """One segment as this rank holds it once every rank opened it."""

    config: RelayConfig
    contract_sha: str
    resume_from: Path | None
    start_update: int
    gate: str
    segment: Segment
    last_save_s: float | None
    deadline: Deadline | None
    hosts: list[str]
    ranks_by_host: dict[str, list[int]]
    manifest: Manifest
    global_batch: int
    order: GlobalOrder
    metrics_log: RankLog
    exposures_log: RankLog


class SegmentOpener:
    """Opens a segment on every rank; rank 0 holds the run's writer lock from here to `unlock()`."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None,
        *,
        rank: int,
        world_size: int,
        code_dir: Path | None,
        reshard: bool = False,
    ) -> None:
        self.rank = rank
        self.reshard = reshard  # this launch may change the layout (reshard.py)
        self.world_size = world_size
        self.code_dir = code_dir
        self.lock: RunLock | None = None
        self._opened_at = time.time()
        self._rank0_manifest: Manifest | None = None
        run_dir = envvars.RUN_DIR.text() or run_dir
        if run_dir is None:
            raise self._everywhere(ConfigError("no run directory given (argument or TORCHRELAY_RUN_DIR)"))
        self.dir = RunDir(Path(run_dir).resolve())

    def open(self, config: RelayConfig | None, overrides: dict[str, Any] | None) -> Opened:
        """Open the segment (every rank); raises the same RelayError on every rank when any rank failed."""
        overrides = dict(overrides or {})
        try:
            overrides.update(envvars.OVERRIDES.get())
        except ConfigError as exc:
            raise self._everywhere(exc) from None
        try:  # fixed once for the job (see job_start); a bad value refuses here, before anything is touched
            deadline = deadline_from_env(os.environ, job_start())
        except ConfigError as exc:
            raise self._everywhere(exc) from None

        # Rank 0 validates and prepares the directory; the outcome, or whatever it raised, reaches every rank
        # (util/collective.py). Rank 0 records a refused launch and lets go of the lock before any rank raises.
        ranks = collective.ranks()
        try:
            with ranks.phase("opening the run", settle=self._settle, name_rank=False, end=False):
                outcome: Prepared = ranks.broadcast(
                    "opening the run", lambda: self.prepare(config, overrides)
                )
        except BaseException:
            self.unlock()  # an interrupt is not shared, and not recorded: the lock goes all the same
            raise
        # What every rank does on its own (read the manifest, open its logs) can fail on one rank only: the
        # ranks agree on it in the same gather that collects the hosts.
        distributed = self.world_size > 1
        segment = outcome.segment
        mine: dict[str, Any] = {}

        def local() -> tuple[str, dict[str, Any] | None]:
            mine["opened"] = self._open_locally(outcome, deadline)
            # Each node has its own environment and maybe its own checkout: compared with rank 0's below.
            mine["fingerprint"] = (
                node_fingerprint(self.code_dir, mine["opened"].config.pins) if distributed else None
            )
            summary = None if mine["fingerprint"] is None else fingerprint_summary(mine["fingerprint"])
            return socket.gethostname(), summary

        def settle(err: RelayError) -> None:  # a failure of the local part, recorded by rank 0
            self._settle(err, segment=replace(segment, hosts=[socket.gethostname()]))

        try:
            with ranks.phase("opening the run", settle=settle, end=False):
                gathered = ranks.all_gather("opening the run", local)
        except BaseException:
            self.unlock()
            raise
        opened: Opened = mine["opened"]
        hosts = sorted({h for h, _ in gathered})
        other = None
        if distributed:
            if (
                len({(g[1] or {}).get("code_sha256") for g in gathered}) > 1
            ):  # every rank sees it: all gather the files
                full = ranks.all_gather("opening the run", lambda: mine["fingerprint"])
                gathered = [(h, f) for (h, _), f in zip(gathered, full, strict=True)]
            other = _other_node(gathered)
        if other is not None:
            if self.rank == 0:
                self._refuse(other, record=True, segment=replace(segment, hosts=hosts))
            raise other if self.rank == 0 else mark_reported(other)  # the same on every rank: rank 0 says it
        assert opened is not None
        opened.hosts = hosts
        opened.ranks_by_host = {h: [r for r, g in enumerate(gathered) if g[0] == h] for h in hosts}
        return opened

    def _open_locally(self, prepared: Prepared, deadline: Deadline | None) -> Opened:
        """This rank's part of opening: the configuration rank 0 settled, the manifest, the order, the logs."""
        config = RelayConfig.from_dict(prepared.config)
        # Rank 0 read the manifest to check the contract and left its index; the others read only that. Where it
        # cannot serve (not written: a read-only place), every rank reads the lines at once, each in one process:
        # a reader per core for each would put ranks x cores processes on the cores.
        manifest = (
            self._rank0_manifest
            if self._rank0_manifest is not None
            else Manifest.load(
                self._manifest_path(config),
                config.data_root,
                index=self.dir.manifest_index_path,
                sha256=prepared.manifest_sha256,
                readers=1,
            )
        )
        self._rank0_manifest = None
        global_batch = config.global_batch_for(self.world_size)
        order = GlobalOrder(
            num_samples=len(manifest),
            seed=config.seed,
            global_batch=global_batch,
            kind=config.sampler,
            lengths=manifest.lengths() if config.sampler == "length_bucketed" else None,
            bucket_size=config.bucket_size,
        )
        return Opened(
            config=config,
            contract_sha=prepared.contract_sha,
            resume_from=Path(prepared.checkpoint) if prepared.checkpoint else None,
            start_update=int(prepared.update),
            gate=prepared.gate,
            segment=prepared.segment,
            last_save_s=prepared.last_save_s,
            deadline=deadline,
            hosts=[],
            ranks_by_host={},
            manifest=manifest,
            global_batch=global_batch,
            order=order,
            metrics_log=RankLog(metrics_path(self.dir.train_dir, self.rank)),
            exposures_log=RankLog(exposures_path(self.dir.train_dir, self.rank)),
        )

    def _manifest_path(self, cfg: RelayConfig) -> Path:
        p = Path(cfg.manifest)
        return p if p.is_absolute() else self.dir.path / p

    def prepare(self, config: RelayConfig | None, overrides: dict[str, Any]) -> Prepared:
        """Rank 0: create a new run, or check the contract and choose the checkpoint to resume."""
        rd = self.dir
        if config is None and not rd.exists():
            raise ConfigError(f"{rd.path} holds no run yet, and no configuration was given to create one")
        # One writer per run directory, from here to the end of the segment (a second launch is refused).
        # A relaunch may start while the previous holder's last DataLoader worker still exits, or while `status` peeks.
        self.lock = RunLock(rd.path, "train").acquire(wait_s=envvars.LOCK_WAIT_S.get(), create_dir=True)
        numerics, numerics_change = gather(), None
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
                reshard=self.reshard,
                explicit=set(overrides),
            )
            assert check.config is not None
            cfg = check.config  # with the layout this launch runs with
            code_note = tree_note(
                check.code_changes, commit=check.recorded["fields"].get("code.commit") is not None
            )
            if code_note:
                logger.warning(f"[torchrelay] warning: {code_note}")
            rd.remove_stale_temps()
            history = read_history(rd.path)
            if check.checkpoint is not None and check.update < cfg.total_updates:  # refused before any write
                numerics_change = check_resume(
                    history, numerics, upto=check.update, strict=cfg.strict_numerics
                )
            last_logged = max(
                (int(r["update"]) for r in iter_records(metrics_path(rd.train_dir, 0))), default=None
            )
            write_history(rd.path, close_crashed(history, last_logged))
            archived = trim_after(rd.train_dir, check.update)
            layout_change = check.layout_change
            split = (cfg.micro_batch, cfg.grad_accum)
            if check.runtime_changes or split != (stored.micro_batch, stored.grad_accum):
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
            if code_note:
                notes.append(code_note)
            if numerics_change:
                notes.append(numerics_change["line"])
            notes += kept
            if layout_change:
                notes += layout_change["notes"]
                logger.info(
                    f"[torchrelay] layout change at update {update}: {Layout(**layout_change['from'])} -> "
                    f"{Layout(**layout_change['to'])}, global batch {layout_change['global_batch']} kept; "
                    f"per-rank random streams {layout_change['rng']}"
                )
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
            cfg = cfg.replace(manifest=MANIFEST_REL)
            contract = build_contract(
                cfg,
                self.world_size,
                self.code_dir,
                self._rank0_manifest,
                code_files=running_files(self.code_dir),
                run_dir=rd.path,
            )
            code_fields = contract["fields"]
            (rd.path / "data").mkdir(parents=True, exist_ok=True)
            rd.train_dir.mkdir(exist_ok=True)
            rd.remove_stale_temps()
            shutil.copyfile(source_manifest, rd.path / MANIFEST_REL)
            self._rank0_manifest.save_index(rd.manifest_index_path)
            # The source's arrays go before the copy's are read (10 M samples: 240 MB each).
            source_sha, self._rank0_manifest = self._rank0_manifest.sha256(), None
            self._rank0_manifest = Manifest.load(  # the run's copy, found by its index
                rd.path / MANIFEST_REL, cfg.data_root, index=rd.manifest_index_path, sha256=source_sha
            )
            atomic_write_text(rd.config_path, json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
            atomic_write_text(
                rd.path / LINEAGE_FILE, json.dumps({"lineage": new_id(), "parent_lineage": None})
            )
            write_contract(rd.path, contract)  # last: from here on the directory holds a run
            contract_sha, update, ckpt, changes, last_save, parent = (
                contract["sha256"],
                0,
                None,
                {},
                None,
                None,
            )
            notes = []
            layout_change = None
            gate = schedule_gate(cfg, 0, str(rd.path))
        lineage = _read_lineage(rd.path)
        segment = Segment(
            segment=new_id(),
            parent=parent,
            lineage=lineage.get("lineage"),
            parent_lineage=lineage.get("parent_lineage"),
            job=os.environ.get("SLURM_JOB_ID"),
            command=[sys.executable, *sys.argv],
            hosts=[],
            world_size=self.world_size,
            first_update=update + 1,
            last_update=None,
            resumed_from=update if ckpt else None,
            ended=Ended.RUNNING,
            exit_code=None,
            started=time.time(),
            stopped=None,
            contract_sha256=contract_sha,
            code={
                **{k.removeprefix("code."): v for k, v in code_fields.items() if k.startswith("code.")},
                "script": _script(),
            },
            versions=versions([]) | {"torchrelay": __version__},
            runtime_changes=changes,
            notes=notes,
            layout_change=layout_change if layout_change else ABSENT,
            numerics=numerics,
            numerics_change=numerics_change or ABSENT,
        )
        return Prepared(
            config=cfg.to_dict(),
            contract_sha=contract_sha,
            checkpoint=str(ckpt) if ckpt else None,
            update=update,
            segment=segment,
            gate=gate,
            last_save_s=last_save,
            manifest_sha256=self._rank0_manifest.sha256(),
        )

    # ------------------------------------------------------------------------------------- refusing
    def _everywhere(self, err: RelayError) -> RelayError:
        """An error every rank raises alike before any collective: rank 0 says it, the others stay quiet."""
        return mark_reported(err) if self.rank != 0 else err

    def _settle(self, err: RelayError, segment: Segment | None = None) -> None:
        """Every rank, once the ranks agreed that opening failed: rank 0 records the launch and unlocks."""
        if self.rank == 0:
            self._refuse(err, record=True, segment=segment)

    def _refuse(self, err: RelayError, *, record: bool, segment: Segment | None = None) -> None:
        """Rank 0, when opening failed: record the launch (if this process holds the run), let go of the lock."""
        if record:
            self._record_failed_launch(err, segment)
        self.unlock()

    def _record_failed_launch(self, err: RelayError, segment: Segment | None) -> None:
        """A launch that refused (or failed) before its first update is a segment of its own, `refused` with exit
        2 (or `error`), so that `status --last-exit` and `torchrelay launch` read how it ended. Only while this
        process holds the run's lock: a RunBusy refusal leaves the history to the writer that owns it."""
        if self.lock is None or not self.dir.exists():
            return
        code = err.exit_code
        try:
            history = read_history(self.dir.path)
            if segment is None:
                last = next(
                    (s["last_update"] for s in reversed(history) if isinstance(s.get("last_update"), int)), 0
                )
                lineage = _read_lineage(self.dir.path)
                segment = Segment(
                    segment=new_id(),
                    parent=_parent(history),
                    lineage=lineage.get("lineage"),
                    parent_lineage=lineage.get("parent_lineage"),
                    job=os.environ.get("SLURM_JOB_ID"),
                    command=[sys.executable, *sys.argv],
                    hosts=[socket.gethostname()],
                    world_size=self.world_size,
                    first_update=last + 1,  # no update ran: an empty range, as for a launch that had none
                    last_update=last,
                    resumed_from=None,
                    started=self._opened_at,
                    contract_sha256=None,
                    code={"script": _script()},
                    versions={"torchrelay": __version__},
                    runtime_changes={},
                    notes=[],
                )
            else:
                segment = replace(segment, last_update=segment.first_update - 1)
            segment = replace(
                segment,
                ended=Ended.REFUSED if code == EXIT_REFUSED else Ended.ERROR,
                exit_code=code,
                stopped=time.time(),
                notes=[*segment.notes, err.message[:2000]],
            )
            write_history(self.dir.path, [*close_crashed(history, None), segment.to_dict()])
        except (OSError, RelayError) as exc:
            logger.warning(f"[torchrelay] could not record the refused launch in history.jsonl: {exc}")

    def unlock(self) -> None:
        """Let go of the run's writer lock (rank 0; idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _script() -> str | None:
    return str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else None


def _parent(history: list[dict[str, Any]]) -> str | None:
    """The segment a new one continues: the last that ran (a refused launch continued nothing)."""
    return next((s.get("segment") for s in reversed(history) if s.get("ended") != "refused"), None)


def _other_node(gathered: list[tuple[str, dict[str, Any] | None]]) -> ConfigError | None:
    """A refusal naming the first rank whose versions or program files differ from rank 0's, or None."""
    host0, reference = gathered[0]
    for rank, (host, fingerprint) in enumerate(gathered):
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


def _reclaim(run_dir: Path, ckpt: Path) -> str | None:
    """Continuing a handed-off checkpoint on purpose (TORCHRELAY_RECLAIM=1) starts a new lineage, on record."""
    marker = ckpt / HANDED_OFF
    if not marker.exists():
        return None
    handed = read_json_or_none(marker, what="the hand-off record", root=ckpt)
    handed = handed if isinstance(handed, dict) else {}
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    os.replace(marker, ckpt / f"{RECLAIMED_PREFIX}{stamp}.json")
    old = _read_lineage(run_dir)
    new = {"lineage": new_id(), "parent_lineage": old.get("lineage")}
    atomic_write_text(run_dir / LINEAGE_FILE, json.dumps(new))
    return (
        f"reclaimed {ckpt.name}, handed off to bundle lineage {handed.get('lineage', '?')}: "
        f"new lineage {new['lineage']} (parent {old.get('lineage')})"
    )


def _read_lineage(run_dir: Path) -> dict[str, Any]:
    lineage = read_json_or_none(run_dir / LINEAGE_FILE, what="the run's lineage", root=run_dir)
    return dict(lineage) if isinstance(lineage, dict) else {}  # unreadable, not JSON, not an object: none
