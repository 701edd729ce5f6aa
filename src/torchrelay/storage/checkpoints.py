"""Checkpoints in an object store: the store's backend of the storage seam (checkpoint/storage.py's
`CheckpointStore`), used by a run's durable tier (storage/durable.py).

A store has no rename, so a checkpoint is published from a folder already complete on a local disk: every file its
inventory lists is uploaded (each held against its entry as it is read), then COMPLETE.json last, by a conditional
put. `checkpoint-N/` without COMPLETE.json is no checkpoint: `list_complete` says it is incomplete, nothing reads
it. `delete` removes the marker first, so a kill mid-deletion leaves an ignored prefix. Every read is a ranged GET
pinned to the listed ETag and proven against the inventory's SHA-256 states before its bytes are returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import INVENTORY, check_inventory, part_states, read_inventory
from torchrelay.checkpoint.select import CheckpointInfo
from torchrelay.checkpoint.storage import CheckpointStore
from torchrelay.errors import ForkRefused, IntegrityError, UnsafeInput
from torchrelay.paths.layout import checkpoint_name, parse_checkpoint_name
from torchrelay.storage.base import ObjectInfo, ObjectStore
from torchrelay.storage.transfer import read_objects, read_range_verified, upload_hashed
from torchrelay.storage.url import StoreURL
from torchrelay.util.records import parse_json

MARKER_LIMIT = 1 << 30  # the largest COMPLETE.json read back


class ObjectStorage(CheckpointStore):  # named, so that the type checker holds it to the seam
    """The checkpoints under one store prefix (`url`), as `checkpoint-N/` objects beside the prefix's others."""

    def __init__(self, store: ObjectStore, url: StoreURL, *, jobs: int = 8) -> None:
        self.store = store
        self.url = url
        self.jobs = jobs
        self._listed: dict[int, dict[str, ObjectInfo]] = {}  # the last listing, for reads of its checkpoints

    # -- what only a store has -----------------------------------------------------------------------------------
    def objects(self) -> dict[int, dict[str, ObjectInfo]]:
        """The prefix's checkpoint-N/ objects: {N: {path inside the checkpoint: object}}; a key that could escape
        its folder refuses the whole prefix."""
        found: dict[int, dict[str, ObjectInfo]] = {}
        for obj in self.store.list_objects(self.url.key("") if self.url.prefix else ""):
            rel = self.url.rel(obj.key)
            head, _, inner = rel.partition("/")
            update = parse_checkpoint_name(head)
            if update is None or not inner:
                continue  # WRITER.json and anything not a checkpoint's
            if any(p in ("", ".", "..") for p in inner.split("/")) or "\\" in inner:
                raise UnsafeInput(
                    f"{self.url}: the object key {obj.key!r} has a '..', '.' or empty part; refusing the durable tier",
                    hint="remove that object; torchrelay writes no such key",
                )
            found.setdefault(update, {})[inner] = obj
        self._listed = found
        return found

    def download(self, update: int, dest: Path) -> None:
        """Read published checkpoint `update` into the empty local folder `dest`: its COMPLETE.json, then every
        file it lists, each part checked against its SHA-256 state as it arrives (IntegrityError: not all matched;
        `dest` then holds no usable checkpoint)."""
        name = checkpoint_name(update)
        objs = self._objects_of(update)
        raw = self.store.get(self.url.key(f"{name}/{INVENTORY}"), MARKER_LIMIT) or b""
        (dest / INVENTORY).write_bytes(raw)
        doc = read_inventory(dest)
        if doc.get("update") != update:
            raise IntegrityError(
                f"{self.url.child(name + '/' + INVENTORY)}: names update {doc.get('update')}, not {update}"
            )
        todo = []
        for entry in doc["files"]:
            obj = objs.get(entry["path"])
            if obj is None or obj.size != entry["size"]:
                raise IntegrityError(
                    f"{self.url.child(name + '/' + entry['path'])}: "
                    + ("missing" if obj is None else f"{obj.size} bytes, {entry['size']} in its inventory")
                    + " in the store",
                    hint="the store's copy is damaged; resume from the local checkpoints, or restore an older one",
                )
            todo.append((entry["path"], str(entry["sha256"]).lower(), obj, part_states(entry)))
        failed = read_objects(self.store, todo, jobs=self.jobs, dest=dest)
        if failed:
            rel, why = sorted(failed.items())[0]
            raise IntegrityError(
                f"{self.url.child(name + '/' + rel)}: {why}; the checkpoint was not restored",
                hint="the store's copy is damaged; resume from the local checkpoints",
            )

    # -- the seam (checkpoint/storage.py's CheckpointStore) -------------------------------------------------------
    def publish(self, staged: Path, update: int, write_marker: Callable[[Path], None]) -> str:
        """`write_marker` writes COMPLETE.json into the local folder `staged` (a folder that already has one, such
        as a committed local checkpoint, passes a no-op); then every file it lists is uploaded and checked against
        its entry as it is read, a killed earlier upload's leftovers removed, and COMPLETE.json put last, only
        where none is (one there with other bytes: another writer's, ForkRefused). Returns the checkpoint's URL."""
        write_marker(staged)
        doc = read_inventory(staged)
        raw = (staged / INVENTORY).read_bytes()
        name = checkpoint_name(update)
        commit = self.url.key(f"{name}/{INVENTORY}")
        self._listed.pop(update, None)
        before = {o.key for o in self.store.list_objects(self.url.key(f"{name}/"))}
        sent: set[str] = set()
        for entry in doc["files"]:
            rel = entry["path"]
            key = self.url.key(f"{name}/{rel}")
            size, sha, _ = upload_hashed(self.store, key, staged / rel)
            if size != entry["size"] or sha != str(entry["sha256"]).lower():
                raise IntegrityError(
                    f"{staged / rel}: does not match {staged / INVENTORY} (read for the durable tier); it was not "
                    "committed",
                    hint="the local checkpoint is damaged; the next checkpoint will be copied",
                )
            sent.add(key)
        self.store.delete(sorted(before - sent - {commit}))
        if not self.store.put_if_absent(commit, raw):
            there = self.store.get(commit, MARKER_LIMIT)
            if there != raw:
                raise ForkRefused(
                    f"{self.url.child(name + '/' + INVENTORY)}: another writer committed a different {name} here",
                    hint="give this run its own prefix in TORCHRELAY_DURABLE",
                )
        return self.url.child(name)

    def list_complete(self) -> list[CheckpointInfo]:
        """Every checkpoint-N/ prefix, oldest first, complete when its COMPLETE.json object is there; `path` is
        the checkpoint's name under the prefix, `size` its objects' bytes."""
        out = []
        for update, objs in sorted(self.objects().items()):
            name = checkpoint_name(update)
            done = INVENTORY in objs
            reason = (
                "" if done else f"{self.url.child(name)}: no {INVENTORY} (an upload that never committed)"
            )
            size = sum(o.size for rel, o in objs.items() if rel != INVENTORY)
            out.append(CheckpointInfo(update, Path(name), done, reason, size))
        return out

    def read_range(self, update: int, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of one file of published checkpoint `update` (fewer at its end), only once
        the recorded parts that hold them match their SHA-256 states (IntegrityError otherwise)."""
        name = checkpoint_name(update)
        doc = self._inventory(update)
        entry = next((e for e in doc["files"] if e["path"] == rel), None)
        obj = self._objects_of(update).get(rel)
        if entry is None or obj is None or obj.size != entry["size"]:
            raise IntegrityError(
                f"{self.url.child(name + '/' + rel)}: "
                + ("not in its inventory" if entry is None else "missing or of another size in the store"),
                hint="read a file its COMPLETE.json lists; the store's copy may be damaged",
            )
        data = read_range_verified(
            self.store, obj, str(entry["sha256"]).lower(), part_states(entry), offset, length
        )
        if data is None:
            raise IntegrityError(
                f"{self.url.child(name + '/' + rel)}: bytes {offset}-{offset + length - 1} do not match the "
                "SHA-256 states in its inventory",
                hint="the store's copy is damaged; read another checkpoint",
            )
        return data

    def delete(self, updates: Sequence[int]) -> None:
        """Remove these checkpoints' objects, each one's COMPLETE.json first (a kill after it leaves a prefix every
        reader ignores, removed by the next sync)."""
        for update in sorted(updates):
            name = checkpoint_name(update)
            keys = [o.key for o in self.store.list_objects(self.url.key(f"{name}/"))]
            commit = self.url.key(f"{name}/{INVENTORY}")
            if commit in keys:
                self.store.delete([commit])
            self.store.delete([k for k in keys if k != commit])
            self._listed.pop(update, None)

    # -- reads of one checkpoint -----------------------------------------------------------------------------------
    def _objects_of(self, update: int) -> dict[str, ObjectInfo]:
        if update not in self._listed:
            name = checkpoint_name(update)
            objs = self.store.list_objects(self.url.key(f"{name}/"))
            self._listed[update] = {self.url.rel(o.key).partition("/")[2]: o for o in objs}
        return self._listed[update]

    def _inventory(self, update: int) -> dict[str, Any]:
        name = checkpoint_name(update)
        where = self.url.child(f"{name}/{INVENTORY}")
        raw = self.store.get(self.url.key(f"{name}/{INVENTORY}"), MARKER_LIMIT)
        if raw is None:
            raise IntegrityError(f"{where} is missing: checkpoint-{update} is not committed in the store")
        doc = check_inventory(parse_json(raw, source=where), where)
        if doc.get("update") != update:
            raise IntegrityError(f"{where}: names update {doc.get('update')}, not {update}")
        return doc
