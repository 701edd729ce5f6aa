"""The ledger's proof file: what a background prover proved of the exposure logs at a checkpoint, so that a later
`torchrelay ledger` hashes the proven prefix of each log and reads only the tail (docs/FORMATS.md, LEDGER_PROOF.json).

After a checkpoint's commit rank 0 may start a prover (`ProofSpawner`, TORCHRELAY_LEDGER_PROOF_BYTES): a process of
its own at the lowest CPU priority, importing no torch (ledger/prover.py), that proves the logs up to the checkpoint's
update from the newest earlier proof and writes LEDGER_PROOF.json into the checkpoint's directory, atomically. So
retention removes a proof with its checkpoint, and after a resume from an older checkpoint its proof still covers
the logs (a proof is about bytes: the prefix it read, each log's length and SHA-256). A proof exists only for a
prefix in which every update logged exactly the samples the order gives it: what it keeps beyond the hashes is the
set of samples seen so far. Anything else (a damaged prefix) has no proof, and the ledger proves every exposure.

A reader treats the file as hostile bytes: one that is not a regular file, too large, malformed, of another run or
order, of another checkpoint, whose own digest or whose prefixes the logs no longer match, is ignored (`newest`):
the ledger then proves everything, as without it, and says the same.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.config import envvars
from torchrelay.data.order import ORDER_VERSION, GlobalOrder
from torchrelay.errors import RelayError, one_line
from torchrelay.log import logger
from torchrelay.paths.layout import LEDGER_PROOF, parse_checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import rank_logs
from torchrelay.util.durable import atomic_write_bytes
from torchrelay.util.records import read_bounded, read_json_or_none
from torchrelay.util.safepath import open_regular

PROOF_FORMAT = 1
PROOF_KIND = "torchrelay ledger proof"
PROVER_MODULE = "torchrelay.ledger.prover"
# A proof holds a few hundred bytes a log and a bit a sample (compressed): 64 MiB is far past any run's.
_MAX_BYTES = 64 << 20
_HEX64 = frozenset("0123456789abcdef")
_BLOCK = 8 << 20
# Provers of one run wait for each other (an flock on train/): at most this many alive at once, the others skipped.
MAX_PROVERS = 4


@dataclass(frozen=True, slots=True)
class Proof:
    """What a proof file says, checked: every update up to `update` exact; each log's proven prefix as (bytes,
    SHA-256) by file name; the samples seen so far."""

    update: int
    logs: dict[str, tuple[int, str]]
    seen: np.ndarray  # bool, one per manifest sample


def identity(order: GlobalOrder, contract_sha256: str) -> dict[str, Any]:
    """What a proof is valid for: the run's contract and the order's every input."""
    return {
        "contract_sha256": contract_sha256,
        "samples": order.num_samples,
        "seed": order.seed,
        "global_batch": order.global_batch,
        "sampler": order.kind,
        "bucket_size": order.bucket_size,
        "order_version": ORDER_VERSION,
    }


def checkpoint_digest(ckpt: Path) -> str:
    """The SHA-256 of a checkpoint's COMPLETE.json: a proof names the one checkpoint it was written into."""
    return hashlib.sha256(read_bounded(ckpt / INVENTORY, _MAX_BYTES, what=INVENTORY, root=ckpt)).hexdigest()


def write_proof(
    ckpt: Path, ident: dict[str, Any], update: int, logs: dict[str, tuple[int, str]], seen: np.ndarray
) -> Path:
    """Write LEDGER_PROOF.json into `ckpt` (temporary, fsync, rename, fsync of the folder)."""
    body = {
        "format": PROOF_FORMAT,
        "kind": PROOF_KIND,
        "update": update,
        "checkpoint_sha256": checkpoint_digest(ckpt),
        "order": ident,
        "logs": {name: {"bytes": n, "sha256": sha} for name, (n, sha) in sorted(logs.items())},
        "seen": {
            "count": int(np.count_nonzero(seen)),
            "bits": base64.b64encode(zlib.compress(np.packbits(seen).tobytes(), 6)).decode(),
        },
    }
    doc = {**body, "sha256": _digest(body)}
    path = ckpt / LEDGER_PROOF
    atomic_write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return path


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_proof(ckpt: Path, ident: dict[str, Any], logs: dict[str, Path]) -> Proof | None:
    """The proof in `ckpt`, if it is one written there for this run and order over logs that exist; else None
    (never an exception: the file is hostile bytes). Its prefixes are not hashed here (`newest` does)."""
    update = parse_checkpoint_name(ckpt.name)
    try:
        if update is None or ckpt.is_symlink():
            return None
        doc = read_json_or_none(ckpt / LEDGER_PROOF, what=LEDGER_PROOF, root=ckpt, limit=_MAX_BYTES)
        if not isinstance(doc, dict) or set(doc) != {
            "format", "kind", "update", "checkpoint_sha256", "order", "logs", "seen", "sha256",
        }:  # fmt: skip
            return None
        body = {k: v for k, v in doc.items() if k != "sha256"}
        if doc["sha256"] != _digest(body) or doc["format"] != PROOF_FORMAT or doc["kind"] != PROOF_KIND:
            return None
        if not _is_int(doc["update"]) or doc["update"] != update or doc["order"] != ident:
            return None
        if doc["checkpoint_sha256"] != checkpoint_digest(ckpt):
            return None
        proven = _logs(doc["logs"], logs)
        seen = _seen(doc["seen"], ident["samples"])
    except (OSError, ValueError, RelayError, RecursionError, zlib.error):
        return None
    if proven is None or seen is None:
        return None
    return Proof(update, proven, seen)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _logs(entries: Any, logs: dict[str, Path]) -> dict[str, tuple[int, str]] | None:
    if not isinstance(entries, dict):
        return None
    out = {}
    for name, entry in entries.items():
        if name not in logs or not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            return None  # a log the run no longer has, or no log of its at all
        if not _is_int(entry["bytes"]) or not _is_sha(entry["sha256"]):
            return None
        out[name] = (entry["bytes"], entry["sha256"])
    return out


def _seen(entry: Any, samples: int) -> np.ndarray | None:
    if not isinstance(entry, dict) or set(entry) != {"count", "bits"} or not _is_int(entry["count"]):
        return None
    if not isinstance(entry["bits"], str):
        return None
    packed_len = (samples + 7) // 8
    inflate = zlib.decompressobj()
    packed = inflate.decompress(base64.b64decode(entry["bits"], validate=True), packed_len + 1)
    if len(packed) != packed_len or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        return None
    seen = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=samples).astype(bool)
    if int(np.count_nonzero(seen)) != entry["count"] or (packed_len and np.packbits(seen)[-1] != packed[-1]):
        return None  # the count, and the padding bits past the last sample zero: one way to write each set
    return seen


def prefix_digests(path: Path, offsets: set[int]) -> dict[int, str]:
    """{offset: SHA-256 of the file's first `offset` bytes} for each offset the file reaches, in one pass."""
    out: dict[int, str] = {}
    want = sorted(offsets)
    if not want:
        return out
    h = hashlib.sha256()
    pos = 0
    fd, _ = open_regular(path, what=path.name)
    with os.fdopen(fd, "rb", buffering=0) as f:
        for offset in want:
            while pos < offset:
                block = f.read(min(_BLOCK, offset - pos))
                if not block:
                    return out
                h.update(block)
                pos += len(block)
            out[offset] = h.copy().hexdigest()
    return out


def read_prefix(path: Path, begin: int, end: int) -> tuple[str, str, bytes] | None:
    """(SHA-256 of the first `begin` bytes, of the first `end`, the bytes between), read in one pass; None when
    the file is shorter than `end`."""
    h = hashlib.sha256()
    at_begin = h.hexdigest() if begin == 0 else ""
    kept = []
    pos = 0
    fd, _ = open_regular(path, what=path.name)
    with os.fdopen(fd, "rb", buffering=0) as f:
        while pos < end:
            block = f.read(min(_BLOCK, (begin if pos < begin else end) - pos))
            if not block:
                return None
            h.update(block)
            if pos >= begin:
                kept.append(block)
            pos += len(block)
            if pos == begin:
                at_begin = h.hexdigest()
    return at_begin, h.hexdigest(), b"".join(kept)


def newest(
    run: RunDir, ident: dict[str, Any], logs: dict[str, Path], *, before: int | None = None
) -> Proof | None:
    """The newest proof (of a checkpoint older than `before`, when given) whose every prefix the logs still start
    with; None when there is none. Each log is read once, up to the longest prefix any proof names."""
    proofs = []
    for ckpt in reversed(run.checkpoint_dirs()):
        update = parse_checkpoint_name(ckpt.name)
        if update is None or (before is not None and update >= before):
            continue
        proof = read_proof(ckpt, ident, logs)
        if proof is not None:
            proofs.append(proof)
    if not proofs:
        return None
    try:
        digests = {
            name: prefix_digests(path, {p.logs[name][0] for p in proofs if name in p.logs})
            for name, path in logs.items()
        }
    except (OSError, RelayError):
        return None
    for proof in proofs:  # newest first
        if all(digests[name].get(n) == sha for name, (n, sha) in proof.logs.items()):
            return proof
    return None


def proven_bytes(run: RunDir) -> int:
    """The bytes of log the newest proof file names (0 when there is none): where the spawner counts growth from.
    Not checked: it only decides when the next prover starts."""
    for ckpt in reversed(run.checkpoint_dirs()):
        doc: Any = read_json_or_none(ckpt / LEDGER_PROOF, what=LEDGER_PROOF, root=ckpt, limit=_MAX_BYTES)
        try:
            total: int = sum(int(e["bytes"]) for e in doc["logs"].values())
            return total
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return 0


class ProofSpawner:
    """Rank 0's: after a checkpoint's commit, starts a prover (`python -m torchrelay.ledger.prover RUN UPDATE`) when
    the exposure logs grew by more than TORCHRELAY_LEDGER_PROOF_BYTES since the last one started. Called on the
    thread that committed (the persist thread for an async save): a few stats and at most one process start, which
    never fails the save."""

    def __init__(self, run: RunDir) -> None:
        self._run = run
        self._base: int | None = None  # the logs' bytes when the last prover started (or the newest proof's)
        self._alive: list[subprocess.Popen[bytes]] = []

    def committed(self, update: int) -> None:
        try:
            threshold = envvars.LEDGER_PROOF_BYTES.get()
            if threshold < 0:
                return
            total = sum(p.stat().st_size for p in rank_logs(self._run.train_dir, "exposures").values())
            if total <= threshold:  # a small run: nothing to read, nothing to start
                return
            if self._base is None:
                self._base = proven_bytes(self._run)
            if total - self._base <= threshold:
                return
            self._alive = [p for p in self._alive if p.returncode is None]
            if len(self._alive) >= MAX_PROVERS:
                return
            self._alive.append(spawn(self._run, update))
            self._base = total
        except (OSError, RelayError) as exc:
            logger.warning(f"[torchrelay] no ledger prover for update {update}: {one_line(exc)}")


def spawn(run: RunDir, update: int) -> subprocess.Popen[bytes]:
    """Start the prover of checkpoint-<update>, detached from the caller's output; a thread of the caller reaps it
    when it ends (it may outlive the caller: nothing waits for it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the directory this torchrelay is imported from, on its PYTHONPATH (as the writer process gets it)
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", PROVER_MODULE, str(run.path), str(update)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        env=env,
    )
    threading.Thread(target=proc.wait, name=f"torchrelay-prover-{update}", daemon=True).start()
    return proc
