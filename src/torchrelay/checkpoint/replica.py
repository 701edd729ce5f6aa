"""The memory tier on several nodes: each node's part in its own memory, a replica of it on the partner node.

Node n is ranks [n*L, (n+1)*L) of a launch with L = LOCAL_WORLD_SIZE ranks a node; its partner is node n+1 mod
nodes. A memory save writes each rank's files into its own node's memory root (tiers.memory_root), and each node's
first rank publishes its node's part there: the files its ranks wrote, an inventory of them (sizes, SHA-256) with
the durable tier's bindings, and `part` (node, nodes, the digest of the whole checkpoint's file list), the marker
last. Then each node's first rank sends its part through the save's gloo group to its partner's, which writes it
under replica-node<n>/ of its memory root, verified against the inventory, its marker last: a replication cut by a
kill leaves a temporary, removed and never chosen. One node: no partner, nothing replicated.

At open, replica_resume.py chooses among the parts and replicas and assembles the chosen ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import (
    INVENTORY,
    check_inventory,
    inventory_entry,
    write_inventory,
)
from torchrelay.checkpoint.retention import PreservationPolicy
from torchrelay.checkpoint.storage import LocalStorage
from torchrelay.checkpoint.tiers import REPLICA_PREFIX, root_problem
from torchrelay.errors import CheckpointError, IntegrityError, RelayError, UnsafeInput, one_line
from torchrelay.log import logger
from torchrelay.paths.layout import TMP_CHECKPOINT_PREFIX, checkpoint_name
from torchrelay.util.kill_points import kill_point
from torchrelay.util.records import JSON_LIMIT, parse_json
from torchrelay.util.safepath import check_relative, is_inside, refuse_link, resolve_inside


@dataclass(frozen=True, slots=True)
class Nodes:
    """Where a rank sits: its node, how many nodes, ranks a node."""

    node: int
    nodes: int
    local: int

    @property
    def leader(self) -> int:
        """The node's first rank (it publishes, sends and receives for the node)."""
        return self.node * self.local

    @property
    def partner(self) -> int:
        return (self.node + 1) % self.nodes

    @property
    def source(self) -> int:
        """The node whose replica this node holds."""
        return (self.node - 1) % self.nodes


def nodes_of(rank: int, world_size: int) -> Nodes:
    """The launch's nodes by LOCAL_WORLD_SIZE (torchrun's; 1 node when unset or not a divisor)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "") or world_size)
    except ValueError:
        local = world_size
    if local <= 0 or world_size % local:
        local = world_size
    return Nodes(rank // local, world_size // local, local)


def replica_dir(root: Path, source: int) -> Path:
    return root / f"{REPLICA_PREFIX}{source}"


def _digest(entries: list[dict[str, Any]]) -> str:
    """The whole checkpoint's identity: its sorted file list with sizes and SHA-256."""
    rows = sorted((e["path"], e["size"], e["sha256"]) for e in entries)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _retain(folder: Path, retention: PreservationPolicy) -> None:
    from torchrelay.checkpoint.commit import retain  # imports torch

    retain(LocalStorage(folder, spare=False), retention)


# ------------------------------------------------------------------------------------------------ saving
def commit_parts(
    root: Path,
    update: int,
    write: Callable[[Path, Callable[[str], None] | None], dict[str, tuple[str, int]] | None],
    *,
    rank: int,
    world_size: int,
    info: dict[str, Any],
    retention: PreservationPolicy,
    group: Any,
    started: float,
) -> tuple[Path, float]:
    """A memory save on several nodes: each node's part published in its memory, then replicated to its partner
    (the save's stall covers both; the persist thread runs it). Every rank calls it; one failure is every rank's."""
    from torchrelay.checkpoint.commit import _complete_entries  # imports torch
    from torchrelay.util import collective

    where = nodes_of(rank, world_size)
    lead = rank == where.leader
    peers = collective.ranks(group)
    name = f"saving memory {checkpoint_name(update)}"
    staged: list[Path] = []

    def settle(_err: RelayError) -> None:
        for tmp in staged:
            shutil.rmtree(tmp, ignore_errors=True)

    with peers.phase(name, settle=settle, end=False):
        tmp = root / peers.broadcast(
            name, lambda: f"{TMP_CHECKPOINT_PREFIX}{update}-{os.getpid()}-{int(time.time() * 1000)}"
        )
        tmp.mkdir(parents=True, exist_ok=True)  # every node stages in its own memory
        if lead:
            staged.append(tmp)
        written = peers.agree(name, lambda: write(tmp, None))
        mine = None if written is None else [inventory_entry(rel, *d) for rel, d in written.items()]
        gathered = peers.all_gather(name, lambda: mine)

        def my_part() -> list[dict[str, Any]] | None:
            if not lead:
                return None
            reported = [e for r in range(rank, rank + where.local) for e in (gathered[r] or [])]
            return _complete_entries(tmp, reported)

        parts = peers.all_gather(name, my_part)
        whole = [e for p in parts if p for e in p]
        part_info = {"node": where.node, "nodes": where.nodes, "checkpoint_sha256": _digest(whole),
                     "files": len(whole)}  # fmt: skip
        seconds = time.perf_counter() - started
        final = root / checkpoint_name(update)
        if lead:

            def marker(st: Path) -> None:
                write_inventory(st, parts[rank] or [], update=update, save_seconds=round(seconds, 4),
                                world_size=world_size, **info, part=part_info)  # fmt: skip

            final = LocalStorage(root, spare=False).publish(tmp, update, marker)
            staged.clear()
            _retain(root, retention)
        peers.exchange(name)  # every node's part is published
    if where.nodes > 1:
        _replicate(root, update, final, where, lead, peers, group, retention)
    return final, time.perf_counter() - started


def _replicate(
    root: Path,
    update: int,
    final: Path,
    where: Nodes,
    lead: bool,
    peers: Any,
    group: Any,
    retention: PreservationPolicy,
) -> None:
    """Each node's first rank sends its published part to its partner's and writes the part it receives."""
    name = f"replicating memory {checkpoint_name(update)} to node {where.partner}"
    with peers.phase(name):  # a refused replica is said and not kept (keep_replica): the save goes on
        if not lead:
            return
        payload = _pack(final)
        kill_point(f"send:{update}:{where.leader}")
        got = _swap(payload, where.partner * where.local, where.source * where.local, group)
        midway = functools.partial(kill_point, f"receive:{update}:{where.leader}")
        keep_replica(
            root, update, got, source=where.source, node=where.node, retention=retention, midway=midway
        )


def keep_replica(
    root: Path,
    update: int,
    got: bytes | bytearray | memoryview,
    *,
    source: int,
    node: int,
    retention: PreservationPolicy,
    midway: Callable[[], None] | None = None,
) -> Path | None:
    """Write the part node `source` sent (`got`, every byte the peer's) as replica-node<source>/ of this node's
    memory `root`, its marker last; a payload that is not a part of node `source` for `update` whose every file
    lands inside the replica folder is refused in one line naming the peer and the field, nothing is kept, and a
    resume takes the next tier as for a flipped byte (the save itself goes on)."""
    peer = f"node {source}"
    folder = replica_dir(root, source)
    tmp = folder / f"{TMP_CHECKPOINT_PREFIX}{update}-{os.getpid()}-{int(time.time() * 1000)}"
    try:
        refuse_link(root, what="the memory tier's folder")
        refuse_link(folder, what=f"the replica folder of {peer}")
        # this node's folders, made and checked at the tier's first save, and the replica's: this user's alone
        problem = root_problem(folder, make=True, below=root.parent)
        if problem is not None:
            raise UnsafeInput(problem)
        if not is_inside(root, folder):  # a link on the way, planted after the check above
            raise UnsafeInput(f"{folder} (the replica folder of {peer}) leads outside {root}")
        doc = receive_part(got, tmp, peer=peer, node=source, update=update, midway=midway)
        doc["replica"] = {"held_on": socket.gethostname(), "node": node}
        published = LocalStorage(folder, spare=False).publish(tmp, update, lambda st: _write_doc(st, doc))
    except (RelayError, OSError) as exc:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        why = exc.message if isinstance(exc, RelayError) else one_line(exc)
        logger.warning(f"[torchrelay] replica of {peer} {checkpoint_name(update)} refused: {why[:400]}; not kept, "
                       "a resume takes the next tier")  # fmt: skip
        return None
    _retain(folder, retention)
    return published


def _write_doc(folder: Path, doc: dict[str, Any]) -> None:
    info = {k: v for k, v in doc.items() if k not in ("files", "format")}
    write_inventory(folder, doc["files"], **info)


def _pack(folder: Path) -> bytearray:
    """A published part as one buffer: its inventory's length (8 bytes), the inventory, then its files in the
    inventory's order. Each file is read straight into its place: the part is held once, not per file and again
    joined (a node's whole state, while the training runs)."""
    doc = (folder / INVENTORY).read_bytes()
    files = json.loads(doc)["files"]
    out = bytearray(8 + len(doc) + sum(int(e["size"]) for e in files))
    out[:8], out[8 : 8 + len(doc)] = len(doc).to_bytes(8, "little"), doc
    view, at = memoryview(out), 8 + len(doc)
    for e in files:
        with open(folder / e["path"], "rb") as f:
            got = f.readinto(view[at : at + int(e["size"])])
        if got != e["size"]:
            raise CheckpointError(f"{folder / e['path']}: {got} bytes read, its inventory lists {e['size']}")
        at += got
    return out


def receive_part(
    data: bytes | bytearray | memoryview,
    tmp: Path,
    *,
    peer: str,
    node: int,
    update: int,
    midway: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write a part received from `peer` (as `_pack` makes it) into `tmp`, a folder made here (its inventory not
    yet); its inventory, checked as one read from disk is. Every byte is the peer's: the inventory bounded and
    checked field by field, `part` naming node `node` and `update`, each path relative and inside `tmp` (no
    absolute path, no `..`, no link, none twice), the payload exactly the files listed, each file checked against
    its entry; anything else is one line naming the peer and the field, and nothing is written outside `tmp`."""
    source = f"the part received from {peer}"
    if len(data) < 8:
        raise IntegrityError(f"{source}: {len(data)} bytes, fewer than its 8-byte header")
    n = int.from_bytes(data[:8], "little")
    if n > min(JSON_LIMIT, len(data) - 8):
        raise IntegrityError(f"{source}: its header says an inventory of {n:,} bytes, {len(data) - 8:,} came")
    doc = check_inventory(parse_json(bytes(data[8 : 8 + n]), source=source), source)
    part = doc.get("part") or {}
    if part.get("node") != node or doc.get("update") != update:
        raise IntegrityError(f"{source}: field 'part.node' {part.get('node')!r} and 'update' "
                             f"{str(doc.get('update'))[:20]!r}, not node {node}'s part of update {update}")  # fmt: skip
    listed = sum(e["size"] for e in doc["files"])
    if 8 + n + listed != len(data):
        raise IntegrityError(
            f"{source}: {len(data) - 8 - n:,} bytes of files came, field 'files' lists {listed:,}"
        )
    rels: set[str] = set()
    for i, entry in enumerate(doc["files"]):
        rel = check_relative(entry["path"], source=f"{source}, field 'files[{i}].path'").as_posix()
        if rel in rels or rel == INVENTORY:
            raise UnsafeInput(
                f"{source}, field 'files[{i}].path': {rel!r} is listed twice or is the inventory"
            )
        rels.add(rel)
    tmp.mkdir(mode=0o700)  # never one already there: nothing planted in it
    at = 8 + n
    for i, entry in enumerate(doc["files"]):
        body = data[at : at + entry["size"]]
        at += entry["size"]
        if hashlib.sha256(body).hexdigest() != entry["sha256"].lower():
            raise IntegrityError(
                f"{source}, field 'files[{i}]': the bytes of {entry['path']!r} do not match its SHA-256"
            )
        path = resolve_inside(tmp, entry["path"], source=f"{source}, field 'files[{i}].path'")
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(path.parent, what=f"a folder of {source}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        if midway is not None:
            midway()  # a crash test's moment: one file of the part written, the rest not (kill_points.py)
            midway = None
    return doc


def _swap(payload: bytes | bytearray, to: int, frm: int, group: Any) -> memoryview:
    """Send `payload` to rank `to` and receive one from rank `frm` at once (a ring: no pair waits on another)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        raise CheckpointError(
            "the memory tier's replica travels over a gloo group: set async_save true (its persist has one)"
        )
    size = torch.tensor([len(payload)], dtype=torch.int64)
    other = torch.zeros(1, dtype=torch.int64)
    _wait(dist.isend(size, to, group=group), dist.irecv(other, frm, group=group))
    out = torch.empty(int(other.item()), dtype=torch.uint8)
    # a bytearray (what _pack makes) is sent in place; frombuffer needs a writable buffer, so bytes are copied
    writable = payload if isinstance(payload, bytearray) else bytearray(payload)
    send = torch.frombuffer(writable, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    _wait(dist.isend(send, to, group=group), dist.irecv(out, frm, group=group))
    return memoryview(out.numpy().data)  # the received tensor's own bytes, not a copy of them


def _wait(*ops: Any) -> None:
    for op in ops:
        if op is not None:
            op.wait()


def said_once(rank: int, world_size: int) -> None:
    """One line (rank 0) when the memory tier runs on one node: no partner, nothing replicated."""
    if rank == 0 and nodes_of(rank, world_size).nodes == 1:
        logger.info("[torchrelay] memory tier on one node: no partner node, nothing replicated")
