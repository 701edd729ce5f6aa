"""A run's durable tier in an object store (TORCHRELAY_DURABLE=s3://bucket/prefix): every committed checkpoint is
copied there after its local commit, its inventory object (COMPLETE.json) written last, conditionally; a resume
whose run directory lacks the store's newest committed checkpoint downloads it verified first. Every checkpoint
operation goes through the storage seam's object-store backend (storage/checkpoints.py's `ObjectStorage`); what
is decided here is when: which checkpoints to copy, which the store may drop, and who may write the prefix.

- Commit: a checkpoint-N/ prefix without COMPLETE.json is no checkpoint; every reader here ignores it.
- Retention: a checkpoint leaves the store only once a newer one is committed there, and only when the run
  directory no longer keeps it (local retention decides, the store follows); the commit object goes first, so a
  kill mid-deletion leaves an ignored prefix, removed by the next sync.
- One writer: WRITER.json, written with a conditional put, names the run (its lineage); a second run syncing into
  the same prefix is refused, never interleaved. A resume of the same run (same lineage) takes it over.
- Uploads run in a process of their own (`python -m torchrelay.storage.durable RUN_DIR`), started by rank 0 after
  a commit, never on the training thread; closing the run waits for it and syncs once more.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config import envvars
from torchrelay.errors import ForkRefused, RecordError, RelayError, one_line
from torchrelay.log import logger
from torchrelay.paths.rundir import RunDir
from torchrelay.storage.base import ObjectStore, open_store
from torchrelay.storage.checkpoints import ObjectStorage
from torchrelay.storage.url import StoreURL, parse_url
from torchrelay.util.durable import fsync_dir
from torchrelay.util.records import parse_json, read_json_or_none

LEASE = "WRITER.json"
MODULE = "torchrelay.storage.durable"
JOBS = 8  # requests in flight: a store's latency, not the cores, bounds a transfer


def durable_url() -> StoreURL | None:
    """The durable tier this process was given (TORCHRELAY_DURABLE), None without one."""
    text = envvars.DURABLE.get()
    return parse_url(text) if text else None


def _lineage(run: RunDir) -> str:
    doc = read_json_or_none(run.lineage_path, what="lineage.json")
    return str(doc.get("lineage")) if isinstance(doc, dict) else ""


def acquire_lease(store: ObjectStore, url: StoreURL, run: RunDir) -> None:
    """Make this run the prefix's one writer, or refuse: another run's WRITER.json is there."""
    lineage = _lineage(run)
    doc = {"lineage": lineage, "run_dir": str(run.path), "host": socket.gethostname(), "since": time.time()}
    if store.put_if_absent(url.key(LEASE), (json.dumps(doc, sort_keys=True) + "\n").encode()):
        return
    try:
        other = parse_json(store.get(url.key(LEASE), 1 << 20) or b"{}", source=str(url.child(LEASE)))
    except RecordError:
        other = {}
    if isinstance(other, dict) and other.get("lineage") == lineage and lineage:
        return  # this run, resumed: its own lease
    who = other.get("run_dir", "?") if isinstance(other, dict) else "?"
    raise ForkRefused(
        f"{url} is the durable tier of another run ({url.child(LEASE)}: lineage "
        f"{other.get('lineage') if isinstance(other, dict) else '?'}, {who}); a second writer would interleave "
        "its checkpoints",
        hint="give this run its own prefix in TORCHRELAY_DURABLE",
    )


def sync(run: RunDir, url: StoreURL | None = None, store: ObjectStore | None = None) -> list[str]:
    """Upload every complete local checkpoint the store lacks (oldest first), then apply retention there;
    returns what was done, one line each."""
    url = url or durable_url()
    if url is None:
        return []
    store = store or open_store(url, jobs=JOBS)
    store.check_bucket()
    acquire_lease(store, url, run)
    storage = ObjectStorage(store, url, jobs=JOBS)
    stored = {c.update: c for c in storage.list_complete()}
    committed = {u for u, c in stored.items() if c.complete}
    notes = []
    # Leftovers of killed uploads older than the newest commit go first: a sync killed again mid-way still
    # leaves the store no more littered than it found it.
    newest = max(committed, default=None)
    for update in sorted(stored):
        if newest is not None and update < newest and update not in committed:
            storage.delete([update])
            notes.append(f"checkpoint-{update}: an upload that never committed removed from {url}")
    stored = {u: c for u, c in stored.items() if newest is None or u >= newest or u in committed}
    local = list_checkpoints(run)
    for info in local:
        if info.complete and info.update not in committed:
            try:
                storage.publish(info.path, info.update, lambda _: None)  # its COMPLETE.json is there
            except (OSError, RelayError):
                if (info.path / INVENTORY).is_file():
                    raise
                # The run's retention removed it while it was copied (a newer one is committed beside it): its
                # part-copy goes and the next goes on; a sync that stopped here never committed any while a run
                # saved faster than the store took its checkpoints.
                storage.delete([info.update])
                notes.append(f"{info.path.name}: removed by the run's retention while it was copied; skipped")
                continue
            committed.add(info.update)
            notes.append(f"{info.path.name} copied to {url}")
    newest = max(committed, default=None)
    kept = {info.update for info in local}
    for update in sorted(stored):
        if newest is None or update >= newest or (update in committed and update in kept):
            continue
        storage.delete([update])  # its commit object first: a kill after it leaves an ignored prefix
        notes.append(f"checkpoint-{update} removed from {url} (checkpoint-{newest} is committed there)")
    return notes


def restore(run: RunDir, url: StoreURL | None = None, store: ObjectStore | None = None) -> str | None:
    """Download the store's newest committed checkpoint into `run` when it has no complete checkpoint as new:
    each part checked against the inventory's SHA-256 states as it arrives, into a temporary folder renamed into
    place once every file matched (the local commit). Returns what was done, None when nothing was needed."""
    url = url or durable_url()
    if url is None:
        return None
    store = store or open_store(url, jobs=JOBS)
    store.check_bucket()
    storage = ObjectStorage(store, url, jobs=JOBS)
    committed = [c.update for c in storage.list_complete() if c.complete]
    local = [c.update for c in list_checkpoints(run) if c.complete]
    if not committed or max(committed) <= max(local, default=-1):
        return None
    update = max(committed)
    name = f"checkpoint-{update}"
    final = run.checkpoint(update)
    tmp = run.path / f".{name}.restore-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed restore's
    tmp.mkdir()
    try:
        storage.download(update, tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if final.exists():  # an incomplete local copy of the same update: the verified one replaces it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(run.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"{name} restored from {url}, verified part by part"


class DurableSpawner:
    """Rank 0's: after each commit, a sync in a process of its own (one at a time; a commit meanwhile is
    picked up by the next); `close` waits for it and syncs once more in this process."""

    def __init__(self, run: RunDir) -> None:
        self._run = run
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def committed(self, update: int) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return  # the running sync, or the next one, or close(), copies this checkpoint
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            src = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", MODULE, str(self._run.path)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    close_fds=True,
                    env=env,
                )
            except OSError as exc:
                logger.warning(f"[torchrelay] durable tier: no sync after update {update}: {one_line(exc)}")

    def close(self) -> None:
        """Wait for the running sync, then sync once more: the newest checkpoint is in the store when the run ends
        (a failure is a warning: the local checkpoints stand)."""
        with self._lock:
            if self._proc is not None:
                self._proc.wait()
            try:
                for note in sync(self._run):
                    logger.info(f"[torchrelay] durable tier: {note}")
            except (RelayError, OSError) as exc:
                logger.warning(f"[torchrelay] durable tier: the last sync failed: {one_line(exc)}")


def _main(argv: list[str]) -> int:
    try:
        sync(RunDir(argv[0]))  # the spawner's process: its one argument is the run directory
    except (RelayError, OSError):
        return 1  # the next commit's sync, or the run's close, tries again and says why
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
