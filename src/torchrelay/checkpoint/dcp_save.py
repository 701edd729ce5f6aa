"""DCP's save protocol in two halves: the plan, made during the save's stall while the device->host copies are in
flight, and the write, which may run later on the persist thread.

`dcp.save` plans and writes in one call. Planning is pure Python over every tensor (flatten the document, one write
item per tensor, gather the plans on the coordinator, dedup replicated tensors, build the metadata, scatter): on the
persist thread it held the GIL the loop's update needed for long enough to slow that update severalfold. Here the training thread plans while it would otherwise only wait for the copies to land, so the
persist thread runs nothing but the writers. With one process the plan needs no collective at all (DCP still
gathered over the default group, NCCL on a GPU, from the persist thread).

The files are those `dcp.save(doc, storage_writer=HashingWriter(...))` writes: the same planner (DCP's default)
and writer, called in the same order; only the writer's directory is given when the write starts, since the
checkpoint's temporary directory is named by the commit protocol on the persist thread. Every rank calls `plan`
and `PlannedSave.write` together; a failure on any rank raises on all of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from torchrelay.checkpoint.hashing_writer import Digests, HashingWriter
from torchrelay.config.tuning import SaveTuning
from torchrelay.util import collective

if (
    TYPE_CHECKING
):  # writer_process imports host_stage and persist, never this module; only its type is named here
    from torchrelay.checkpoint.writer_process import WriterProcess

T = TypeVar("T")
R = TypeVar("R")


class _Ranks:
    """The ranks of one save and its coordinator (the group's first rank), through the failure protocol
    (util/collective.py): a failure on any rank, in its own part or in the coordinator's, is raised on every rank
    (named by the save's phase when one is open: commit.py), and no rank waits in a collective for it."""

    def __init__(self, group: Any) -> None:
        self._peers = collective.ranks(group)
        self.alone = self._peers.alone
        self.rank = 0 if self.alone else dist.get_rank(group)
        self.coordinator = self._peers.coordinator

    def reduce_scatter(self, step: str, local: Callable[[], T], reduce: Callable[[list[T]], list[R]]) -> R:
        """`local` on every rank, `reduce` of all of them on the coordinator, its i-th result to rank i."""
        name = f"{step} of the checkpoint's tensors"
        gathered = self._peers.gather(name, local)
        return self._peers.scatter(name, (lambda: reduce(gathered)) if gathered is not None else None)

    def all_reduce(self, step: str, local: Callable[[], T], reduce: Callable[[list[T]], R]) -> R:
        """`local` on every rank, `reduce` of all of them on the coordinator, its result to every rank."""
        name = f"{step} of the checkpoint's tensors"
        gathered = self._peers.gather(name, local)
        return self._peers.broadcast(name, (lambda: reduce(gathered)) if gathered is not None else None)


class PlannedSave:
    """One rank's part of a DCP save, planned with the other ranks: `write` it (all ranks together) once."""

    def __init__(self, planner: DefaultSavePlanner, plan: SavePlan, metadata: Metadata | None, ranks: _Ranks):
        self._planner, self._plan, self._metadata, self._ranks = planner, plan, metadata, ranks
        self._prepared: tuple[WriterProcess, bytes | None] | None = None

    def prepare(self, process: WriterProcess) -> None:
        """Make `process`'s job of this plan now (WriterProcess.prepare: on the training thread, in the stall)."""
        ranks = self._ranks
        self._prepared = (
            process,
            process.prepare(
                self._planner,
                self._plan,
                rank=ranks.rank,
                coordinator=ranks.coordinator,
                metadata=self._alone_md(),
            ),
        )

    def _alone_md(self) -> Metadata | None:
        """The metadata a writer process finishes itself: with one rank its results are all the metadata needs."""
        return self._metadata if self._ranks.alone and self._ranks.coordinator else None

    def write(
        self,
        directory: Path,
        digests: Digests,
        *,
        background: bool = False,
        process: WriterProcess | None = None,
        spare: Path | None = None,
        tuning: SaveTuning | None = None,
    ) -> None:
        """Write this rank's files into `directory` (each hashed into `digests` as written, fsynced); the
        coordinator then writes `.metadata`. `background`: on the persist thread (see HashingWriter); `process`:
        this rank's files by that writer process instead (writer_process.py), the same bytes; `spare`: a folder of
        spare files written over instead of new ones (recycle.py)."""
        writer = HashingWriter(directory, digests, background=background, spare=spare, tuning=tuning)
        _set_up(writer, self._ranks)

        def write_local() -> list[Any]:
            if process is not None:
                ranks = self._ranks
                prepared = self._prepared[1] if self._prepared and self._prepared[0] is process else None
                return process.write(
                    directory,
                    self._planner,
                    self._plan,
                    digests,
                    rank=ranks.rank,
                    coordinator=ranks.coordinator,
                    prepared=prepared,
                    metadata=self._alone_md(),
                    spare=spare,
                )
            writer.fs.mkdir(writer.path)
            writes = writer.write_data(self._plan, self._planner)
            writes.wait()
            return list(writes.value())

        def finish(results: list[list[Any]]) -> None:
            assert self._metadata is not None  # the coordinator's, from the global plan
            if process is not None and process.finished:
                return  # the writer process wrote `.metadata` (one rank: WriterProcess.write)
            writer.finish(metadata=self._metadata, results=results)

        self._ranks.all_reduce("the write", write_local, finish)


def _set_up(writer: HashingWriter, ranks: _Ranks) -> None:
    set_up_writer(writer, ranks.coordinator, ranks.rank)


def set_up_writer(writer: HashingWriter, coordinator: bool, rank: int) -> None:
    """DCP's set-up of a rank's storage writer (here, or in the writer process: writer_child.py)."""
    if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    else:  # torch 2.8: set_up_storage_writer(is_coordinator) alone
        writer.set_up_storage_writer(coordinator)


def plan(doc: dict[str, Any], group: Any = None, *, planner: DefaultSavePlanner | None = None) -> PlannedSave:
    """Plan the save of `doc` (this rank's DCP document) with the other ranks of `group` (every rank calls it);
    reads only the tensors' shapes, dtypes and placements, so it may run while their values are still copied in."""
    ranks = _Ranks(group)
    planner = planner or DefaultSavePlanner()
    writer = HashingWriter(Path("."), {})  # plans only: prepare_global_plan names each rank's files
    _set_up(writer, ranks)
    metadata: list[Metadata] = []

    def local() -> SavePlan:
        planner.set_up_planner(doc, storage_meta=None, is_coordinator=ranks.coordinator)
        return planner.create_local_plan()

    def coordinate(plans: list[SavePlan]) -> list[SavePlan]:
        plans, md = planner.create_global_plan(plans)
        metadata.append(md)
        return writer.prepare_global_plan(plans)

    central = ranks.reduce_scatter("the plan", local, coordinate)
    return PlannedSave(planner, planner.finish_plan(central), metadata[0] if metadata else None, ranks)


__all__ = ["PlannedSave", "plan", "set_up_writer"]
