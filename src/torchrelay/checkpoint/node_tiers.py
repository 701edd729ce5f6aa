"""This user's memory tiers on this node, whatever run they belong to: seen, judged, and freed when nobody needs them.

A memory tier is RAM (tmpfs). A run frees its own when a segment ends with a durable checkpoint at least as new
(run/saver.py, each node's first rank); what a run SIGKILLed and never relaunched here leaves (moved elsewhere,
given up, requeued on other nodes) stays until a reboot. `scan` lists every tier under this user's memory folder
(tiers.memory_base): the run directory it belongs to (read from its inventories, bound by the folder's digest),
the lineage, the updates it holds (own and replicas), bytes, age, and a verdict:

- live: a process on this node holds it (the shared flock every rank of a segment takes on its folder, `hold`), or
  someone holds the run's train or launch lock (paths/lock.py): never freed;
- stale: nothing a relaunch here could resume from: the run directory is gone or holds no run, its last segment
  finished, its newest durable checkpoint is at least as new as every update held, or it holds no complete
  checkpoint;
- kept: a memory checkpoint newer than the durable tier (a killed run a relaunch on this node resumes from).

`forget` frees one tier, after checking its folders are this user's alone (tiers.root_problem) and while holding
its flock exclusively (a run starting meanwhile does not get its hold, and a resume that read files vanishing under
it refuses them in one line and takes the durable tier).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import read_inventory
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.checkpoint.tiers import RUN_DIGEST, held_replicas, memory_base, root_problem, run_digest
from torchrelay.errors import RelayError, RunBusy, UnsafeInput
from torchrelay.paths.lock import describe, holder
from torchrelay.paths.rundir import RunDir
from torchrelay.records.history import read_history

LIVE, STALE, KEPT, REFUSED = "live", "stale", "kept", "refused"
LOCKS = ("train", "launch")  # the run's locks whose holder makes its tier live (paths/lock.py)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _take(root: Path, op: int) -> int:
    """The tier folder's descriptor, holding flock `op` without waiting; OSError where the folder cannot be opened,
    BlockingIOError where another process holds a lock that excludes `op`."""
    fd = os.open(root, _DIR)
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def hold(root: Path) -> int | None:
    """A shared flock on the tier's folder for as long as this process uses it (the descriptor, to `release`); None
    where it cannot be taken (no folder, or being freed: the run goes on without it)."""
    try:
        return _take(root, fcntl.LOCK_SH)
    except OSError:
        return None


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass(slots=True)
class NodeTier:
    """One memory tier on this node (a run directory's, under one lineage)."""

    root: str
    lineage: str
    run_dir: str | None  # None: no inventory names a run directory whose digest is this folder's
    updates: list[int] = field(default_factory=list)  # its own complete checkpoints
    replicas: dict[str, list[int]] = field(default_factory=dict)  # source node -> updates held for it
    bytes: int = 0
    age_s: float = 0.0  # since the newest change in it
    run_exists: bool = False
    finished: bool = False
    durable_update: int | None = None
    verdict: str = KEPT
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tiers_root() -> Path:
    """The folder this user's memory tiers are made in on this node."""
    return memory_base()[1]


def scan(now: float | None = None, locks: tuple[str, ...] = LOCKS) -> list[NodeTier]:
    """Every memory tier of this user's on this node, judged (module doc; `locks`: the run locks that make a tier
    live, the controller leaving out its own); a folder not this user's alone is listed `refused` with its line
    and nothing in it read."""
    base = tiers_root()
    now = time.time() if now is None else now
    found: list[NodeTier] = []
    if not base.is_dir() or base.is_symlink():
        return found
    for lineage in sorted(base.iterdir()):
        if not lineage.is_dir() or lineage.is_symlink():
            continue
        for root in sorted(lineage.iterdir()):
            if len(root.name) == RUN_DIGEST and all(c in "0123456789abcdef" for c in root.name):
                found.append(judge(root, now, locks))
    return found


def judge(root: Path, now: float, locks: tuple[str, ...] = LOCKS) -> NodeTier:
    """What one tier holds and whether it is live, stale or kept (module doc)."""
    tier = NodeTier(root=str(root), lineage=root.parent.name, run_dir=None)
    problem = root_problem(root, make=False)
    if problem is not None:
        tier.verdict, tier.why = REFUSED, problem
        return tier
    inventories = []
    for info in list_checkpoints(root):
        if info.complete:
            tier.updates.append(info.update)
            inventories.append(info.path)
    for source, folder in held_replicas(root):
        held = [info for info in list_checkpoints(folder) if info.complete]
        tier.replicas[str(source)] = [info.update for info in held]
        inventories += [info.path for info in held]
    tier.run_dir = _bound_run_dir(inventories, root.name)
    tier.bytes, newest = _usage(root)
    tier.age_s = max(0.0, now - newest)
    tier.verdict, tier.why = _verdict(tier, root, locks)
    return tier


def _bound_run_dir(inventories: list[Path], digest: str) -> str | None:
    """The run directory the inventories name whose digest is the folder's (a copied inventory names another)."""
    for ckpt in reversed(inventories):
        try:
            named = read_inventory(ckpt).get("run_dir")
        except (RelayError, OSError):
            continue
        if isinstance(named, str) and named and run_digest(named) == digest:
            return named
    return None


def _usage(root: Path) -> tuple[int, float]:
    """(bytes of the files under `root`, each inode once: an assembled resume hard-links parts; newest mtime)."""
    seen: set[tuple[int, int]] = set()
    total, newest = 0, 0.0
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files, "."]:
            try:
                st = os.lstat(os.path.join(here, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if name in files and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total, newest


def _in_use(root: Path) -> bool:
    """Whether a process holds the tier's folder (`hold`)."""
    try:
        os.close(_take(root, fcntl.LOCK_EX))
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


def _run_lock(tier: NodeTier, locks: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """(role, holder) of the first of the tier's run's `locks` that is held, or None."""
    if tier.run_dir is None:
        return None
    for role in locks:
        who = holder(tier.run_dir, role)
        if who is not None:
            return role, who
    return None


def _verdict(tier: NodeTier, root: Path, locks: tuple[str, ...]) -> tuple[str, str]:
    if _in_use(root):
        return LIVE, f"a process on {socket.gethostname()} uses it"
    locked = _run_lock(tier, locks)
    if locked is not None:
        return LIVE, f"the run's {locked[0]} lock is held by {describe(locked[1], command=False)}"
    held = tier.updates + [u for ups in tier.replicas.values() for u in ups]
    if not held:
        return STALE, "it holds no complete memory checkpoint"
    if tier.run_dir is None:
        return STALE, "no inventory in it names a run directory of this folder: no resume takes it"
    run = RunDir(tier.run_dir)
    tier.run_exists = run.contract_path.is_file()
    if not tier.run_exists:
        return STALE, "its run directory is gone or holds no run"
    durable = [c.update for c in list_checkpoints(run) if c.complete]
    tier.durable_update = durable[-1] if durable else None
    with contextlib.suppress(RelayError, OSError):
        history = read_history(run)
        tier.finished = bool(history) and history[-1].get("ended") == "finished"
    if tier.finished:
        return STALE, "its run finished"
    if tier.durable_update is not None and tier.durable_update >= max(held):
        return STALE, f"the durable checkpoint-{tier.durable_update} is at least as new as every update held"
    return KEPT, f"update {max(held)} is newer than the durable tier: a relaunch on this node resumes from it"


def forget(tier: NodeTier, locks: tuple[str, ...] = LOCKS) -> int:
    """Free one tier (never a live one: RunBusy) after checking its folders are this user's alone (UnsafeInput
    otherwise, tiers.root_problem's line); the bytes freed. Its lineage's folder goes too once empty."""
    root = Path(tier.root)
    problem = root_problem(root, make=False)
    if problem is not None:
        raise UnsafeInput(problem, hint="free it by hand once you know whose it is")
    try:
        fd = _take(root, fcntl.LOCK_EX)
    except FileNotFoundError:
        return 0
    except BlockingIOError:
        line = f"a process on {socket.gethostname()} uses {root}"
        raise RunBusy(tier.run_dir or root, "train", {}, line) from None
    try:
        locked = _run_lock(tier, locks)
        if locked is not None:
            raise RunBusy(tier.run_dir, locked[0], locked[1], describe(locked[1]))
        size = _usage(root)[0]
        shutil.rmtree(root, ignore_errors=True)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        root.parent.rmdir()  # the lineage's folder, once no run directory of it has a memory tier here
    return size


def of_run(run_dir: str | os.PathLike[str], tiers: list[NodeTier]) -> list[NodeTier]:
    """The tiers of `run_dir` (any lineage) among `tiers`."""
    digest = run_digest(run_dir)
    return [t for t in tiers if Path(t.root).name == digest]


def at_controller_end(run_dir: str | os.PathLike[str]) -> list[str]:
    """What a controller on one node (`torchrelay launch`, holding the run's launch lock), ending, does with its
    run's memory tiers on this node, one line each: a stale one (the run finished, or stopped with its durable
    save, and a rank could not free it) freed; a kept one (newer than the durable tier: a failure it does not
    retry) left for a relaunch here, with the command that frees it."""
    lines, host = [], socket.gethostname()
    for tier in of_run(run_dir, scan(locks=("train",))):
        size = f"{tier.bytes / 1e6:.1f} MB"
        if tier.verdict == STALE:
            try:
                forget(tier, locks=("train",))
            except (RunBusy, UnsafeInput) as exc:
                lines.append(f"memory tier {tier.root} on {host} left: {exc.message}")
                continue
            lines.append(f"memory tier freed on {host} ({size}): {tier.why}")
        elif tier.verdict == KEPT:
            lines.append(f"memory tier left on {host} ({size}): {tier.why}; "
                         f"`torchrelay stop {run_dir} --forget-memory` frees it")  # fmt: skip
    return lines
