"""The exposure ledger: proof from the per-rank logs that every sample was seen exactly once, in order.

`prove` reads every exposure (`full=True`), or, by default, starts from the newest checkpoint's LEDGER_PROOF.json
whose prefixes the logs still hold (ledger/proof.py; written after a commit by ledger/prover.py) and reads only the
tail after it. The report is the same either way: a proof exists only for a prefix in which every update is exact,
and a tail that is not exact, or not readable the fast way, sends the ledger back to the whole proof, which words
every problem as it always has."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchrelay.config.relay import stored_config
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import IntegrityError, RelayError
from torchrelay.ledger import proof as ledger_proof
from torchrelay.manifest import Manifest
from torchrelay.paths.lock import holder
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import contract_manifest, load_contract
from torchrelay.records.exposure_read import Exposures, read_exposures, read_exposures_from
from torchrelay.records.train import rank_logs


@dataclass(slots=True)
class LedgerReport:
    updates: int = 0
    exposures: int = 0
    distinct: int = 0
    repeats: int = 0
    skipped: int = 0
    remaining_in_epoch: int = 0
    epoch: int = 0
    epoch_fraction: float = 0.0
    prefix_ok: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.prefix_ok and not self.repeats and not self.skipped

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def order_for(run: RunDir) -> tuple[GlobalOrder, Manifest]:
    """The run's global order, rebuilt from its stored config and contract."""
    order, manifest, _ = order_and_contract(run)
    return order, manifest


def order_and_contract(run: RunDir, *, bound: bool = True) -> tuple[GlobalOrder, Manifest, str]:
    """The run's global order, its manifest and its contract's SHA-256 (what a proof is valid for).

    bound: the manifest must be the one the contract binds (contract.contract_manifest), else IntegrityError naming
    it: the exposures name manifest lines, and a ledger of other lines proves nothing. Not for a run made before
    the contract recorded data.sha256 (not recorded: its resume reads every line, the ledger takes the index as
    before). The background prover of a live training passes False: that launch's rank 0 checked it at the open."""
    run_dir = run.path
    rd = run
    cfg = stored_config(rd)
    contract = load_contract(run_dir)
    fields = contract["fields"]
    index = rd.manifest_index_path
    if not bound or "data.sha256" not in fields:
        manifest = Manifest.load(rd.manifest_path, cfg.data_root, index=index, root=rd.path)
    else:
        manifest = contract_manifest(rd.manifest_path, [cfg.data_root], fields, index=index, root=rd.path)
        if manifest.fingerprint() != fields.get("data.fingerprint"):
            raise IntegrityError(
                f"{rd.manifest_path}: lists other samples than the manifest the run's contract binds "
                f"(data.fingerprint {fields.get('data.fingerprint')}, the file's {manifest.fingerprint()})",
                hint="restore the run's copy of its manifest: the exposures name its lines, and no ledger holds "
                "for another one",
            )
    order = GlobalOrder(
        num_samples=len(manifest),
        seed=cfg.seed,
        global_batch=int(fields["global_batch"]),
        kind=cfg.sampler,
        lengths=manifest.lengths() if cfg.sampler == "length_bucketed" else None,
        bucket_size=cfg.bucket_size,
    )
    return order, manifest, str(contract["sha256"])


@dataclass(slots=True)
class _RankLog:
    """One rank's exposures, ordered by update (file order kept within an update), with each one's update."""

    rank: int
    updates: np.ndarray  # per exposure
    ids: np.ndarray
    last: int | None  # the newest update of a line, with ids or not

    @classmethod
    def read(cls, rank: int, path: Path) -> _RankLog:
        return cls.of(rank, read_exposures(path))

    @classmethod
    def of(cls, rank: int, got: Exposures) -> _RankLog:
        last = int(got.updates.max()) if len(got.updates) else None
        in_order = not len(got.updates) or bool((np.diff(got.updates) >= 0).all())  # a line's, before repeat
        updates, ids = _narrow(got.updates), _narrow(got.ids)  # half the memory: both fit 32 bits
        updates = np.repeat(updates, got.counts)
        del got
        if not in_order:  # written in update order; a copy may not be
            by_update = np.argsort(updates, kind="stable")
            updates, ids = updates[by_update], ids[by_update]
        return cls(rank, updates, ids, last)

    def span(self, first: int, stop: int) -> slice:
        """The exposures of updates first..stop-1."""
        # The bounds in the array's own dtype: numpy would otherwise convert the whole array to compare.
        bounds = np.array([first, stop], dtype=np.int64)
        if self.updates.dtype == np.int32:
            bounds = np.clip(bounds, -(2**31), 2**31 - 1).astype(np.int32)
        return slice(*np.searchsorted(self.updates, bounds).tolist())


def _narrow(values: np.ndarray) -> np.ndarray:
    fits = not len(values) or (values.min() >= -(2**31) and values.max() < 2**31)
    return values.astype(np.int32) if fits else values


def prove(
    run_dir: str | os.PathLike[str] | RunDir, max_problems: int = 10, *, full: bool = False
) -> LedgerReport:
    """Compare what the ranks logged with the global order, update by update.

    Streams: per-sample counters in numpy, one epoch at a time, never a Python object per exposure; 20 M exposures
    take seconds and a few hundred MB. Unless `full`, the newest checkpoint's proof that the logs still match
    (ledger/proof.py) stands for the prefix it covers, and only the tail is read; the report is then the one the
    whole proof gives (any tail that is not clean, or not readable the fast way, is proven in full).
    """
    run = RunDir.of(run_dir)
    order, manifest, contract_sha = order_and_contract(run)
    paths = rank_logs(run.train_dir, "exposures")
    live = holder(run.path, "train") is not None
    if not full:
        rep = _from_proof(run, order, manifest, contract_sha, paths, live)
        if rep is not None:
            return rep
    logs = [_RankLog.read(rank, path) for rank, path in paths.items()]
    return _tally(_settled(logs, live), order, manifest, max_problems)[0]


def _settled(logs: list[_RankLog], live: bool) -> list[_RankLog]:
    """While the run trains (its lock held), each rank appends its lines of an update when it gets to them: the
    updates every rank has gone past (the slowest rank's newest, less one), the newer ones left out. A `ledger`
    run beside a training said LEDGER_FAIL (exit 1: `8 expected sample(s) missing`) for the update one rank had
    logged and the other not yet. A run that is not training is read whole: a missing line there is a gap."""
    if not live or not logs:
        return logs
    upto = min(log.last if log.last is not None else 0 for log in logs) - 1
    out = []
    for log in logs:
        keep = log.span(0, max(upto, 0) + 1)
        last = None if log.last is None or upto < 1 else min(log.last, upto)
        out.append(_RankLog(log.rank, log.updates[keep], log.ids[keep], last))
    return out


def _from_proof(
    run: RunDir,
    order: GlobalOrder,
    manifest: Manifest,
    contract_sha: str,
    paths: dict[int, Path],
    live: bool = False,
) -> LedgerReport | None:
    """The report from the newest matching proof and the logs' tails, when every tail is clean; else None."""
    by_name = {path.name: path for path in paths.values()}
    proof = ledger_proof.newest(run, ledger_proof.identity(order, contract_sha), by_name)
    if proof is None:
        return None
    logs = []
    for rank, path in paths.items():
        start = proof.logs.get(path.name, (0, ""))[0]
        try:
            got = read_exposures_from(path, start)
        except (OSError, RelayError):
            return None
        if got is None or (len(got.updates) and int(got.updates.min()) <= proof.update):
            return None  # a line the fast readers refuse, or one of a proven update after the prefix: damage
        logs.append(_RankLog.of(rank, got))
    rep, _ = _tally(_settled(logs, live), order, manifest, 0, _Start(proof.update, proof.seen))
    return rep if rep.ok else None


def prove_prefix(
    order: GlobalOrder,
    manifest: Manifest,
    update: int,
    regions: dict[int, Exposures],
    start: ledger_proof.Proof | None,
) -> np.ndarray | None:
    """The samples seen by update `update`, if every update up to it logged exactly its samples, given each rank's
    exposures after `start` (a proof, or None: from the first update) up to `update`; else None."""
    first = start.update if start is not None else 0
    logs = []
    for rank, got in regions.items():
        if len(got.updates) and (int(got.updates.min()) <= first or int(got.updates.max()) > update):
            return None
        logs.append(_RankLog.of(rank, got))
    rep, seen = _tally(logs, order, manifest, 0, _Start(start.update, start.seen) if start else None)
    return seen if rep.ok and rep.updates == update else None


@dataclass(slots=True)
class _Start:
    """A proven prefix: every update up to `update` exact, these samples seen."""

    update: int
    seen: np.ndarray


def _tally(
    logs: list[_RankLog],
    order: GlobalOrder,
    manifest: Manifest,
    max_problems: int,
    start: _Start | None = None,
) -> tuple[LedgerReport, np.ndarray]:
    """The report of `logs` (with `start`, the exposures after a proven prefix), and the samples seen."""
    n, batch, per_epoch = order.num_samples, order.global_batch, order.updates_per_epoch
    rep = LedgerReport()
    lasts = [log.last for log in logs if log.last is not None] + ([start.update] if start else [])
    seen = np.zeros(n, dtype=bool) if start is None else start.seen.copy()
    if not lasts:
        rep.remaining_in_epoch = order.updates_per_epoch * order.global_batch
        return rep, seen
    last = max(lasts)
    rep.updates = last
    got = np.zeros(last + 1, dtype=np.int64)  # exposures logged per update
    matched = np.zeros(last + 1, dtype=np.int64)  # distinct expected samples among them
    if start is not None:
        got[1 : start.update + 1] = matched[1 : start.update + 1] = batch
    strays: set[int] = set()  # indices outside the manifest: never expected
    repeats_by_epoch: dict[int, tuple[int, np.ndarray | None, Counter[int]]] = {}
    # Each sample's update within the epoch (-1: not drawn), in 32 bits: compared without a division.
    due = np.empty(n, dtype=np.int32)
    due_in_order = np.repeat(np.arange(per_epoch, dtype=np.int32), batch)
    first_epoch = order.epoch_of(start.update) if start is not None else 0
    for epoch in range(first_epoch, order.epoch_of(last - 1) + 1 if last >= 1 else 0):
        first, stop = epoch * per_epoch + 1, min((epoch + 1) * per_epoch, last) + 1
        parts = [log.span(first, stop) for log in logs]
        if not any(part.stop > part.start for part in parts):
            continue  # nothing logged in this epoch: nothing to count (each update's count says what is missing)
        due.fill(-1)
        due[order.epoch_order(epoch)] = due_in_order
        updates = np.concatenate([log.updates[part] for log, part in zip(logs, parts, strict=True)])
        ids = np.concatenate([log.ids[part] for log, part in zip(logs, parts, strict=True)])
        per_update = np.bincount(updates, minlength=last + 1)
        got += per_update
        inside = (ids >= 0) & (ids < n)
        stray_counts: Counter[int] = Counter()
        if not inside.all():
            stray_counts.update(ids[~inside].tolist())
            updates, ids = updates[inside], ids[inside]
        logged = np.zeros(n, dtype=bool)
        logged[ids] = True
        in_place = due[ids] == updates - first  # logged in the update the order puts it in
        if not stray_counts and np.count_nonzero(logged) == len(ids) and in_place.all():
            # A good epoch: each exposure a distinct sample in its own update, so each one a match. The per-sample
            # counts and matches below are needed only otherwise (0.53 of 1.26 CPU s at LingBot size, RESULTS.md).
            matched += per_update
            seen |= logged
            continue
        counts = np.bincount(ids, minlength=n)
        right = np.zeros(n, dtype=bool)
        right[ids[in_place]] = True
        del updates, ids, inside, logged, in_place
        matched += np.bincount(first + due[right], minlength=last + 1)[: last + 1]
        seen |= counts > 0
        strays.update(stray_counts)
        dups = int(np.maximum(counts - 1, 0).sum()) + sum(c - 1 for c in stray_counts.values() if c > 1)
        if dups:  # the counts are kept for the few epochs a problem will name
            keep = len(repeats_by_epoch) < max_problems
            repeats_by_epoch[epoch] = (dups, counts if keep else None, stray_counts)
    rep.exposures = int(got[1:].sum())
    bad = np.flatnonzero((got[1:] != batch) | (matched[1:] != batch)) + 1
    for u in bad.tolist():
        rep.prefix_ok = False
        if not got[u]:
            rep.skipped += batch
            _note(rep, f"update {u}: no exposures logged (expected {batch})", max_problems)
            continue
        missing, extra = batch - int(matched[u]), int(got[u] - matched[u])
        rep.skipped += missing
        if len(rep.problems) < max_problems:
            shown = _unexpected(logs, order, manifest, u)
            _note(
                rep,
                f"update {u}: {missing} expected sample(s) missing, {extra} unexpected (e.g. {shown})",
                max_problems,
            )
    for epoch, (dups, kept, stray_counts) in repeats_by_epoch.items():
        rep.repeats += dups
        if len(rep.problems) < max_problems and kept is not None:
            names = _repeated(logs, order, manifest, epoch, kept, stray_counts)
            _note(rep, f"epoch {epoch}: {dups} repeated exposure(s), e.g. {names}", max_problems)
    rep.distinct = int(seen.sum()) + len(strays)
    rep.epoch = order.epoch_of(last - 1)
    done_in_epoch = last - rep.epoch * order.updates_per_epoch
    rep.remaining_in_epoch = (order.updates_per_epoch - done_in_epoch) * order.global_batch
    rep.epoch_fraction = last / order.updates_per_epoch
    return rep, seen


def _name(manifest: Manifest, i: int) -> str:
    return manifest.id_of(i) if 0 <= i < len(manifest) else f"#{i} (not in the manifest)"


def _logged(logs: list[_RankLog], first: int, stop: int) -> list[tuple[int, int]]:
    """(update, index) of every exposure of updates first..stop-1 as the ledger reads them: by update, then by
    rank, then in file order."""
    out = []
    for log in logs:
        part = log.span(first, stop)
        out += [
            (int(u), log.rank, k, int(i)) for k, (u, i) in enumerate(zip(log.updates[part], log.ids[part]))
        ]
    return [(u, i) for u, _, _, i in sorted(out)]


def _unexpected(logs: list[_RankLog], order: GlobalOrder, manifest: Manifest, u: int) -> list[str]:
    got = [i for _, i in _logged(logs, u, u + 1)]
    extra = Counter(got) - Counter(order.global_batch_indices(u - 1).tolist())
    return [_name(manifest, i) for i in list(extra)[:3]]


def _repeated(
    logs: list[_RankLog],
    order: GlobalOrder,
    manifest: Manifest,
    epoch: int,
    counts: np.ndarray,
    stray_counts: Counter[int],
) -> list[str]:
    """The first three samples of the epoch logged more than once, in the order they were first logged."""
    per_epoch = order.updates_per_epoch
    first, stop = epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1
    out: list[int] = []
    candidates: list[tuple[int, int, int, int]] = []
    for log in logs:
        part = log.span(first, stop)
        ids = log.ids[part]
        inside = (ids >= 0) & (ids < len(counts))
        twice = np.zeros(len(ids), dtype=bool)
        twice[inside] = counts[ids[inside]] > 1
        twice[~inside] = np.asarray([stray_counts[i] > 1 for i in ids[~inside].tolist()], dtype=bool)
        ids_twice, at = np.unique(ids[twice], return_index=True)
        where = np.flatnonzero(twice)[at]
        updates = log.updates[part][where]
        candidates += zip(updates.tolist(), [log.rank] * len(where), where.tolist(), ids_twice.tolist())
    for _, _, _, i in sorted(candidates):
        if i not in out:
            out.append(i)
        if len(out) == 3:
            break
    return [_name(manifest, i) for i in out]


def _note(rep: LedgerReport, text: str, limit: int) -> None:
    if len(rep.problems) < limit:
        rep.problems.append(text)
