"""The saver: when a segment saves (every `save_every` updates, at the updates retention keeps, at a stop) and how
(logs made durable, then the commit protocol across ranks, then retention), and how long the last save took.

The loop calls `due(done)` after each update and `save(update)`; a stop saves once more if the update is not
saved yet, then `wait()`s; closing the Run calls `close()`. With `async_save` (the default) `save()` returns once the
state is copied into host buffers (checkpoint/host_stage.py), and a thread of its own writes, hashes, fsyncs and
commits it while the loop trains; `wait()` / `close()` return once that checkpoint is committed (or raise what
failed), so a segment never records its end, nor lets go of the lock, before its last checkpoint is complete. A save
due while one persists waits for it (the buffers are reused). `async_save: false` runs the same job inline: the same
bytes, the loop waiting.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.commit import commit_checkpoint, drop_spare, wait_deletions
from torchrelay.checkpoint.deepspeed_engine import declares_engine, is_engine
from torchrelay.checkpoint.host_stage import HostStage
from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.checkpoint.node_tiers import hold, release
from torchrelay.checkpoint.persist import Persister
from torchrelay.checkpoint.policy import SaveContext, SaveDecision
from torchrelay.checkpoint.replica import commit_parts, nodes_of, said_once
from torchrelay.checkpoint.retention import LatestN, PreservationPolicy, policy_for
from torchrelay.checkpoint.storage import LocalStorage, as_storage
from torchrelay.checkpoint.tiers import (
    DURABLE,
    MEMORY,
    Binding,
    forget,
    memory_root,
    node_free,
    root_problem,
    tier_at_open,
    tier_verdict,
)
from torchrelay.checkpoint.writer_process import PROCESS, WriterProcess, can_share, writer_mode
from torchrelay.config import envvars
from torchrelay.config.relay import RelayConfig
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import CheckpointError
from torchrelay.ledger.proof import ProofSpawner
from torchrelay.log import logger
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import RankLog
from torchrelay.run.restore import Tracked
from torchrelay.storage.durable import DurableSpawner, durable_url
from torchrelay.util import collective, kill_points
from torchrelay.util.records import read_json_or_none

# After a segment's first update every object the process then holds (torch's modules, the model, the optimizer's
# state) is moved out of the garbage collector's reach (gc.freeze, `SaveTuning.freeze_gc`) until the Saver closes: a
# full collection stops every thread, the loop's included, for as long as it walks the heap, and frozen it walks only
# what was made since. Young garbage is collected first, so only cycles older than two collections stay held until
# the close. A process that froze objects itself is frozen further and never unfrozen here (a thaw would take its
# own objects too). The logs' fsync runs first in the persist, not in the save's stall.


class Saver:
    """Saves one segment's checkpoints through the commit protocol (every rank holds one)."""

    def __init__(
        self,
        run: RunDir,
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
        lineage: str | None = None,
        hosts: int = 1,
        notes: list[str] | None = None,
    ) -> None:
        run_dir = run.path
        self._run = run
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
        # a checkpoint kept for later (keep_updates, keep_every) is written even between save_every's
        self._retention = policy_for(config)
        # The memory tier (checkpoint/tiers.py): node-local; on several nodes (LOCAL_WORLD_SIZE) each node's part
        # with a replica on its partner (checkpoint/replica.py), sent over the persist's gloo group. Whether it
        # runs is decided here, once (tier_at_open); the first memory save checks what it needs against each node.
        self._memory: LocalStorage | None = None
        self._memory_keep = config.memory_keep
        self._memory_sized = False
        self._memory_last = -1  # the newest update in the memory tier this segment
        self._durable_last = -1  # the newest durable save this segment
        # a shared flock on the tier's folder while this rank may use it: `torchrelay stop --forget-memory` waits
        self._hold: int | None = None
        self._lineage = lineage
        self._notes = notes if notes is not None else []  # the segment's notes (rank 0's reach its history)
        where = nodes_of(rank, world_size)
        self._nodes, self._local = where.nodes, where.local
        on, why = tier_at_open(config.memory_every, lineage, hosts=hosts, nodes=self._nodes,
                               async_save=config.async_save, deepspeed=declares_engine(config.params))  # fmt: skip
        if why:
            self._say(why)
        if on and lineage:
            # its folders are made and checked at the first memory save, by every rank alike (_memory_fits)
            self._memory = LocalStorage(memory_root(lineage, run), spare=True)
            # held from the start where a resume came from the folder (else it is made at the first save)
            self._hold = hold(self._memory.root)
            said_once(rank, world_size)
        self.policy = SaveDecision(
            config.save_every, self._retention, config.memory_every if self._memory else 0
        )
        self.last = saved if saved is not None else -1  # the newest update with a checkpoint (resumed from)
        self.estimate = estimate  # seconds a save takes, for the budget policy: the slowest so far
        self._background = config.async_save
        # How a save is written is chosen here, once: inline (`async_save: false`), a thread of this process, or a
        # writer process of this rank's own (writer_process.py), whose host buffers are shared mappings it maps
        # too. A DeepSpeed engine writes its own files inline whatever is chosen (it is known at the first save).
        self._strategy = strategy(config)
        self._use_process = self._strategy == PROCESS
        self._tuning = config.save_tuning
        self._stage = HostStage(shared=self._use_process, tuning=self._tuning)
        self._writer: WriterProcess | None = None
        self._persister = Persister(background=self._background)
        self._reserved = False
        self._dues = 0  # calls of due() so far
        self._froze: bool | None = None  # None until the first update: whether this Saver froze the heap
        # Whether closing unfreezes it: nothing was frozen before. Asked here, not at the first update:
        # gc.get_freeze_count() walks the whole permanent generation (CPython keeps no count), which would lengthen
        # that update.
        self._thaw = gc.get_freeze_count() == 0
        # A background persist talks over a gloo group of its own: never the training's (NCCL) group, and never
        # a group the training thread uses at the same time (every rank creates it here, in the same order).
        self._peers = collective.own_group() if world_size > 1 and self._background else None
        # Rank 0 starts the ledger's background prover after a commit (ledger/proof.py): a process, never work here.
        self._proofs = ProofSpawner(run) if rank == 0 else None
        # TORCHRELAY_DURABLE: rank 0 copies each committed checkpoint into the store, in a process of its own
        self._durable = DurableSpawner(run) if durable_url() is not None and rank == 0 else None

    def due(self, done: int) -> bool:
        """The loop's two calls in one: `after_update(done)`, then whether `policy` saves `done` durably."""
        self.after_update(done)
        return self.policy.decide(SaveContext(done, self._config.total_updates)).durable

    def after_update(self, done: int) -> None:
        """The warm-up, one step after each of a segment's first three updates (the optimizer holds its state
        from its first step on): freeze the collector's heap (`freeze_gc`), start allocating the host buffers
        saves copy into (on a thread), start the writer process (the process strategy). Spread so that no one
        update carries all three; a save due before they are done obtains what it needs in its stall."""
        self._dues += 1
        if self._froze is None:
            self._froze = self._tuning.freeze_gc and gc.isenabled()
            if self._froze:
                gc.collect(1)
                gc.freeze()  # O(1): the generations' lists are moved to the permanent one, nothing is walked
        elif not self._reserved and self._background:
            self._reserved = True
            tracked = self._tracked
            ckpt_state.reserve(self._stage, tracked.model, tracked.optimizer, self._rank)
        elif self._dues == 3:
            self._start_writer()

    def _start_writer(self) -> None:
        """Start (or, after one died, start again) this rank's writer process; on the training thread, whose
        end is the writer's parent-death signal (a persist thread's would kill it after each save)."""
        if not self._use_process or is_engine(self._tracked.model):
            return
        if self._writer is not None and self._writer.alive:
            return
        if self._writer is not None:
            self._writer.close()
            logger.warning(
                f"[torchrelay] rank {self._rank}: the checkpoint writer process ended; starting another"
            )
        try:
            self._writer = WriterProcess(self._stage)
        except OSError as exc:
            self._use_process = False
            self._writer = None
            logger.warning(f"[torchrelay] rank {self._rank}: no checkpoint writer process ({exc}); saves write "
                           "their files from a thread of this process")  # fmt: skip

    def unsaved(self, done: int) -> bool:
        """Whether a stop after update `done` must save it. Update 0 needs no checkpoint: starting again from
        nothing is the same run, and a checkpoint of an optimizer that never stepped would hold a made-up step."""
        return self.last != done and done > 0

    def save(self, update: int, tier: str = DURABLE, saved_now: str | None = None) -> Path | None:
        """checkpoint-<update>: logs made durable, the state copied into host buffers, then the commit protocol
        across ranks and retention, on the persist thread (`async_save`) or before returning. `tier` MEMORY: into
        the memory tier, the logs handed to the OS only (they outlive the processes as the tier does); None when
        the node has no room for it (said once). `saved_now`: why step.save_now asked (COMPLETE.json's
        `saved_now`; retention keeps it)."""
        self._wait_persist()  # the buffers are reused: a save due while one persists waits for it
        memory = tier == MEMORY
        if memory and not self._memory_fits():
            return None
        where: Path | LocalStorage = self._memory if memory and self._memory is not None else self._run_dir
        retention: PreservationPolicy = LatestN(self._memory_keep) if memory else self._retention
        started = time.perf_counter()
        loop = {
            "update": update,
            "samples_consumed": self._order.position(update),
            "epoch": update / self._order.updates_per_epoch,
            "world_size": self._world_size,
            "micro_batch": self._config.micro_batch,  # the layout it is saved with (records/reshard.py)
            "grad_accum": self._config.grad_accum,
            "global_batch": self._global_batch,
            "segment": self._segment,
        }
        tracked = self._tracked
        info: dict[str, Any] = {
            "contract_sha256": self._contract_sha,
            "segment": self._segment,
            "created": time.time(),
        }
        if memory:
            info |= self._binding().info()
        if saved_now is not None:  # asked for by step.save_now: retention keeps it (checkpoint/retention.py)
            info["saved_now"] = saved_now
        if is_engine(tracked.model):
            # A DeepSpeed engine writes its files itself, with collectives on the training's process group: the
            # whole save runs here, on the training thread, as with async_save false.
            for log in self._logs:
                log.flush(durable=not memory)
            _, seconds = commit_checkpoint(
                where,
                update,
                lambda tmp, hook: ckpt_state.save_state(
                    tmp,
                    rank=self._rank,
                    model=tracked.model,
                    optimizer=tracked.optimizer,
                    statefuls=tracked.statefuls,
                    loop=loop,
                    kill_hook=hook,
                    tuning=self._tuning,
                ),
                rank=self._rank,
                world_size=self._world_size,
                info=info,
                retention=retention,
                started=started,
            )
            self._saved(update, seconds, memory)
            return self._submitted(update, where, memory)
        group, background = (self._peers.group if self._peers else None), self._background
        if background:
            self._start_writer()
        # A writer still starting (it imports torch: seconds) is not waited for: this save's files are written
        # from the persist thread (the same bytes), and the loop goes on. Crash tests wait, to hit the writer.
        fault = kill_points.write_fault(update, self._rank)
        ready = self._writer is not None and self._writer.ready(wait=fault is not None)
        process = self._writer if ready else None
        if process is not None:
            process.die, process.stall = fault == kill_points.WRITER, fault == kill_points.STALL
        # The staging is a phase of its own (util/collective.py), over the group the commit uses next: a rank that
        # fails here joins the exchange its peers wait in (the comparison of ranks, the plan, the phase's end), and
        # every rank raises the same error on its training thread, before any rank hands the save to its thread.
        with collective.ranks(group).phase(f"saving {checkpoint_name(update)}"):
            snap = ckpt_state.capture_state(
                rank=self._rank,
                model=tracked.model,
                optimizer=tracked.optimizer,
                statefuls=tracked.statefuls,
                loop=loop,
                stage=self._stage,
                group=group,
            )
            planned = snap.plan(group)  # DCP's plan, across ranks, while the copies land (dcp_save.py)
            if planned is not None and process is not None:
                planned.prepare(process)  # and the writer's job of it: the persist thread only sends it
            self._stage.synchronize()
        # The logs up to this update must be on disk before the checkpoint is committed, not before the loop goes
        # on: each log's lines go to the OS here, and its fsync (a journal commit) runs
        # first in the persist, not in the loop's stall.
        unsynced = [] if memory else [log.sync_later() for log in self._logs]
        if memory:
            for log in self._logs:
                log.flush()

        def write(tmp: Path, hook: Any) -> Any:
            # copies a save before the buffers were all obtained left to the persist (`spill_to_device`):
            # inside the commit protocol, whose failures reach every rank
            self._stage.finish_deferred()
            return ckpt_state.write_snapshot(
                snap, tmp, kill_hook=hook, group=group, background=background, process=process
            )

        def persist() -> None:
            _sync_logs(unsynced)
            parts = memory and self._nodes > 1  # several nodes: a part per node, replicated (replica.py)
            _, seconds = (commit_parts if parts else commit_checkpoint)(
                as_storage(where).root if parts else where,  # type: ignore[arg-type]
                update,
                write,
                rank=self._rank,
                world_size=self._world_size,
                info=info,
                retention=retention,
                group=group,
                started=started,
            )
            self._saved(update, seconds, memory)

        self._persister.submit(update, persist, rank=self._rank)
        return self._submitted(update, where, memory)

    def _submitted(self, update: int, where: Path | LocalStorage, memory: bool) -> Path:
        """The newest update saved (committed, or being committed), per tier; its path."""
        if memory:
            self._memory_last = update
        else:
            self.last = self._durable_last = update
        return as_storage(where).root / checkpoint_name(update)

    def _saved(self, update: int, seconds: float, memory: bool) -> None:
        """After checkpoint-<update> is committed (on the thread that committed it)."""
        if memory:
            return  # the budget plans the durable save a stop makes; the ledger's prover reads the run directory
        self.estimate = max(self.estimate, seconds) if self.estimate else seconds
        self._committed(update)

    def _binding(self) -> Binding:
        return Binding(
            lineage=str(self._lineage),
            run_dir=str(self._run_dir),
            contract_sha256=self._contract_sha,
            world_size=self._world_size,
            micro_batch=self._config.micro_batch,
            grad_accum=self._config.grad_accum,
        )

    def _memory_fits(self) -> bool:
        """Whether the memory tier saves, checked on every node once, at its first save: each node's folder made and
        checked (tiers.root_problem: this user's alone), and what each node holds (its ranks' states, and on
        several nodes the replica of its partner's) against that node's /dev/shm and RAM. The ranks decide alike
        from what they all gathered: a folder unfit on any node turns the tier off, too little room on any node
        reduces `memory_keep` or turns it off, in one line naming the node (in the segment's notes), before a byte
        is written."""
        if self._memory is None:
            return False
        if self._memory_sized:
            return True
        self._memory_sized = True
        group = self._peers.group if self._peers else None
        root = self._memory.root

        def mine() -> tuple[int, int, int, str | None]:
            return (self._tracked.state_bytes(), *node_free(), root_problem(root, make=True))

        with collective.ranks(group).phase("sizing the memory tier"):
            gathered = collective.ranks(group).all_gather("sizing the memory tier", mine)
        keep, line = tier_verdict(
            [(int(g[0]), int(g[1]), int(g[2]), g[3] and str(g[3])) for g in gathered],
            self._local,
            self._memory_keep,
        )
        if line:
            self._say(line)
        self._memory_keep = keep
        if keep > 0 and self._hold is None:
            self._hold = hold(root)
        if keep == 0:
            self._memory = None
            self.policy = SaveDecision(self._config.save_every, self._retention)
        return keep > 0

    def _say(self, line: str) -> None:
        """A line every rank met alike about the memory tier: logged once (rank 0), in the segment's notes."""
        if self._rank == 0:
            logger.warning(f"[torchrelay] {line}")
            self._notes.append(line)

    def _committed(self, update: int) -> None:
        """After checkpoint-<update> is committed (on the thread that committed it): the ledger's prover, maybe."""
        if self._proofs is not None:
            self._proofs.committed(update)
        if self._durable is not None:
            self._durable.committed(update)

    def budget_seconds(self) -> float:
        """What a stop now costs in saving, for the budget policy: the checkpoint in flight to finish, then one
        more save (the slowest so far)."""
        left = max(0.0, self.estimate - self._persister.elapsed()) if self._persister.in_flight else 0.0
        return self.estimate + left

    @property
    def persisting(self) -> bool:
        """Whether a checkpoint is being written in the background right now."""
        return self._persister.in_flight

    def wait(self) -> None:
        """Return once every save so far is committed (a stop calls it before it records the segment's end);
        raise what the background persist raised."""
        self._wait_persist()

    def _wait_persist(self) -> None:
        """The persister's wait; a persist thread stuck past its deadline (Persister.wait) fails its save on every
        rank: its peers' persist threads wait for it in the save's exchanges (over the persist's group, which the
        stuck thread will never use again), and this thread joins them there with the failure."""
        try:
            self._persister.wait()
        except CheckpointError as err:
            update = getattr(err, "stalled", None)
            if update is None or self._peers is None:
                raise
            with self._peers.phase(f"saving {checkpoint_name(update)}", end=False):
                raise

    def close(self) -> None:
        """Wait for what is pending and for the deletions retention started (closing the Run calls it, on any
        exit)."""
        committed = False
        try:
            self.wait()
            committed = True
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if not self._persister.stuck:  # a persist thread left stuck may still read them: the process ends
                self._stage.release()  # page-locked memory goes back once nothing reads it
            if self._froze and self._thaw:
                gc.unfreeze()  # what became garbage meanwhile is collectable again, as the process left it
            self._froze = False
            if self._rank == 0 and not self._persister.stuck:  # a stuck persist may still be writing into it
                drop_spare(self._run_dir)
            # A durable save of this segment is newer than any memory checkpoint an earlier segment left (the open
            # deleted those past its resume point): the tier goes once it holds nothing newer, whether or not this
            # launch saves to it (a relaunch without memory_every that resumed from it leaves none behind), on
            # every node (each node's first rank: its part and the replica it holds); a node whose first rank
            # died first keeps a tier that `torchrelay stop --forget-memory --stale` frees.
            first = self._rank % self._local == 0
            if committed and first and self._durable_last >= max(self._memory_last, 0):
                forget(self._lineage, self._run)  # the durable tier holds a newer (or the same) update
            release(self._hold)
            self._hold = None
            wait_deletions()
            if self._durable is not None and not self._persister.stuck:
                self._durable.close()  # the newest checkpoint reaches the store before the run ends


INLINE, THREAD = "inline", "thread"


def strategy(config: RelayConfig) -> str:
    """How this run's saves are written, chosen when it opens: `inline` (async_save false), `process` (a writer
    process per rank: TORCHRELAY_PERSIST_WRITER and memfd allowing), else `thread`."""
    if not config.async_save:
        return INLINE
    return PROCESS if writer_mode() == PROCESS and can_share() else THREAD


def _sync_logs(fds: list[int]) -> None:
    """fsync and close the descriptors `RankLog.sync_later` gave (every one closed, whatever fails)."""
    try:
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def last_save_seconds(ckpt: Path | None) -> float | None:
    """How long the save of `ckpt` took, as its COMPLETE.json records (None when unknown)."""
    if ckpt is None:
        return None
    doc = read_json_or_none(ckpt / INVENTORY, what="checkpoint inventory", root=ckpt)
    seconds = doc.get("save_seconds") if isinstance(doc, dict) else None
    return float(seconds) if isinstance(seconds, int | float) and not isinstance(seconds, bool) else None


def first_estimate(last_save_s: float | None) -> float:
    """The save-time estimate a segment starts with: the cost model's (TORCHRELAY_SAVE_ESTIMATE_S), else how long
    the checkpoint it resumes from took to save, else 0 (unknown until the first save)."""
    estimate = envvars.SAVE_ESTIMATE_S.get()
    return float(last_save_s or 0.0) if estimate is None else float(estimate)
