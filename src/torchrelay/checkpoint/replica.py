"""The memory tier on several nodes: each node's part in its own memory, a replica of it on the partner node.

Node n is ranks [n*L, (n+1)*L) of a launch with L = LOCAL_WORLD_SIZE ranks a node; its partner is node n+1 mod
nodes. A memory save writes each rank's files into its own node's memory root (tiers.memory_root), and each node's
first rank publishes its node's part there: the files its ranks wrote, an inventory of them (sizes, SHA-256) with
the durable tier's bindings, and `part` (node, nodes, the digest of the whole checkpoint's file list), the marker
last. Then each node's first rank sends its part through the save's gloo group to its partner's, which writes it
under replica-node<n>/ of its memory root, verified against the inventory, its marker last: a replication cut by a
kill leaves a temporary, removed and never chosen. One node: no partner, nothing replicated.

At open every node's first rank verifies what its node holds (its parts and its replicas: sizes and SHA-256), and
rank 0 chooses the newest update whose every node's part is there verified (own first, else the partner's
replica), all naming the same checkpoint; a refused one in one line naming the file, the next tier then used. The
chosen parts are then assembled in each node's memory (resume-<update>/, the part held there linked, the others
sent by their holders), checked against their inventory, and the ranks load that.
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
    list_files,
    validate_complete,
    write_inventory,
)
from torchrelay.checkpoint.retention import PreservationPolicy
from torchrelay.checkpoint.storage import LocalStorage
from torchrelay.checkpoint.tiers import MEMORY, REPLICA_PREFIX, Binding, held_replicas, memory_root
from torchrelay.errors import CheckpointError, IntegrityError, RelayError, UnsafeInput, one_line
from torchrelay.log import logger
from torchrelay.paths.layout import TMP_CHECKPOINT_PREFIX, checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.kill_points import kill_point
from torchrelay.util.records import JSON_LIMIT, parse_json
from torchrelay.util.safepath import check_relative, is_inside, refuse_link, resolve_inside

REPLICA = "replica"
RESUME_PREFIX = "resume-"


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
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
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


# ------------------------------------------------------------------------------------------------ resuming
def survey(run_dir: RunDir, rank: int, world_size: int) -> dict[str, Any] | None:
    """A node's first rank at open: every part and replica its memory holds, each verified (sizes, SHA-256)."""
    from torchrelay.checkpoint.commit import clean_stale  # imports torch

    where = nodes_of(rank, world_size)
    if rank != where.leader:
        return None
    try:
        lineage = json.loads(run_dir.lineage_path.read_text())["lineage"]
    except (OSError, ValueError, KeyError, TypeError):
        return {"node": where.node, "host": socket.gethostname(), "parts": []}
    root = memory_root(lineage, run_dir)
    parts: list[dict[str, Any]] = []
    # a relaunch may number the nodes otherwise (torchrun's rendezvous numbers them as they join): what a node holds
    # is named by the node its inventory says, its folder saying it only where the inventory cannot be read
    folders = [(where.node, root, False), *((n, f, True) for n, f in held_replicas(root))]
    for label, folder, is_replica in folders:
        if not folder.is_dir():
            continue
        clean_stale(folder)  # a save or a replication cut by a kill
        for info in LocalStorage(folder, spare=False).list_complete():
            what = f"{'replica of node ' + str(label) if is_replica else 'memory'} {info.path.name}"
            item: dict[str, Any] = {"source": label, "held_by": where.node, "replica": is_replica,
                                    "update": info.update, "doc": {}}  # fmt: skip
            if not info.complete:
                item["why"] = f"{what} on {socket.gethostname()} refused: {info.reason[:200]}"
            else:
                try:
                    doc = validate_complete(info.path, hashes=True)
                    item["doc"] = {k: v for k, v in doc.items() if k != "files"}
                    item["why"] = None
                    node = (doc.get("part") or {}).get("node")
                    item["source"] = node if isinstance(node, int) and not isinstance(node, bool) else label
                except (RelayError, OSError) as exc:
                    why = exc.message if isinstance(exc, RelayError) else one_line(exc)
                    item["why"] = f"{what} on {socket.gethostname()} refused: {why[:300]}"
            parts.append(item)
    return {"node": where.node, "host": socket.gethostname(), "parts": parts}


@dataclass(frozen=True, slots=True)
class NodesChoice:
    """The update a multi-node resume takes from memory (None: the durable tier), which node holds each node's
    part (`plan[n]`), the tier (MEMORY: every part its own node's; REPLICA: one or more from a partner)."""

    update: int | None
    plan: list[int]
    tier: str
    refused: list[str]


def choose(
    holdings: list[dict[str, Any]], binding: Binding, durable_update: int, segments: set[str]
) -> NodesChoice:
    """Rank 0: the newest update past `durable_update` whose every node's part is held verified, bound to this run,
    all naming one checkpoint; own part first, then the partner's replica."""
    nodes = len(holdings)
    refused: list[str] = []
    ups = sorted(
        {p["update"] for h in holdings for p in h["parts"] if p["update"] > durable_update}, reverse=True
    )
    for update in ups:
        plan: list[int] = []
        digests: set[str] = set()
        replicas = False
        for m in range(nodes):
            held = None
            # wherever it is (a relaunch may number the nodes otherwise): a node's own part first, a replica next
            found = [(h, p) for h in range(nodes) for p in holdings[h]["parts"]
                     if p["source"] == m and p["update"] == update]  # fmt: skip
            for holder, item in sorted(found, key=lambda hp: (bool(hp[1].get("replica")), hp[0] != m)):
                why = item["why"] or _bad(item, holdings[holder]["host"], binding, segments, m, nodes)
                if why:
                    refused.append(why)
                    continue
                held = holder
                replicas = replicas or bool(item.get("replica"))
                digests.add(item["doc"]["part"]["checkpoint_sha256"])
                break
            if held is not None:  # every node is looked at: each refused part is said
                plan.append(held)
        if len(plan) == nodes and len(digests) == 1:
            return NodesChoice(update, plan, REPLICA if replicas else MEMORY, refused)
        if len(plan) == nodes:
            refused.append(
                f"memory {checkpoint_name(update)} refused: its nodes' parts name different checkpoints"
            )
    return NodesChoice(None, [], "durable", refused)


def _bad(
    item: dict[str, Any], host: str, binding: Binding, segments: set[str], node: int, nodes: int
) -> str | None:
    doc = item["doc"]
    kind = f"replica of node {node}" if item.get("replica") else "memory"
    name = f"{kind} {checkpoint_name(item['update'])} on {host} refused"
    part = doc.get("part") or {}
    if part.get("node") != node or part.get("nodes") != nodes:
        return f"{name}: it is node {part.get('node')!r} of {part.get('nodes')!r}, not node {node} of {nodes}"
    # a part names the host that wrote it; a replica is checked where it is held
    wrote_on = doc.get("host") if "replica" in doc else host
    if "replica" in doc and (doc["replica"] or {}).get("held_on") != host:
        return f"{name}: it was received on {(doc['replica'] or {}).get('held_on')!r}"
    bad = binding.mismatch(doc, segments, host=wrote_on)
    return f"{name}: {bad}" if bad else None


def settle_after_open(run_dir: RunDir, lineage: str | None, rank: int, world_size: int, update: int,
                      plan: list[int] | None) -> Path | None:  # fmt: skip
    """Every rank after a multi-node open: each node's memory loses what lies past the update resumed from (a
    future the resume threw away); with a `plan`, the chosen parts are assembled in each node's memory and its
    path returned (every rank waits for them)."""
    from torchrelay.util import collective

    where = nodes_of(rank, world_size)
    if lineage is None or where.nodes == 1:
        return None
    root = memory_root(lineage, run_dir)
    lead = rank == where.leader
    peers = collective.ranks()
    name = f"assembling memory {checkpoint_name(update)}"
    with peers.phase(name):
        if lead and root.is_dir():
            for folder in (root, *(f for _, f in held_replicas(root))):
                for info in LocalStorage(folder, spare=False).list_complete() if folder.is_dir() else []:
                    if info.update > update:
                        shutil.rmtree(info.path, ignore_errors=True)
            for old in root.glob(f"{RESUME_PREFIX}*"):
                shutil.rmtree(old, ignore_errors=True)
        if plan is None:
            return None
        out = root / f"{RESUME_PREFIX}{update}"
        tmp = root / f"{TMP_CHECKPOINT_PREFIX}{RESUME_PREFIX}{update}-{os.getpid()}"
        if lead:
            root.mkdir(
                parents=True, exist_ok=True, mode=0o700
            )  # a replacement node's memory holds nothing yet
        docs: list[dict[str, Any]] = []
        failed: BaseException | None = None
        for m, holder in enumerate(plan):
            here = _held(root, m, update) if where.node == holder else None
            box = [_pack(here) if here is not None and rank == where.leader else None]
            src = holder * where.local
            _broadcast(box, src)
            if not lead or failed is not None:
                continue  # a refused part is raised after every broadcast: no peer is left waiting in one
            try:
                docs.append(_assemble_part(box[0], here, tmp, peer=f"node {holder} (rank {src})", node=m,
                                           update=update))  # fmt: skip
            except (RelayError, OSError) as exc:
                failed = exc
        if failed is not None:
            _discard(tmp, len(plan))
            raise failed
        if lead:
            entries = [e for d in docs for e in d["files"]]
            want = docs[0]["part"]["checkpoint_sha256"]
            if _digest(entries) != want or set(list_files(tmp)) != {e["path"] for e in entries}:
                _discard(tmp, len(plan))
                held = ", ".join(str(_held(root, m, update) / INVENTORY) for m in range(len(plan)))
                raise IntegrityError(f"{held}: the parts' files are not the checkpoint their field "
                                     "'part.checkpoint_sha256' names")  # fmt: skip
            fields = {k: v for k, v in docs[0].items() if k not in ("files", "format", "part", "replica")}
            write_inventory(tmp, entries, **fields)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)
    logger.info(f"[torchrelay] memory {checkpoint_name(update)} assembled from nodes {plan} in {out}")
    return out


def _discard(tmp: Path, nodes: int) -> None:
    """A refused assembly leaves nothing: the checkpoint being assembled and each part received for it."""
    for folder in (tmp, *(tmp.parent / f"{tmp.name}-node{m}" for m in range(nodes))):
        shutil.rmtree(folder, ignore_errors=True)


def _assemble_part(
    got: Any, here: Path | None, tmp: Path, *, peer: str, node: int, update: int
) -> dict[str, Any]:
    """One node's part into the checkpoint being assembled in `tmp`: hard-linked where this node holds it (verified
    at open), else from the bytes `peer` broadcast (receive_part's checks); its inventory."""
    if here is not None:
        doc = check_inventory(json.loads((here / INVENTORY).read_text()), here / INVENTORY)
        tmp.mkdir(exist_ok=True, mode=0o700)
        for e in doc["files"]:
            path = resolve_inside(tmp, e["path"], source=str(here / INVENTORY))
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(resolve_inside(here, e["path"], source=str(here / INVENTORY)), path)
        return doc
    sub = tmp.parent / f"{tmp.name}-node{node}"
    doc = receive_part(
        got if isinstance(got, bytes | bytearray) else b"", sub, peer=peer, node=node, update=update
    )
    _merge(sub, tmp)
    return doc


def _merge(sub: Path, tmp: Path) -> None:
    """Move the files of a received part (`sub`, checked by receive_part) into the checkpoint being assembled."""
    tmp.mkdir(exist_ok=True, mode=0o700)
    for rel in list_files(sub):
        dest = resolve_inside(tmp, rel, source=str(tmp))
        dest.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(dest):
            raise UnsafeInput(
                f"{tmp}: {rel!r} comes in two nodes' parts; the assembled checkpoint is refused"
            )
        os.rename(sub / rel, dest)
    shutil.rmtree(sub, ignore_errors=True)


def _held(root: Path, source: int, update: int) -> Path:
    """Where this node holds node `source`'s part of `update`: its own memory when the part there is node
    `source`'s (it was that node when it saved), else its replica of node `source`."""
    own = root / checkpoint_name(update)
    try:
        if json.loads((own / INVENTORY).read_text())["part"]["node"] == source:
            return own
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return replica_dir(root, source) / checkpoint_name(update)


def _broadcast(box: list[Any], src: int) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list(box, src=src)


def said_once(rank: int, world_size: int) -> None:
    """One line (rank 0) when the memory tier runs on one node: no partner, nothing replicated."""
    if rank == 0 and nodes_of(rank, world_size).nodes == 1:
        logger.info("[torchrelay] memory tier on one node: no partner node, nothing replicated")
