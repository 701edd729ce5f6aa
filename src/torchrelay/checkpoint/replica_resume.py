"""The memory tier on several nodes at open: what each node holds verified, the update chosen, its parts assembled.

At open every node's first rank verifies what its node holds (its parts and its replicas: sizes and SHA-256), and
rank 0 chooses the newest update whose every node's part is there verified (own first, else the partner's
replica), all naming the same checkpoint; a refused one in one line naming the file, the next tier then used. The
chosen parts are then assembled in each node's memory (resume-<update>/, the part held there linked, the others
sent by their holders), checked against their inventory, and the ranks load that.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import (
    INVENTORY,
    check_inventory,
    list_files,
    validate_complete,
    write_inventory,
)
from torchrelay.checkpoint.replica import _digest, _pack, nodes_of, receive_part, replica_dir
from torchrelay.checkpoint.storage import LocalStorage
from torchrelay.checkpoint.tiers import MEMORY, Binding, held_replicas, memory_root, root_problem
from torchrelay.errors import IntegrityError, RelayError, UnsafeInput, one_line
from torchrelay.log import logger
from torchrelay.paths.layout import TMP_CHECKPOINT_PREFIX, checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.safepath import resolve_inside

REPLICA = "replica"
RESUME_PREFIX = "resume-"


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
    problem = root_problem(root, make=False)  # nothing is read in a folder not this user's alone
    if problem is not None:
        logger.warning(f"[torchrelay] memory tier refused: {problem}; the next tier is used")
        return {"node": where.node, "host": socket.gethostname(), "parts": []}
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
    part (`plan[n]`), the tier (MEMORY: every part its own node's; REPLICA: one or more from a partner), and one
    line per part taken from a replica (the segment notes it: the history says which node's part came whence)."""

    update: int | None
    plan: list[int]
    tier: str
    refused: list[str]
    from_replicas: list[str] = field(default_factory=list)


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
        replicas: list[str] = []
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
                if item.get("replica"):
                    replicas.append(f"node {m}'s part of memory {checkpoint_name(update)} from its replica on "
                                    f"{holdings[holder]['host']} (node {holder})")  # fmt: skip
                digests.add(item["doc"]["part"]["checkpoint_sha256"])
                break
            if held is not None:  # every node is looked at: each refused part is said
                plan.append(held)
        if len(plan) == nodes and len(digests) == 1:
            return NodesChoice(update, plan, REPLICA if replicas else MEMORY, refused, replicas)
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
    # a folder not this user's alone: nothing in it is deleted, nothing assembled there (the next tier is used)
    problem = root_problem(root, make=plan is not None) if lead else None
    with peers.phase(name):
        if lead and problem is None and root.is_dir():
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
        docs: list[dict[str, Any]] = []
        # a replacement node's memory holds nothing yet: its folders were made above (root_problem)
        failed: BaseException | None = UnsafeInput(problem) if problem is not None else None
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
            if problem is None:
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
