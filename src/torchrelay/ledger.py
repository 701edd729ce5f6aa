"""The exposure ledger: proof from the per-rank logs that every sample was seen exactly once, in order."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.contract import load_contract
from torchrelay.data.order import GlobalOrder
from torchrelay.logs import rank_logs
from torchrelay.manifest import Manifest
from torchrelay.rundir import RunDir
from torchrelay.util.jsonl import iter_records


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


def order_for(run_dir: Path) -> tuple[GlobalOrder, Manifest]:
    """The run's global order, rebuilt from its stored config and contract."""
    rd = RunDir(run_dir)
    cfg = rd.load_config()
    fields = load_contract(run_dir)["fields"]
    manifest = Manifest.load(rd.manifest_path, cfg.data_root)
    order = GlobalOrder(
        num_samples=len(manifest),
        seed=cfg.seed,
        global_batch=int(fields["global_batch"]),
        kind=cfg.sampler,
        lengths=manifest.lengths() if cfg.sampler == "length_bucketed" else None,
        bucket_size=cfg.bucket_size,
    )
    return order, manifest


def prove(run_dir: str | os.PathLike[str], max_problems: int = 10) -> LedgerReport:
    """Compare what the ranks logged with the global order, update by update."""
    root = Path(run_dir)
    order, manifest = order_for(root)
    per_update: dict[int, list[int]] = {}
    for _rank, path in rank_logs(root / "train", "exposures").items():
        for rec in iter_records(path):
            per_update.setdefault(int(rec["u"]), []).extend(int(i) for i in rec["i"])
    rep = LedgerReport()
    if not per_update:
        rep.remaining_in_epoch = order.updates_per_epoch * order.global_batch
        return rep
    last = max(per_update)
    rep.updates = last
    seen_in_epoch: dict[int, Counter[int]] = {}
    all_ids: set[int] = set()
    for u in range(1, last + 1):
        got = per_update.get(u, [])
        expected = order.global_batch_indices(u - 1).tolist()
        epoch = order.epoch_of(u - 1)
        counter = seen_in_epoch.setdefault(epoch, Counter())
        counter.update(got)
        rep.exposures += len(got)
        all_ids.update(got)
        if not got:
            rep.prefix_ok = False
            rep.skipped += len(expected)
            _note(rep, f"update {u}: no exposures logged (expected {len(expected)})", max_problems)
            continue
        if sorted(got) != sorted(expected):
            rep.prefix_ok = False
            missing = Counter(expected) - Counter(got)
            extra = Counter(got) - Counter(expected)
            rep.skipped += sum(missing.values())
            shown = [manifest.records[i]["id"] for i in list(extra)[:3]]
            _note(
                rep,
                f"update {u}: {sum(missing.values())} expected sample(s) missing, "
                f"{sum(extra.values())} unexpected (e.g. {shown})",
                max_problems,
            )
    for epoch, counter in seen_in_epoch.items():
        dups = sum(c - 1 for c in counter.values() if c > 1)
        if dups:
            rep.repeats += dups
            ids = [manifest.records[i]["id"] for i, c in counter.items() if c > 1][:3]
            _note(rep, f"epoch {epoch}: {dups} repeated exposure(s), e.g. {ids}", max_problems)
    rep.distinct = len(all_ids)
    rep.epoch = order.epoch_of(last - 1)
    done_in_epoch = last - rep.epoch * order.updates_per_epoch
    rep.remaining_in_epoch = (order.updates_per_epoch - done_in_epoch) * order.global_batch
    rep.epoch_fraction = last / order.updates_per_epoch
    return rep


def _note(rep: LedgerReport, text: str, limit: int) -> None:
    if len(rep.problems) < limit:
        rep.problems.append(text)
