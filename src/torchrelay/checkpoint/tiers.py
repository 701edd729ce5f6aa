"""The node-local memory tier: checkpoints every `memory_every` updates in /dev/shm, with the durable tier's proof.

A memory checkpoint is written by the same commit protocol into another storage (storage.LocalStorage over
/dev/shm/torchrelay-<uid>/<lineage>/<run>/): tmpfs outlives the training processes, so a SIGKILL of every rank leaves it,
and a relaunch on the same node resumes from it instead of from the run directory. Its inventory is the durable
one's (sizes, SHA-256, part states, marker last) plus what binds it to this run: lineage, run directory, segment,
contract digest, world layout and host. At open, rank 0 takes the newest memory checkpoint newer than the newest
durable one only after hashing every file and checking every binding; anything else is refused in one line and the
next candidate (in the end the durable tier) is used. Memory checkpoints are never packed, handed off, validated or
exported: those read the run directory only. Memory checkpoints past the chosen update (a future a resume threw
away) are deleted at open, so none of them can be chosen later against a shorter history.

/dev/shm is every user's and every job's: each user's tier is a folder of its own (TORCHRELAY_MEMORY_ROOT, the
user's choice, or /dev/shm/torchrelay-<uid>), and every folder torchrelay makes below the shared one is made 0700
and checked before anything in it is written, read or deleted (util/private_dir.py): a folder another user made or
could write in turns the tier off for the segment in one line, the durable tier saving as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.storage import LocalStorage
from torchrelay.config import envvars
from torchrelay.errors import RelayError, UnsafeInput, one_line
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.private_dir import private_folder

MEMORY, DURABLE = "memory", "durable"
RUN_DIGEST = 12  # hex characters of the name of a run directory's folder (`run_digest`)
REPLICA_PREFIX = "replica-node"  # replica-node<n>/: the replica of node n's parts a node holds (replica.py)


SHARED = Path("/dev/shm")  # every user's and every job's (1777)


def memory_base() -> tuple[Path, Path]:
    """(the folder trusted as it is, the folder memory roots are made in): TORCHRELAY_MEMORY_ROOT (the user's
    choice) for both, else /dev/shm and this user's own folder in it, /dev/shm/torchrelay-<uid>."""
    chosen = envvars.MEMORY_ROOT.get()
    if chosen:
        return Path(chosen), Path(chosen)
    return SHARED, SHARED / f"torchrelay-{os.geteuid()}"


def memory_root(lineage: str, run: RunDir) -> Path:
    """Where this run's memory checkpoints live on this node: by lineage, then by run directory (a copy of a run
    directory shares its lineage, never its memory checkpoints)."""
    return memory_base()[1] / lineage / run_digest(run.path)


def run_digest(run_dir: str | os.PathLike[str]) -> str:
    """The name of a run directory's folder in the memory tier: its resolved path's digest, RUN_DIGEST hex long."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:RUN_DIGEST]


def root_problem(root: Path, *, make: bool, below: Path | None = None) -> str | None:
    """Why the memory tier must not use `root` on this node (one line naming the folder and what to do), or
    None: each folder torchrelay makes below the trusted one, made 0700 where `make`, must be a real folder of
    this user's that no one else may write (util/private_dir.py). A folder outside the tier's base is checked
    from below `below` (its parent by default) down."""
    trusted = memory_base()[0]
    if root.is_relative_to(trusted) and root != trusted:
        below = trusted
    why = private_folder(root, below=below or root.parent, make=make)
    if why is None:
        return None
    return (f"{why[0]} on {socket.gethostname()} {why[1]}: another user's folder, or one "
            "others could write in, is never used; remove it if it is not yours, or set TORCHRELAY_MEMORY_ROOT "
            "to a folder of your own")  # fmt: skip


def memory_storage(lineage: str, run: RunDir) -> LocalStorage:
    """The memory tier's storage, its folders made (owner only) and checked (`root_problem`: UnsafeInput with its
    line). The checkpoint retention retires stays as the spare the next memory save writes over (recycle.py): no
    tmpfs pages allocated and zeroed per save; it is one of the keep + 1 slots the capacity check counts."""
    root = memory_root(lineage, run)
    problem = root_problem(root, make=True)
    if problem is not None:
        raise UnsafeInput(problem)
    return LocalStorage(root, spare=True)


@dataclass(frozen=True, slots=True)
class Binding:
    """What a memory checkpoint must name to be this run's, at this layout."""

    lineage: str
    run_dir: str
    contract_sha256: str
    world_size: int
    micro_batch: int
    grad_accum: int

    def info(self) -> dict[str, Any]:
        """The inventory fields a memory save adds to the durable tier's."""
        return {
            "tier": MEMORY,
            "lineage": self.lineage,
            "run_dir": self.run_dir,
            "host": socket.gethostname(),
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
        }

    def mismatch(self, doc: dict[str, Any], segments: set[str], host: str | None = None) -> str | None:
        """The first binding `doc` (a memory checkpoint's inventory) breaks, or None; `host`: the node it must
        have been written on (this one's by default; a partner's replica names its source node's)."""
        want = {
            "tier": MEMORY,
            "lineage": self.lineage,
            "run_dir": self.run_dir,
            "contract_sha256": self.contract_sha256,
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "host": host or socket.gethostname(),
        }
        for key, value in want.items():
            if doc.get(key) != value:
                return f"its {key} is {str(doc.get(key))[:80]!r}, this launch's is {str(value)[:80]!r}"
        if doc.get("segment") not in segments:
            return f"its segment {str(doc.get('segment'))[:40]!r} is not in this run's history"
        return None


@dataclass(frozen=True, slots=True)
class Choice:
    """The memory checkpoint a resume takes (None: the durable tier's), and one line per refused candidate."""

    checkpoint: Path | None
    update: int
    refused: list[str]


def choose_memory(root: Path, binding: Binding, durable_update: int, segments: set[str]) -> Choice:
    """Rank 0 at open: the newest memory checkpoint newer than `durable_update` whose every file matches its
    inventory and whose inventory names this run; then everything past the chosen update is deleted."""
    from torchrelay.checkpoint.commit import (
        clean_stale,
    )  # imports torch: `status` reads this module without it

    storage = LocalStorage(root, spare=False)
    refused: list[str] = []
    chosen: tuple[Path, int] | None = None
    problem = root_problem(root, make=False)  # nothing is read or deleted in a folder not this user's alone
    if problem is not None:
        return Choice(None, durable_update, [f"memory tier refused: {problem}"])
    if root.is_dir():
        clean_stale(root)  # a save cut by the kill
        for info in reversed(storage.list_complete()):
            if info.update <= durable_update:
                break
            if not info.complete:
                refused.append(f"memory {info.path.name} refused: {info.reason[:200]}")
                continue
            try:
                doc = validate_complete(info.path, hashes=True)
            except (RelayError, OSError) as exc:
                why = exc.message if isinstance(exc, RelayError) else one_line(exc)
                refused.append(f"memory {info.path.name} refused: {why[:300]}")
                continue
            bad = binding.mismatch(doc, segments)
            if bad is not None:
                refused.append(f"memory {info.path.name} refused: {bad}")
                continue
            chosen = (info.path, info.update)
            break
        keep = chosen[1] if chosen else durable_update
        for info in storage.list_complete():
            if info.update > keep:
                shutil.rmtree(info.path, ignore_errors=True)
    if chosen is None:
        return Choice(None, durable_update, refused)
    return Choice(chosen[0], chosen[1], refused)


def missing_note(root: Path, memory_every: int, durable_update: int, reached: int | None) -> str | None:
    """The line a resume notes when no memory checkpoint was found past the durable one although the run, having
    logged `reached`, had committed one: its memory was wiped between the launches (a reboot, a job epilog, a
    per-job /dev/shm, Slurm's job_container/tmpfs), or this is another node. None when the tier can have missed
    nothing: an update is logged once the save before the newest one has committed (run/loop.py), so only the save
    point before the last one logged is sure to be there."""
    if memory_every <= 0 or reached is None or (reached // memory_every - 1) * memory_every <= durable_update:
        return None
    held = "holds none" if root.is_dir() else "is gone"
    return (
        f"no memory checkpoint past update {durable_update} though the run reached update {reached} "
        f"(memory_every {memory_every}): {root} on {socket.gethostname()} {held} (wiped since the last launch, "
        "another node, or the tier off for lack of room); resuming from the durable tier"
    )


def forget(lineage: str | None, run: RunDir) -> None:
    """Delete this run's memory checkpoints on this node (a finished run, whose durable tier has the end); nothing
    in a folder that is not this user's alone (`root_problem`: another user's, or one others may write in)."""
    if lineage:
        root = memory_root(lineage, run)
        if root_problem(root, make=False) is not None:
            return
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.parent.rmdir()  # the lineage's folder, once no run directory of it has a memory tier here


def capacity(
    total_bytes: int, keep: int, shm_free: int, ram_free: int, where: str = "this node"
) -> tuple[int, str | None]:
    """How many memory checkpoints fit (`keep`, fewer, or 0: off), and the one line saying why when not `keep`.
    A save holds keep + 1 slots at its peak (the new one is published before retention deletes the oldest)."""
    room = min(shm_free, ram_free)
    if total_bytes <= 0 or total_bytes * (keep + 1) <= room:
        return keep, None
    fits = room // total_bytes - 1
    need = _gib(total_bytes * (keep + 1))
    if fits >= 1:
        return int(fits), (
            f"memory tier reduced to memory_keep {fits}: {keep} + 1 slots of {_gib(total_bytes)} need {need}, {where} "
            f"has {_gib(shm_free)} free in /dev/shm and {_gib(ram_free)} of RAM available"
        )
    return 0, (
        f"memory tier off for this segment: 2 slots of {_gib(total_bytes)} do not fit in {_gib(shm_free)} free in "
        f"/dev/shm and {_gib(ram_free)} of RAM available on {where}; the durable tier saves as before"
    )


def tier_verdict(
    per_rank: list[tuple[int, int, int, str | None]], local: int, keep: int
) -> tuple[int, str | None]:
    """What every rank decides alike at the tier's first save from what each gathered (state bytes, bytes free in
    /dev/shm, RAM available, `root_problem` of its node's root): a folder unfit on any node turns the tier off in
    that node's line, else `node_capacity`."""
    problem = next((r[3] for r in per_rank if r[3]), None)
    if problem is not None:
        return 0, f"memory tier off for this segment: {problem}; the durable tier saves as before"
    return node_capacity([(r[0], r[1], r[2]) for r in per_rank], local, keep)


def node_capacity(per_rank: list[tuple[int, int, int]], local: int, keep: int) -> tuple[int, str | None]:
    """`capacity` on every node of a launch of `local` ranks a node, from each rank's (state bytes, bytes free in
    /dev/shm, RAM available): node n holds a slot of its own part (its ranks' states) and, on several nodes, one of
    the replica of node n-1's part; the memory_keep every node can hold (retention is the same on each: a resume
    needs every part of one update), and the line of the node that holds the fewest."""
    nodes = len(per_rank) // local if 0 < local <= len(per_rank) and len(per_rank) % local == 0 else 1
    local = len(per_rank) // nodes
    parts = [sum(int(r[0]) for r in per_rank[n * local : (n + 1) * local]) for n in range(nodes)]
    best: tuple[int, str | None] = (keep, None)
    for n in range(nodes):
        slot = parts[n] + (parts[(n - 1) % nodes] if nodes > 1 else 0)
        where = (
            "this node" if nodes == 1 else f"node {n} (its part and the replica of node {(n - 1) % nodes}'s)"
        )
        room = per_rank[n * local]
        fits, line = capacity(slot, keep, int(room[1]), int(room[2]), where)
        if fits < best[0]:
            best = (fits, line)
    return best


def tier_at_open(
    memory_every: int, lineage: str | None, *, hosts: int, nodes: int, async_save: bool, deepspeed: bool
) -> tuple[bool, str | None]:
    """Whether the memory tier runs this segment, and the one line saying why not where it was asked for: decided
    once at open, from what every rank knows alike, so that no save fails mid-run."""
    if memory_every <= 0 or not lineage:
        return False, None
    if hosts > nodes:
        return False, (f"memory tier off: the ranks run on {hosts} hosts but LOCAL_WORLD_SIZE says {nodes} "
                       "node(s); the durable tier saves as before")  # fmt: skip
    if nodes > 1 and deepspeed:
        # an engine writes its files itself, on the training's group, into one folder per rank set: no part per
        # node, no replica; its save would fail on the second node's memory, which rank 0 cannot see
        return False, ("memory tier off: a DeepSpeed engine (params.deepspeed) saves its own files and on "
                       f"{nodes} nodes the tier needs a part per node and its replica; the durable tier saves as "
                       "before (one node keeps the memory tier)")  # fmt: skip
    if nodes > 1 and not async_save:
        return False, ("memory tier off: its replica to a partner node travels on the background save's group; "
                       "set async_save true")  # fmt: skip
    return True, None


def node_free() -> tuple[int, int]:
    """Bytes free in the memory tier's file system and RAM available on this node."""
    base = memory_base()[0]
    while not base.exists():
        base = base.parent
    st = os.statvfs(base)
    ram = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    ram = int(line.split()[1]) * 1024
    except OSError:
        ram = st.f_bavail * st.f_frsize
    return st.f_bavail * st.f_frsize, ram


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def held_replicas(root: Path) -> list[tuple[int, Path]]:
    """(source node, folder) of each replica folder this node's memory `root` holds (links are not followed)."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        number = folder.name.removeprefix(REPLICA_PREFIX)
        if folder.name.startswith(REPLICA_PREFIX) and number.isdigit() and not folder.is_symlink():
            found.append((int(number), folder))
    return sorted(found)


def describe(root: Path) -> list[str]:
    """`status`'s lines for the memory tier of this node: its complete checkpoints, then the replicas it holds."""
    if not root.is_dir():
        return []
    ckpts = [c for c in LocalStorage(root, spare=False).list_complete() if c.complete]
    lines = [f"memory tier ({root}): {', '.join(checkpoint_name(c.update) for c in ckpts) or 'none'}"]
    for source, folder in held_replicas(root):
        held = [c for c in LocalStorage(folder, spare=False).list_complete() if c.complete]
        lines.append(
            f"replica of node {source}: {', '.join(checkpoint_name(c.update) for c in held) or 'none'}"
        )
    return lines
