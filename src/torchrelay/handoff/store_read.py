"""A bundle in an object store, read without a local copy: every object fetched in 16 MiB ranged GETs, each part
checked against its recorded SHA-256 state as it arrives (util/sha256_parts.py), the chain ending in SHA256SUMS's
digest; `dest` given, each checked part is written there at once (prepare's verified download).

A bundle in a store is committed by its SHA256SUMS object, written last (handoff/store_pack.py): without it the
prefix is an incomplete upload and nothing of it is used."""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import INVENTORY, beside_inventory, read_inventory
from torchrelay.errors import IntegrityError, RecordError, UnsafeInput
from torchrelay.handoff.signing import SIG_LIMIT, SIG_NAME, bundle_digest, parse_digest, verify_signature
from torchrelay.paths.layout import parse_checkpoint_name
from torchrelay.storage.base import ObjectInfo, ObjectStore
from torchrelay.storage.transfer import read_objects
from torchrelay.storage.url import StoreURL
from torchrelay.util import sha256_parts
from torchrelay.util.hashing import ByteCallback
from torchrelay.util.records import parse_json
from torchrelay.util.sha256_parts import MIN_PART_BYTES, part_count
from torchrelay.util.sums import SUMS_LIMIT, SUMS_NAME, parse_sums

PARTS_REL = (
    ".torchrelay/parts.json"  # each object's SHA-256 states (store_pack.py); a hint, proven by the chain
)
PARTS_LIMIT = 256 << 20
COMMIT_HINT = (
    "the pack into it was interrupted or is still running: wait for it, or pack again into a new prefix "
    "(this one can be deleted)"
)


@dataclass(slots=True)
class StoreReport:
    """What `verify` of a bundle in a store found: one line per problem, the bundle digest, what was read."""

    url: str
    digest: str = ""
    signer: str | None = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def bundle_listing(store: ObjectStore, url: StoreURL) -> dict[str, ObjectInfo]:
    """Every object under the bundle's prefix by bundle-relative path; a key that could escape the bundle (a '..'
    or empty part, a backslash, a control character) refuses the whole bundle."""
    store.check_bucket()
    listed: dict[str, ObjectInfo] = {}
    for obj in store.list_objects(url.key("") if url.prefix else ""):
        rel = url.rel(obj.key)
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\\" in rel or any(ord(c) < 32 for c in rel):
            raise UnsafeInput(
                f"{url}: the object key {obj.key!r} has a '..', '.' or empty part (or a control character); "
                "refusing the bundle",
                hint="a bundle torchrelay packed has no such key: remove that object, or pack again elsewhere",
            )
        listed[rel] = obj
    return listed


def read_store_bundle(
    store: ObjectStore,
    url: StoreURL,
    *,
    jobs: int = 8,
    dest: Path | None = None,
    on_bytes: ByteCallback | None = None,
    expect: str | None = None,
    allowed_signers: Path | None = None,
) -> StoreReport:
    """Check every object of the bundle at `url` against SHA256SUMS (written there last), and every checkpoint
    inventory against them; with `dest`, write each verified part there (a file is whole only if its report is ok).
    `expect` and `allowed_signers` tie SHA256SUMS to the bundle that was packed, checked before any other object."""
    started = time.perf_counter()
    report = StoreReport(url=str(url))
    listed = bundle_listing(store, url)
    if SUMS_NAME not in listed:
        what = "holds no object" if not listed else f"holds {len(listed)} object(s) but no {SUMS_NAME}"
        raise IntegrityError(
            f"{url}: incomplete upload: the prefix {what} (the commit object a pack writes last)",
            hint=COMMIT_HINT,
        )
    raw = store.get(url.key(SUMS_NAME), SUMS_LIMIT) or b""
    report.digest = bundle_digest(raw)
    if expect is not None and report.digest != parse_digest(expect):
        raise IntegrityError(
            f"{url.child(SUMS_NAME)}: the bundle digest is sha256:{report.digest}, not the expected "
            f"sha256:{parse_digest(expect)}",
            hint="this is not the bundle that was packed (or SHA256SUMS was changed); get it again from its packer",
        )
    signature = store.get(url.key(SIG_NAME), SIG_LIMIT) if SIG_NAME in listed else None
    if allowed_signers is not None:
        if signature is None:
            raise IntegrityError(
                f"{url.child(SIG_NAME)}: missing; the bundle is not signed",
                hint="ask its packer for a signed bundle (`torchrelay pack --sign KEY`) or its --expect digest",
            )
        report.signer = verify_signature(raw, signature, allowed_signers, source=url.child(SUMS_NAME))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IntegrityError(
            f"{url.child(SUMS_NAME)}: not UTF-8 text ({exc.reason})", hint="the bundle is damaged"
        ) from None
    entries = parse_sums(text, source=url.child(SUMS_NAME))
    parts_doc = _parts_doc(store, url, listed)
    if dest is not None:
        dest.mkdir(parents=True, exist_ok=True)
        _write(dest / SUMS_NAME, raw)
        if signature is not None:
            _write(dest / SIG_NAME, signature)

    expected = {e.path: e.sha256.lower() for e in entries}
    known: dict[str, tuple[str, int]] = {}
    for rel in sorted(set(listed) - set(expected) - {SUMS_NAME, SIG_NAME, PARTS_REL}):
        report.problems.append(f"{url.child(rel)}: UNEXPECTED (in the store, not listed in {SUMS_NAME})")
    todo = []
    for rel, digest in expected.items():
        if rel not in listed:
            report.problems.append(f"{url.child(rel)}: MISSING (listed in {SUMS_NAME}, not in the store)")
        else:
            todo.append((rel, digest, listed[rel]))
    failed = read_objects(
        store,
        [(rel, d, o, parts_doc.get(rel)) for rel, d, o in todo],
        jobs=jobs,
        dest=dest,
        on_bytes=on_bytes,
    )
    for rel, digest, obj in todo:
        if rel in failed:
            report.problems.append(f"{url.child(rel)}: FAILED ({failed[rel]})")
        else:
            known[rel] = (digest, obj.size)
            report.bytes += obj.size
    _check_inventories(store, url, listed, known, report)
    report.files = len(known)
    report.seconds = time.perf_counter() - started
    return report


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _parts_doc(store: ObjectStore, url: StoreURL, listed: dict[str, ObjectInfo]) -> dict[str, Any]:
    """{rel: (part size, states)} from the parts object, each entry checked for shape; a malformed one is dropped
    (that object is then hashed in order): the states are a hint, the proof is SHA256SUMS's digest."""
    if PARTS_REL not in listed or not sha256_parts.available():
        return {}
    try:
        doc = parse_json(
            store.get(url.key(PARTS_REL), PARTS_LIMIT) or b"{}", source=str(url.child(PARTS_REL))
        )
    except RecordError:
        return {}
    files = doc.get("files") if isinstance(doc, dict) else None
    good: dict[str, Any] = {}
    for rel, entry in (files if isinstance(files, dict) else {}).items():
        parts = entry.get("parts") if isinstance(entry, dict) else None
        step = parts.get("bytes") if isinstance(parts, dict) else None
        states = parts.get("states") if isinstance(parts, dict) else None
        obj = listed.get(rel)
        if (
            obj is None
            or not isinstance(step, int)
            or step < MIN_PART_BYTES
            or step % 64
            or not isinstance(states, list)
            or len(states) != part_count(obj.size, step) - 1
            or not all(isinstance(s, str) and len(s) == 64 for s in states)
        ):
            continue
        good[rel] = (step, states)
    return good


def _check_inventories(
    store: ObjectStore,
    url: StoreURL,
    listed: dict[str, ObjectInfo],
    known: dict[str, tuple[str, int]],
    report: StoreReport,
) -> None:
    """Each checkpoint-N/COMPLETE.json (read and proven above) against the objects of its checkpoint, by the
    rule a local `verify` applies: every listed file there with its size and SHA-256, nothing else beside."""
    for rel in sorted(r for r in known if r.rsplit("/", 1)[-1] == INVENTORY):
        rel_dir = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if parse_checkpoint_name(rel_dir) is None:
            report.problems.append(f"{url.child(rel)}: an inventory outside a checkpoint-N/")
            continue
        report.checkpoints.append(rel_dir)
        with tempfile.TemporaryDirectory(prefix="relay-inventory-") as tmp:
            raw = store.get(listed[rel].key, SUMS_LIMIT) or b""
            if hashlib.sha256(raw).hexdigest() != known[rel][0]:
                report.problems.append(f"{url.child(rel)}: changed after it was verified")
                continue
            (Path(tmp) / INVENTORY).write_bytes(raw)
            try:
                doc = read_inventory(Path(tmp))
            except UnsafeInput:
                raise
            except IntegrityError as exc:
                report.problems.append(f"{url.child(rel)}: {exc.message}")
                continue
        listed_here = set()
        for item in doc["files"]:
            inner = f"{rel_dir}/{item['path']}"
            listed_here.add(inner)
            if inner not in known:
                report.problems.append(f"{url.child(inner)}: MISSING (listed in {rel})")
            elif known[inner][1] != item["size"]:
                report.problems.append(
                    f"{url.child(inner)}: size {known[inner][1]} != {item['size']} in {rel}"
                )
            elif known[inner][0] != str(item["sha256"]).lower():
                report.problems.append(f"{url.child(inner)}: sha256 differs from {rel}")
        for other in sorted(r for r in listed if r.startswith(rel_dir + "/")):
            if other not in listed_here and not beside_inventory(other[len(rel_dir) + 1 :]):
                report.problems.append(f"{url.child(other)}: UNEXPECTED (not in {rel})")
