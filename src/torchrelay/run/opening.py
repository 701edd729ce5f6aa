"""The segment opener: rank 0 takes the writer lock and opens the run directory (created or reopened:
directory.py) and makes the segment's record, every rank opens its own part (the manifest, the data order, its
logs), and whatever fails on any rank reaches every rank as the same error, so that no rank waits for an answer
that never comes and all refuse together.

A launch that fails here is on record in history.jsonl as a segment that ended `refused` (exit 2) or `error`,
unless another writer holds the run (docs/FORMATS.md).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.checkpoint.persist import stall_seconds
from torchrelay.checkpoint.replica import nodes_of
from torchrelay.checkpoint.replica_resume import settle_after_open, survey
from torchrelay.config import envvars
from torchrelay.config.relay import RelayConfig
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import EXIT_REFUSED, ConfigError, RelayError, mark_reported, mark_shared
from torchrelay.identity import fingerprint_differences, fingerprint_summary, node_fingerprint, versions
from torchrelay.identity.numerics import gather
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import Deadline, deadline_from_env, job_start
from torchrelay.records.ended import Ended
from torchrelay.records.history import ABSENT, Segment, close_crashed, new_id, read_history, write_history
from torchrelay.records.train import ExposureLog, RankLog, exposure_widths, exposures_path, metrics_path
from torchrelay.run.directory import Start, create_run, last_segment, read_lineage, reopen_run
from torchrelay.util import collective


@dataclass(frozen=True, slots=True)
class Settled:
    """What rank 0 settled in the run directory, as it travels to every rank."""

    config: dict[str, Any]
    contract_sha: str
    checkpoint: str | None  # the checkpoint to resume from
    update: int  # the update it holds (0: a new run)
    segment: Segment
    gate: str  # the line that says which resume gate passed
    last_save_s: float | None  # how long that checkpoint took to save
    manifest_sha256: str  # the manifest's, so that the other ranks read only its index
    tier: str | None = None  # the tier the checkpoint came from (checkpoint/tiers.py)
    plan: list[int] | None = None  # several nodes: which node holds each node's part (replica_resume.py)


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
    exposures_log: ExposureLog
    plan: list[int] | None = None  # several nodes: which node holds each node's part (replica_resume.py)


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
        asked_by: str = "reshard",
    ) -> None:
        self.rank = rank
        self.reshard = reshard  # this launch may change the layout (records/reshard.py)
        self.asked_by = asked_by  # who asked, as the move's record says
        self.world_size = world_size
        self.code_dir = code_dir
        self.lock: RunLock | None = None
        self.assembled: Path | None = (
            None  # several nodes: the memory checkpoint assembled from the nodes' parts
        )
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
            envvars.check(envvars.TRAINING)
            overrides.update(envvars.OVERRIDES.get())
        except ConfigError as exc:
            raise self._everywhere(exc) from None
        try:  # fixed once for the job (see job_start); a bad value refuses here, before anything is touched
            deadline = deadline_from_env(os.environ, job_start())
        except ConfigError as exc:
            raise self._everywhere(exc) from None
        try:  # read when a checkpoint write stops progressing: a bad value refuses here, not then
            stall_seconds()
        except ConfigError as exc:
            raise self._everywhere(exc) from None

        # Rank 0 validates and opens the directory; the outcome, or whatever it raised, reaches every rank
        # (util/collective.py). Rank 0 records a refused launch and lets go of the lock before any rank raises.
        ranks = collective.ranks()
        holdings = None
        if nodes_of(self.rank, self.world_size).nodes > 1:  # what each node's memory holds, verified there
            with ranks.phase("reading the memory tiers"):
                gathered_parts = ranks.all_gather(
                    "reading the memory tiers", lambda: survey(self.dir, self.rank, self.world_size)
                )
            holdings = [h for h in gathered_parts if h is not None]
        refused: list[str] = []
        while True:
            try:
                with ranks.phase("opening the run", settle=self._settle, name_rank=False, end=False):
                    outcome: Settled = ranks.broadcast(
                        "opening the run", functools.partial(self.open_directory, config, overrides, holdings)
                    )
            except BaseException:
                self.unlock()  # an interrupt is not shared, and not recorded: the lock goes all the same
                raise
            try:  # several nodes: each node's memory loses the futures past this update; the parts assembled
                self.assembled = settle_after_open(self.dir, outcome.segment.lineage, self.rank,
                                                   self.world_size, outcome.update, outcome.plan)  # fmt: skip
                break
            except RelayError as exc:  # agreed: every rank raises it alike
                if outcome.plan is None or holdings is None:
                    self.unlock()
                    raise
                # a part that checked at its node but does not make the checkpoint at assembly (forged, or changed
                # since): that update is refused on every rank and the open chooses again, the next tier then
                line = (f"memory checkpoint-{outcome.update} assembled from nodes {outcome.plan} refused: "
                        f"{exc.message[:400]}")  # fmt: skip
                if self.rank == 0:
                    logger.warning(f"[torchrelay] {line}; the next tier is used")
                    self.unlock()
                refused.append(line)
                holdings = [{**h, "parts": [p for p in h["parts"] if p["update"] != outcome.update]}
                            for h in holdings]  # fmt: skip
        outcome.segment.notes = [*outcome.segment.notes, *refused]
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
            if outcome.checkpoint is None:  # nothing saved: the directory keeps this launch's settings
                start_over(err, self.dir)
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

    def _open_locally(self, settled: Settled, deadline: Deadline | None) -> Opened:
        """This rank's part of opening: the configuration rank 0 settled, the manifest, the order, the logs."""
        config = RelayConfig.from_dict(settled.config)
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
                sha256=settled.manifest_sha256,
                readers=1,
                root=self._manifest_root(config),
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
            contract_sha=settled.contract_sha,
            resume_from=Path(settled.checkpoint) if settled.checkpoint else None,
            start_update=int(settled.update),
            gate=settled.gate,
            segment=settled.segment,
            last_save_s=settled.last_save_s,
            deadline=deadline,
            hosts=[],
            ranks_by_host={},
            manifest=manifest,
            global_batch=global_batch,
            order=order,
            metrics_log=RankLog(metrics_path(self.dir.train_dir, self.rank)),
            exposures_log=ExposureLog(
                exposures_path(self.dir.train_dir, self.rank),
                exposure_widths(config.total_updates, config.grad_accum, len(manifest)),
            ),
            plan=settled.plan,
        )

    def _manifest_path(self, cfg: RelayConfig) -> Path:
        p = Path(cfg.manifest)
        return p if p.is_absolute() else self.dir.path / p

    def _manifest_root(self, cfg: RelayConfig) -> Path | None:
        """The run directory when the manifest read is the run's own copy (it stays inside), else None."""
        own = not Path(cfg.manifest).is_absolute() or Path(cfg.manifest) == self.dir.manifest_path
        return self.dir.path if own else None

    def open_directory(
        self,
        config: RelayConfig | None,
        overrides: dict[str, Any],
        holdings: list[dict[str, Any]] | None = None,
    ) -> Settled:
        """Rank 0: create a new run, or reopen it (check the contract, choose the checkpoint to resume)."""
        rd = self.dir
        if config is None and not rd.exists():
            raise ConfigError(f"{rd.path} holds no run yet, and no configuration was given to create one")
        # One writer per run directory, from here to the end of the segment (a second launch is refused).
        # A relaunch may start while the previous holder's last DataLoader worker still exits, or while `status` peeks.
        self.lock = RunLock(rd.path, "train").acquire(wait_s=envvars.LOCK_WAIT_S.get(), create_dir=True)
        numerics = gather()
        if rd.exists():
            start = reopen_run(
                rd,
                config,
                overrides,
                world_size=self.world_size,
                code_dir=self.code_dir,
                reshard=self.reshard,
                numerics=numerics,
                asked_by=self.asked_by,
                holdings=holdings,
            )
        else:
            assert config is not None
            start = create_run(rd, config, overrides, world_size=self.world_size, code_dir=self.code_dir)
        self._rank0_manifest = start.manifest
        return Settled(
            config=start.config.to_dict(),
            contract_sha=start.contract_sha,
            checkpoint=str(start.checkpoint) if start.checkpoint else None,
            update=start.update,
            segment=self._segment(start, numerics),
            gate=start.gate,
            last_save_s=start.last_save_s,
            manifest_sha256=start.manifest.sha256(),
            tier=start.tier,
            plan=start.plan,
        )

    def _segment(self, start: Start, numerics: dict[str, Any]) -> Segment:
        """The record of the segment that starts here, as history.jsonl will hold it."""
        update, ckpt = start.update, start.checkpoint
        lineage = read_lineage(self.dir)
        return Segment(
            segment=new_id(),
            parent=start.parent,
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
            contract_sha256=start.contract_sha,
            code={
                **{k.removeprefix("code."): v for k, v in start.code_fields.items() if k.startswith("code.")},
                "script": _script(),
            },
            versions=versions([]) | {"torchrelay": __version__},
            runtime_changes=start.runtime_changes,
            notes=start.notes,
            layout_change=start.layout_change if start.layout_change else ABSENT,
            numerics=numerics,
            numerics_change=start.numerics_change or ABSENT,
            resumed_tier=start.tier if ckpt and start.tier else ABSENT,
        )

    # ------------------------------------------------------------------------------------- refusing
    def _everywhere(self, err: RelayError) -> RelayError:
        """An error every rank raises alike before any collective: the first rank to reach its excepthook says
        it, the others stay quiet (errors.mark_shared)."""
        return mark_shared(err)

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
                lineage = read_lineage(self.dir)
                segment = Segment(
                    segment=new_id(),
                    parent=last_segment(history),
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
            write_history(self.dir, [*close_crashed(history, None), segment.to_dict()])
        except (OSError, RelayError) as exc:
            logger.warning(f"[torchrelay] could not record the refused launch in history.jsonl: {exc}")

    def unlock(self) -> None:
        """Let go of the run's writer lock (rank 0; idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _script() -> str | None:
    return str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else None


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


def start_over(error: RelayError, run: RunDir) -> None:
    """A refusal of a run with no checkpoint yet: its directory holds the refused launch's settings (its
    contract), so a launch with the setting the hint asks for would be refused again, as a change. The hint says
    how to start over (every rank amends it before rank 0 says it)."""
    run_dir = run.path
    if error.exit_code != EXIT_REFUSED or "to start over" in (error.hint or ""):
        return
    again = f"no checkpoint was saved in {run_dir}, which keeps this launch's settings: to start over with others, remove it"
    error.hint = f"{error.hint}; {again}" if error.hint else again
