"""`torchrelay certify RUN [--checkpoint N] [--updates K] -- LAUNCH…`: replay K updates from a checkpoint and compare
the parameters' digests after each with those the training recorded (records/digests.py).

A checkpoint's inventory proves its bytes are the bytes that were written, not that they are the state the
training held: a fault while staging (a host buffer copied wrong, memory corrupted before the hashing) leaves a
checkpoint that verifies and resumes another run. A replay of the updates that followed it, from a copy of the
run holding only that checkpoint, must reproduce the training's own per-update digests bit for bit (within the
numerics identity the run recorded; docs/NUMERICS.md). The result is written beside the checkpoint, in
`certified/checkpoint-N.json`; the checkpoint itself is never touched (the replay runs on a copy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.audit.runner import AuditError, Launcher, fresh_run, run_segments, subprocess_launcher
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.errors import ConfigError, StateMismatch
from torchrelay.identity import numerics
from torchrelay.paths.layout import CONTRACT_FILE, LOCK_FILES, checkpoint_name, parse_checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import load_contract
from torchrelay.records.digests import read_digests
from torchrelay.records.history import read_history

CERTIFIED_DIR = "certified"  # beside the checkpoints: one record per certified checkpoint
CERTIFICATE_FORMAT = 1
# What a replay's copy of the run leaves out: other checkpoints (the copy must resume from the one certified),
# the locks of a run that may be training, a stop request, records of other tools.
_NOT_COPIED = {CERTIFIED_DIR, "attempts", "validation", "REQUEST_STOP", *LOCK_FILES}


@dataclass(kw_only=True, slots=True)
class Certificate:
    """A replay's answer: whether the K updates after checkpoint N reproduced the recorded digests."""

    checkpoint: int
    updates: int  # replayed: N+1 .. N+updates
    certified: bool
    first_differing: int | None = None  # the first replayed update whose digest differs
    ranks: list[int] = field(default_factory=list)  # the ranks it differs on
    compared: int = 0  # (rank, update) digests compared
    launch: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the replay's launch
    numerics_same: bool | None = None  # the replay ran with the numerics identity of the recorded updates
    # the replay's load refused the checkpoint: its parameters, once loaded, are not those its update trained
    loaded_differs: bool = False
    time: float = field(default_factory=time.time)
    format: int = CERTIFICATE_FORMAT

    def line(self) -> str:
        """One line: certified, or the first update the replay parts at."""
        name = checkpoint_name(self.checkpoint)
        if self.certified:
            return (
                f"{name}: certified: {self.updates} update(s) replayed from it reproduce the recorded digests "
                f"bit for bit ({self.compared} compared, {self.seconds:.1f}s)"
            )
        ranks = f"rank(s) {', '.join(map(str, self.ranks))}"
        if self.loaded_differs:
            return (
                f"{name}: NOT certified: its parameters, once loaded, are not those update {self.checkpoint} trained "
                "(the replay's load refused it)"
            )
        where = f"update {self.first_differing} ({ranks})"
        other = "; the replay ran with another numerics identity" if self.numerics_same is False else ""
        return f"{name}: NOT certified: the replay parts from the training at {where}{other}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def certificate_path(run: RunDir, update: int) -> Path:
    return run.path / CERTIFIED_DIR / f"{checkpoint_name(update)}.json"


def read_certificate(run_dir: str | os.PathLike[str] | RunDir, update: int) -> dict[str, Any] | None:
    """The recorded certificate of checkpoint `update`, or None."""
    from torchrelay.util.records import read_json_or_none

    found = read_json_or_none(certificate_path(RunDir.of(run_dir), update), what="a checkpoint's certificate")
    return found if isinstance(found, dict) else None


def _choose(run: RunDir, recorded: dict[int, dict[int, str]], checkpoint: int | None, updates: int) -> int:
    """The checkpoint to certify: the one asked for, else the newest complete one with `updates` recorded after."""
    complete = [c.update for c in list_checkpoints(run) if c.complete]
    return choose(recorded, complete, checkpoint, updates, run.path)


def choose(
    recorded: dict[int, dict[int, str]],
    complete: list[int],
    checkpoint: int | None,
    updates: int,
    where: Path,
) -> int:
    """The checkpoint whose `updates` following updates all have a recorded digest on some rank. Per update, not
    per rank: a rank of an earlier, wider segment (a move 4 -> 2) records nothing after it, and the updates
    before a resume by a torchrelay that records digests (an older run format) have none."""
    have = {u for rows in recorded.values() for u in rows}
    span = f"{min(have)}..{max(have)}" if have else "none"

    def missing(c: int) -> int | None:
        return next((u for u in range(c + 1, c + updates + 1) if u not in have), None)

    if checkpoint is not None:
        if checkpoint not in complete:
            raise AuditError(
                f"{where / checkpoint_name(checkpoint)}: no complete checkpoint there",
                hint=f"choose one of: {', '.join(map(str, complete)) or 'none'}",
            )
        gap = missing(checkpoint)
        if gap is not None:
            raise AuditError(
                f"--checkpoint {checkpoint} --updates {updates}: the run recorded no digest of update {gap} "
                f"(digests of updates {span})",
                hint="certify a checkpoint the run trained past with per-update digests, or fewer updates",
            )
        return checkpoint
    fits = [u for u in complete if missing(u) is None]
    if not fits:
        raise AuditError(
            f"{where}: no complete checkpoint has {updates} recorded update(s) after it (digests of updates {span})",
            hint="certify fewer updates, or train past the checkpoint first",
        )
    return max(fits)


def compare(
    recorded: dict[int, dict[int, str]], replayed: dict[int, dict[int, str]], first: int, last: int
) -> tuple[int | None, list[int], int]:
    """(the first update in first..last whose digest differs, its ranks, digests compared): each update on the
    ranks that recorded it."""
    compared = 0
    for u in range(first, last + 1):
        trained = sorted(r for r in recorded if u in recorded[r])
        ran = sorted(r for r in replayed if u in replayed[r])
        if ran and ran != trained:
            # the replay ran on another world size: its digests are of other shards or none at all
            raise AuditError(
                f"update {u}: the training recorded digests on {len(trained)} rank(s), the replay on {len(ran)}",
                hint=f"launch the replay on {len(trained)} rank(s) (TORCHRELAY_RESHARD=1 when the checkpoint was "
                "saved on another number)",
            )
        ranks = []
        for rank in trained:
            compared += 1
            if recorded[rank][u] != replayed.get(rank, {}).get(u):
                ranks.append(rank)
        if ranks:
            return u, ranks, compared
    return None, [], compared


def _copy_run(run: RunDir, update: int, dest: Path) -> None:
    """A copy of the run that holds checkpoint-`update` as its newest (a copy, never links: a later save may
    write over a retired checkpoint's files)."""
    run_dir = run.path
    dest.mkdir(parents=True)
    for entry in sorted(run_dir.iterdir()):
        found = parse_checkpoint_name(entry.name)
        if entry.name in _NOT_COPIED or (found is not None and found != update) or entry.name.startswith("."):
            continue
        if entry.is_symlink():
            raise AuditError(
                f"{entry}: a link in the run directory", hint="certify a run directory without links"
            )
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, dest / entry.name)


def _numerics_of_update(run: RunDir, update: int) -> dict[str, Any] | None:
    for seg in read_history(run):
        first, last = seg.get("first_update"), seg.get("last_update")
        if isinstance(first, int) and isinstance(last, int) and first <= update <= last:
            found = seg.get("numerics")
            return found if isinstance(found, dict) else None
    return None


def certify(
    run_dir: str | os.PathLike[str] | RunDir,
    launch: list[str],
    *,
    checkpoint: int | None = None,
    updates: int = 1,
    work_dir: Path | None = None,
    timeout_s: float = 600.0,
    launcher: Launcher = subprocess_launcher,
) -> Certificate:
    """Replay `updates` updates from `checkpoint` (default: the newest that has them recorded after it) with the
    launch command, compare the digests, and record the certificate beside the checkpoint."""
    run = RunDir.of(run_dir)
    root = run.path
    if not run.contract_path.is_file():
        raise ConfigError(
            f"{root} is not a run directory (no {CONTRACT_FILE})",
            hint="pass the run directory whose checkpoint to certify",
        )
    load_contract(run)  # a damaged contract: refused, naming the file
    if not launch:
        raise AuditError(
            "no launch command", hint="put it after --, e.g. -- torchrun --nproc_per_node=2 train.py"
        )
    if updates < 1:
        raise AuditError(f"--updates {updates}: replay at least one update")
    recorded = read_digests(run)
    if not any(recorded.values()):
        raise AuditError(
            f"{root / 'train'}: no per-update digests recorded (digests-rank*.jsonl)",
            hint="the run was trained by a torchrelay without them: train on with this version first",
        )
    update = _choose(run, recorded, checkpoint, updates)
    owned = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="torchrelay-certify-")) if work_dir is None else Path(work_dir)
    try:
        replay = fresh_run(work, "replay")
        _copy_run(run, update, replay.path)
        started = time.monotonic()
        try:
            run_segments(
                "certify",
                launch,
                replay,
                work / "logs",
                [update + updates],
                timeout_s=timeout_s,
                launcher=launcher,
                extra_overrides={"keep_updates": [update + updates]},
            )
        except AuditError:
            refused = _refused_at_load(replay)
            if not refused:
                raise
            cert = Certificate(
                checkpoint=update,
                updates=updates,
                certified=False,
                first_differing=update,
                ranks=refused,
                launch=list(launch),
                seconds=time.monotonic() - started,
                loaded_differs=True,
            )
        else:
            seconds = time.monotonic() - started
            replayed = read_digests(replay)
            first, ranks, compared = compare(recorded, replayed, update + 1, update + updates)
            ran, trained = _numerics_of_update(replay, update + 1), _numerics_of_update(run, update + 1)
            same = (
                None
                if ran is None or trained is None
                else numerics.fingerprint(ran) == numerics.fingerprint(trained)
            )
            cert = Certificate(
                checkpoint=update,
                updates=updates,
                certified=first is None,
                first_differing=first,
                ranks=ranks,
                compared=compared,
                launch=list(launch),
                seconds=seconds,
                numerics_same=same,
            )
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    _record(run, cert)
    return cert


def _refused_at_load(replay: RunDir) -> list[int]:
    """The ranks whose load of the replay's checkpoint found parameters other than its update trained (their
    notes in the replay's last segment name StateMismatch: at least the first to raise it), or none."""
    segments = read_history(replay) if replay.history_path.is_file() else []
    notes = segments[-1].get("notes", []) if segments else []
    ranks = set()
    for note in notes:
        head, _, rest = str(note).partition(": ")
        if rest.startswith(f"{StateMismatch.__name__}:") and head.startswith("rank ") and head[5:].isdigit():
            ranks.add(int(head[5:]))
    return sorted(ranks)


def _record(run: RunDir, cert: Certificate) -> None:
    path = certificate_path(run, cert.checkpoint)
    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(cert.to_dict(), handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
