"""The ledger's background prover: `python -m torchrelay.ledger.prover RUN_DIR UPDATE`, started by rank 0 after
checkpoint-UPDATE's commit (ledger_proof.ProofSpawner). It proves the exposure logs up to UPDATE from the newest
earlier proof and writes checkpoint-UPDATE/LEDGER_PROOF.json (ledger/proof.py says what it holds and why).

It runs at the lowest CPU priority (nice 19, in the training job's own scheduling group: it takes what the ranks
leave) and imports no torch. Every rank made its logs durable up to UPDATE before the checkpoint was committed
(run/saver.py), so the prefix it reads is on disk; lines a rank logged since lie past the cut it reads to. Provers of
one run take turns (an flock on train/): each starts from its predecessor's proof. It writes nothing unless the whole
prefix is exact, and it writes atomically: killed anywhere, it leaves no proof (at most a temporary that
checkpoints tolerate), and the ledger proves what it would have.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.errors import CheckpointError, RelayError, one_line
from torchrelay.ledger import proof as ledger_proof
from torchrelay.ledger.exposure import order_and_contract, prove_prefix
from torchrelay.paths.rundir import RunDir
from torchrelay.records.exposure_read import Exposures, end_of_update, parse_exposure_lines
from torchrelay.records.train import rank_logs
from torchrelay.util.kill_points import kill_point

LOWEST_PRIORITY = 19


def prove_checkpoint(run: RunDir, update: int) -> Path | None:
    """Write checkpoint-<update>/LEDGER_PROOF.json if every update up to `update` logged exactly its samples;
    return its path, or None (nothing written) when the prefix is not exact or cannot be read the fast way. A
    checkpoint that is not there (any more) is a CheckpointError."""
    ckpt = run.checkpoint(update)
    if not (ckpt / INVENTORY).is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (removed by retention?)")
    order, manifest, contract_sha = order_and_contract(run, bound=False)  # (checked when the run opened)
    ident = ledger_proof.identity(order, contract_sha)
    paths = rank_logs(run.train_dir, "exposures")
    by_name = {path.name: path for path in paths.values()}
    cuts = {path.name: end_of_update(path, update) for path in paths.values()}
    start = ledger_proof.newest(run, ident, by_name, before=update)
    regions: dict[int, Exposures] = {}
    proven: dict[str, tuple[int, str]] = {}
    for rank, path in paths.items():
        known = start.logs.get(path.name) if start is not None else None
        begin, end = (known[0] if known else 0), cuts[path.name]
        read = ledger_proof.read_prefix(path, begin, end) if begin <= end else None
        if read is None or (known is not None and read[0] != known[1]):
            return None  # the log changed since the proof was checked (a resume trimmed it)
        got = parse_exposure_lines(read[2])
        if got is None:
            return None
        regions[rank] = got
        proven[path.name] = (end, read[1])
    seen = prove_prefix(order, manifest, update, regions, start)
    if seen is None:
        return None
    kill_point(
        "ledger-prover:proven"
    )  # a crash test's: killed with the proof made, before a byte of it is written
    return ledger_proof.write_proof(ckpt, ident, update, proven, seen)


def _take_turn(train: Path) -> int:
    """Wait for the provers of this run started before this one (an flock on the train/ folder: no file of its
    own); the lock goes with the process."""
    fd = os.open(train, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: it runs as it is
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST_PRIORITY)
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m torchrelay.ledger.prover RUN_DIR UPDATE", file=sys.stderr)
        return 2
    run, update = RunDir(args[0]), int(args[1])  # the spawner's process: the run directory and the update
    try:
        _take_turn(run.train_dir)
        written = prove_checkpoint(run, update)
    except (
        OSError,
        RelayError,
        ValueError,
    ) as exc:  # a removed checkpoint, a damaged run: no proof, one line
        print(f"torchrelay ledger prover: no proof of update {update}: {one_line(exc)}", file=sys.stderr)
        return 1
    if written is None:
        print(
            f"torchrelay ledger prover: update {update}: the prefix is not exact; no proof", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
