"""`pack RUN s3://bucket/prefix`: the bundle written into an object store, committed by its SHA256SUMS object.

A store has no rename, so the order is the commit: the bundle is built in a staging folder beside the run (the
checkpoint's files hardlinked, not copied), every object but SHA256SUMS is uploaded (multipart above 16 MiB, each
part's SHA-256 state recorded as it is read, into `.torchrelay/parts.json`), the source checkpoint is marked
"packing", SHA256SUMS is written last with a conditional put (If-None-Match: a second packer of the prefix is
refused, never interleaved), then the mark becomes "handed-off". A reader ignores a prefix without SHA256SUMS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from torchrelay.checkpoint.handed_off import HANDED, HANDED_OFF, PACKING, read_marker, write_marker
from torchrelay.checkpoint.inventory import read_inventory
from torchrelay.config.relay import stored_config
from torchrelay.errors import ConfigError, ForkRefused, IntegrityError
from torchrelay.handoff.pack import PackOptions, PackResult, _who, _write_bundle, checkpoint_to_pack, recover
from torchrelay.handoff.signing import SIG_NAME, bundle_digest, check_key, sign
from torchrelay.handoff.store_read import PARTS_REL
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import load_contract
from torchrelay.records.history import new_id
from torchrelay.storage.base import ObjectStore, open_store
from torchrelay.storage.transfer import upload_hashed
from torchrelay.storage.url import StoreURL
from torchrelay.util.durable import fsync_dir
from torchrelay.util.hashing import ByteCallback, default_jobs
from torchrelay.util.kill_points import kill_point
from torchrelay.util.sha256_parts import PART_BYTES
from torchrelay.util.sums import SUMS_NAME, SumEntry, format_sums


def pack_to_store(
    run_dir: str | os.PathLike[str] | RunDir,
    url: StoreURL,
    options: PackOptions,
    on_bytes: ByteCallback | None = None,
    store: ObjectStore | None = None,
) -> PackResult:
    """Pack `run_dir`'s checkpoint into the store at `url` (an empty prefix of an existing bucket), then mark that
    checkpoint HANDED_OFF; holds the run's writer lock throughout, as a local pack does."""
    store = store or open_store(url, jobs=store_jobs(options.jobs))
    rd = RunDir.of(run_dir)  # the `pack` verb's, or a program's path
    lock = RunLock(rd.path, "train").acquire()
    try:
        return _pack(rd, url, options, store, on_bytes)
    finally:
        lock.release()


def _pack(
    rd: RunDir, url: StoreURL, options: PackOptions, store: ObjectStore, on_bytes: ByteCallback | None
) -> PackResult:
    started = time.perf_counter()
    if options.sign is not None:
        check_key(options.sign)
    store.check_bucket()  # a missing bucket or refused credentials: said before any work
    contract = load_contract(rd.path)
    cfg = stored_config(rd)
    # a local pack's recovery (no local bundle here: a name that matches none) cleans the run's own temporaries
    notes = recover(rd, rd.path.parent / f".{rd.path.name}.store-pack")
    for stale in rd.path.parent.glob(f"{_staging_prefix(rd)}*"):
        shutil.rmtree(stale, ignore_errors=True)
        notes.append(f"removed {stale}, left by an interrupted pack into a store")
    notes += _recover_store_pack(rd, url, store)
    ckpt = checkpoint_to_pack(rd, options.checkpoint)
    inventory = read_inventory(ckpt)
    update = int(inventory["update"])
    if store.list_objects(url.key("") if url.prefix else ""):
        raise ConfigError(
            f"{url} already holds objects",
            hint="choose a new prefix (a bundle is written once, never over another)",
        )

    lineage = new_id()
    staging = rd.path.parent / f"{_staging_prefix(rd)}{lineage}"
    staging.mkdir()
    try:
        # the checkpoint's files are hardlinked into the staging folder (copied only across file systems)
        result, entries = _write_bundle(
            rd, cfg, contract, ckpt, inventory, staging, lineage, replace(options, link=True), on_bytes=None
        )
        sums = format_sums(entries).encode()
        result.digest = bundle_digest(sums)
        if options.sign is not None:
            (staging / SIG_NAME).write_bytes(sign(sums, options.sign))
            result.signed = True
        marker = {
            "format": 1,
            "state": PACKING,
            "lineage": lineage,
            "bundle": str(url),
            "digest": result.digest,
            "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "by": _who(),
            "update": update,
        }
        # The record before the first object: a pack killed during its upload leaves a record naming the prefix,
        # which the next pack into it rolls back (_recover_store_pack); no object is ever left that nothing names.
        write_marker(ckpt, marker, step="pack:marking")
        kill_point("pack:marked")
        try:
            upload_files(store, url, staging, entries, jobs=store_jobs(options.jobs), on_bytes=on_bytes)
            kill_point("pack:uploaded")
            committed = store.put_if_absent(url.key(SUMS_NAME), sums)
        except Exception:
            _roll_back(store, url, ckpt)  # a failure, not a kill: nothing of it stays
            raise
        if not committed:
            raise ForkRefused(
                f"{url.child(SUMS_NAME)} was written by another pack meanwhile; this one is not committed",
                hint=f"remove {ckpt / HANDED_OFF} only if that other bundle is not this run's; pack again elsewhere",
            )
        kill_point("pack:summed")
        write_marker(ckpt, {**marker, "state": HANDED}, step="pack:finishing")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result.linked = 0  # hardlinked into the staging folder only
    result.notes = notes  # result.bundle: the staging folder, removed (the bundle is `url`)
    result.seconds = time.perf_counter() - started
    return result


def store_jobs(jobs: int | None) -> int:
    """Requests in flight: a store's latency, not the cores, bounds a transfer (8 at least)."""
    return jobs or max(8, default_jobs())


def _staging_prefix(run: RunDir) -> str:
    run_dir = run.path
    return f".{run_dir.name}.store-pack-"


def _recover_store_pack(rd: RunDir, url: StoreURL, store: ObjectStore) -> list[str]:
    """A "packing" record of this run naming `url`: finished (the store has its SHA256SUMS, same digest) or rolled
    back (the prefix's objects deleted, the record removed), so that packing again into `url` just works."""
    from torchrelay.checkpoint.select import list_checkpoints

    notes = []
    for ck in list_checkpoints(rd.path):
        record = read_marker(ck.path)
        if not record or record.get("state") != PACKING or record.get("bundle") != str(url):
            continue
        raw = store.get(url.key(SUMS_NAME), 1 << 30)
        if raw is not None and bundle_digest(raw) == record.get("digest"):
            write_marker(ck.path, {**record, "state": HANDED}, step="pack:finishing")
            notes.append(f"{ck.path.name}: the pack into {url} had finished but for its record; recorded")
            continue
        if raw is not None:
            continue  # another bundle committed there: nothing proves this record's pack unusable
        _roll_back(store, url, ck.path)
        notes.append(f"{ck.path.name}: rolled back an interrupted pack into {url} (it never got {SUMS_NAME})")
    return notes


def _roll_back(store: ObjectStore, url: StoreURL, ckpt: Path) -> None:
    """Delete an uncommitted pack's objects, then its record (a kill between leaves a record naming an empty
    prefix, rolled back again by the next pack)."""
    with contextlib.suppress(Exception):  # best effort after a failure; the next pack into `url` finishes it
        store.delete([o.key for o in store.list_objects(url.key("") if url.prefix else "")])
        (ckpt / HANDED_OFF).unlink(missing_ok=True)
        fsync_dir(ckpt)


def upload_files(
    store: ObjectStore,
    url: StoreURL,
    staging: Path,
    entries: list[SumEntry],
    *,
    jobs: int,
    on_bytes: ByteCallback | None,
) -> None:
    """Every file of the staged bundle but SHA256SUMS, each hashed as it is read (its SHA-256 held against
    SHA256SUMS's entry: a file changed since it was summed is refused), then the parts object."""
    files: dict[str, dict[str, object]] = {}

    def one(rel: str, digest: str | None) -> None:
        size, sha, states = upload_hashed(store, url.key(rel), staging / rel, on_bytes=on_bytes)
        if digest is not None and sha != digest.lower():
            raise IntegrityError(
                f"{staging / rel}: changed while the bundle was uploaded (its SHA-256 is no longer SHA256SUMS's)",
                hint="nothing was committed; pack again into a new prefix",
            )
        entry: dict[str, object] = {"size": size, "sha256": sha}
        if states is not None:
            entry["parts"] = {"bytes": PART_BYTES, "states": states}
        files[rel] = entry

    todo: list[tuple[str, str | None]] = [(e.path, e.sha256) for e in entries]
    if (staging / SIG_NAME).is_file():
        todo.append((SIG_NAME, None))
    big = [t for t in todo if (staging / t[0]).stat().st_size > PART_BYTES]
    small = [t for t in todo if t not in big]
    for rel, digest in big:  # one at a time: each uploads `jobs` parts at once
        one(rel, digest)
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="store-pack") as pool:
        for fu in [pool.submit(one, rel, digest) for rel, digest in small]:
            fu.result()
    doc = {"format": 1, "files": dict(sorted(files.items()))}
    store.put(url.key(PARTS_REL), (json.dumps(doc, sort_keys=True) + "\n").encode())
