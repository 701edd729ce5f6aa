"""Objects read from a store and proven as they arrive: 16 MiB ranged GETs, each part checked against its recorded
SHA-256 chaining state (util/sha256_parts.py), the chain ending in the object's SHA-256; used by a bundle's
`verify`/`prepare` (handoff/store_read.py) and a run's durable tier (storage/durable.py)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchrelay.storage.base import ObjectInfo, ObjectStore
from torchrelay.util import sha256_parts
from torchrelay.util.hashing import ByteCallback
from torchrelay.util.sha256_parts import PART_BYTES, part_count


def read_objects(
    store: ObjectStore,
    todo: list[tuple[str, str, ObjectInfo, tuple[int, list[str]] | None]],
    *,
    jobs: int,
    dest: Path | None = None,
    on_bytes: ByteCallback | None = None,
) -> dict[str, str]:
    """Read and check each (rel, SHA-256, listed object, (part size, states) or None): its parts on `jobs` threads,
    with states any part at any time (each checked alone as it arrives), without them its parts in order on one
    thread, hashed whole; with `dest`, each checked part is written into dest/rel at once. Returns {rel: what
    failed} (a file not named there matched whole); a store failure raises (one line, after its retries).
    Every GET carries the listed ETag: an object replaced since the listing is refused (ObjectChanged)."""
    parts_doc = {rel: parts for rel, _, _, parts in todo if parts is not None}
    lock = threading.Lock()
    failed: dict[str, str] = {}
    fds: dict[str, int] = {}
    if dest is not None:
        for rel, _, obj, _ in todo:
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.ftruncate(fd, obj.size)
            fds[rel] = fd

    def arrived(rel: str, offset: int, data: bytes) -> None:
        if rel in fds:
            view = memoryview(data)
            while view:
                n = os.pwrite(fds[rel], view, offset)
                view, offset = view[n:], offset + n
        if on_bytes:
            on_bytes(len(data))

    def part(rel: str, digest: str, obj: ObjectInfo, k: int) -> None:
        step, states = parts_doc[rel]
        want = min(step, obj.size - k * step)
        data = store.get_range(obj.key, k * step, want, etag=obj.etag or None)
        if not sha256_parts.check_part(data, k, step, states, digest):
            with lock:
                failed.setdefault(rel, f"part {k} (bytes {k * step}-{k * step + want - 1}) does not match")
            return
        arrived(rel, k * step, data)

    def whole(rel: str, digest: str, obj: ObjectInfo) -> None:
        h = hashlib.sha256()
        for k in range(part_count(obj.size, PART_BYTES)):
            want = min(PART_BYTES, obj.size - k * PART_BYTES)
            data = store.get_range(obj.key, k * PART_BYTES, want, etag=obj.etag or None) if want else b""
            h.update(data)
            arrived(rel, k * PART_BYTES, data)
        if h.hexdigest() != digest:
            with lock:
                failed[rel] = f"sha256 {h.hexdigest()} != recorded {digest}"

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="store-read") as pool:
            futures = []
            for rel, digest, obj, _ in sorted(todo, key=lambda t: -t[2].size):  # largest first
                if rel in parts_doc:
                    step = parts_doc[rel][0]
                    futures += [
                        pool.submit(part, rel, digest, obj, k) for k in range(part_count(obj.size, step))
                    ]
                else:
                    futures.append(pool.submit(whole, rel, digest, obj))
            for fu in futures:
                fu.result()  # a store failure (one line, after its retries) ends the read
    finally:
        for fd in fds.values():
            os.close(fd)
    return failed


def read_range_verified(
    store: ObjectStore,
    obj: ObjectInfo,
    digest: str,
    parts: tuple[int, list[str]] | None,
    offset: int,
    length: int,
) -> bytes | None:
    """`length` bytes at `offset` of a listed object (fewer at its end), proven first: the whole recorded parts
    that hold the range are read and each checked against its SHA-256 state (without states: the whole object
    against its SHA-256). None when a part does not match; a store failure raises (one line)."""
    end = min(obj.size, offset + max(0, length))
    if offset < 0 or end <= offset:
        return b""
    step = parts[0] if parts is not None else max(obj.size, 1)
    first, last = offset // step, (end - 1) // step
    chunks = []
    for k in range(first, last + 1):
        want = min(step, obj.size - k * step)
        data = store.get_range(obj.key, k * step, want, etag=obj.etag or None)
        if parts is not None:
            if not sha256_parts.check_part(data, k, step, parts[1], digest):
                return None
        elif hashlib.sha256(data).hexdigest() != digest:
            return None
        chunks.append(data)
    joined = b"".join(chunks)
    return joined[offset - first * step : end - first * step]


def upload_hashed(
    store: ObjectStore, key: str, path: Path, *, on_bytes: ByteCallback | None = None
) -> tuple[int, str, list[str] | None]:
    """Upload one file (multipart in PART_BYTES parts above one), hashing each part as it is read: (size,
    SHA-256, the states at each part boundary, None where libcrypto's are not usable)."""
    hasher = sha256_parts.PartHasher(PART_BYTES)

    def on_part(data: bytes) -> None:
        hasher.update(data)
        if on_bytes:
            on_bytes(len(data))

    size = store.upload_file(key, path, part_bytes=PART_BYTES, on_part=on_part)
    return size, hasher.hexdigest(), hasher.states
