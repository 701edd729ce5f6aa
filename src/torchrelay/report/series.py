"""Read a run directory into the plain series a report draws: metrics, segments, checkpoints, exposures."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.errors import PathError, RelayError
from torchrelay.identity.numerics import describe
from torchrelay.paths.rundir import RunDir
from torchrelay.records.exposure_read import EXPOSURE_SCHEMA
from torchrelay.records.history import read_history
from torchrelay.records.reshard import describe_change
from torchrelay.records.train import METRIC_SCHEMA, is_objective, metric_float, rank_logs
from torchrelay.util.jsonl import iter_records, read_records
from torchrelay.util.safepath import open_regular


class ReportError(RelayError):
    """The run directory cannot be reported on (missing, or nothing logged yet)."""


@dataclass(slots=True)
class Segment:
    """One launch of the run, as history.jsonl records it."""

    index: int
    segment_id: str
    first_update: int
    last_update: int | None
    job: str | None
    hosts: list[str]
    world_size: int | None
    ended: str
    exit_code: int | None
    resumed_from: int | None
    started: float | None = None
    runtime_changes: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    layout_change: str = ""  # reshard.describe_change of the segment's record, or ""
    numerics: str = ""  # numerics.describe of the segment's identity, or "" (not recorded)

    def label(self) -> str:
        """A short label: number, job, hosts, world size and how the segment ended."""
        job = f"job {self.job}" if self.job else "no job"
        hosts = ",".join(self.hosts) if self.hosts else "?"
        if len(hosts) > 28:
            hosts = f"{self.hosts[0]}+{len(self.hosts) - 1}"
        world = f"W={self.world_size}" if self.world_size is not None else "W=?"
        if self.layout_change:
            world += " (layout changed)"
        return f"#{self.index} {job} · {hosts} · {world} · {self.ended}"


@dataclass(slots=True)
class ValidationPoint:
    """One checkpoint's recorded validation: its status and numeric metrics."""

    update: int
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0


@dataclass(slots=True)
class RunSeries:
    """Everything the plots need, per update; missing values are NaN."""

    run: RunDir
    updates: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    # per objective (every logged `loss_<name>`, e.g. loss_g3 and loss_a1), the mean over ranks
    objectives: dict[str, list[float]] = field(default_factory=dict)
    lr: list[float] = field(default_factory=list)
    update_time: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    ranks: int = 0
    segments: list[Segment] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    exposure_updates: list[int] = field(default_factory=list)
    distinct_samples: list[int] = field(default_factory=list)
    total_exposures: list[int] = field(default_factory=list)
    manifest_size: int | None = None
    validation: list[ValidationPoint] = field(default_factory=list)

    def validation_metrics(self) -> list[str]:
        """Names of the numeric metrics any validation recorded, in first-seen order."""
        names: dict[str, None] = {}
        for point in self.validation:
            names.update(dict.fromkeys(point.metrics))
        return list(names)


def _float(value: Any) -> float:
    return metric_float(value)


def _by_update(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    # A later line for the same update wins: it is the one of the segment that went on from it.
    out: dict[int, dict[str, Any]] = {}
    for row in rows:
        if isinstance(row.get("update"), int):
            out[row["update"]] = row
    return out


def _segments(run: RunDir) -> list[Segment]:
    segments = []
    for index, row in enumerate(read_history(run), start=1):
        hosts = row.get("hosts") or []
        segments.append(
            Segment(
                index=index,
                segment_id=str(row.get("segment", index)),
                first_update=int(row.get("first_update") or 1),
                last_update=row.get("last_update") if isinstance(row.get("last_update"), int) else None,
                job=None if row.get("job") is None else str(row["job"]),
                hosts=[str(h) for h in hosts] if isinstance(hosts, list) else [str(hosts)],
                world_size=row.get("world_size") if isinstance(row.get("world_size"), int) else None,
                ended=str(row.get("ended") or "?"),
                exit_code=row.get("exit_code") if isinstance(row.get("exit_code"), int) else None,
                resumed_from=row.get("resumed_from") if isinstance(row.get("resumed_from"), int) else None,
                started=float(row["started"]) if isinstance(row.get("started"), int | float) else None,
                runtime_changes=dict(row.get("runtime_changes") or {}),
                notes=[str(n) for n in row.get("notes") or []],
                layout_change=describe_change(row.get("layout_change")),
                numerics=describe(row["numerics"]) if isinstance(row.get("numerics"), dict) else "",
            )
        )
    return segments


def _exposures(train_dir: Path) -> tuple[list[int], list[int], list[int]]:
    # Cumulative distinct manifest indices and total exposures after each update, over all ranks.
    per_update: dict[int, list[int]] = {}
    for path in rank_logs(train_dir, "exposures").values():
        # checked as the ledger checks them: an update and a list of integers, or one line naming the field
        for row in iter_records(path, schema=EXPOSURE_SCHEMA):
            per_update.setdefault(row["u"], []).extend(row["i"])
    seen: set[int] = set()
    updates, distinct, total = [], [], []
    count = 0
    for update in sorted(per_update):
        seen.update(per_update[update])
        count += len(per_update[update])
        updates.append(update)
        distinct.append(len(seen))
        total.append(count)
    return updates, distinct, total


def _manifest_size(run: RunDir) -> int | None:
    """The manifest's samples (its non-blank lines), counted on its bytes; None without a manifest. Opened as
    every file of a run directory is (no link, no pipe or device, nothing out of the run): a plain open read a
    symlink out of the run and raised a bare UnicodeDecodeError, naming no file, on a byte that was not UTF-8."""
    run_dir = run.path
    path = run.manifest_path
    if not os.path.lexists(path):
        return None
    fd, _ = open_regular(path, what="the data manifest", root=run_dir)
    count, started = 0, False  # started: the line read so far holds a byte that is not blank
    with os.fdopen(fd, "rb") as handle:
        while block := handle.read(1 << 22):
            *whole, rest = block.split(b"\n")
            for line in whole:
                count += started or bool(line.strip())
                started = False
            started = started or bool(rest.strip())
    return count + started


def read_series(run_dir: str | os.PathLike[str] | RunDir) -> RunSeries:
    """Read metrics (loss averaged over ranks, LR and speed from rank 0), segments, checkpoints and exposures."""
    run = RunDir.of(run_dir)
    root = run.path
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise PathError(f"{root} {what}: no run directory there", hint="pass the directory given to Run.open")
    train_dir = run.train_dir
    logs = rank_logs(train_dir, "metrics")
    per_rank = {rank: _by_update(read_records(p, schema=METRIC_SCHEMA)) for rank, p in logs.items()}
    if not per_rank or not any(per_rank.values()):
        raise ReportError(
            f"{train_dir}: no metrics-rank*.jsonl lines yet",
            hint="report on a run that has logged at least one update (step.log)",
        )
    series = RunSeries(run=run, ranks=len(per_rank))
    first_rank = next(iter(per_rank.values()))
    series.updates = sorted(set().union(*(rows.keys() for rows in per_rank.values())))
    names = sorted({k for rows in per_rank.values() for row in rows.values() for k in row if is_objective(k)})
    series.objectives = {name: [] for name in names}
    for update in series.updates:
        for name in names:
            values = [_float(rows[update].get(name)) for rows in per_rank.values() if update in rows]
            kept = [x for x in values if math.isfinite(x)]
            series.objectives[name].append(sum(kept) / len(kept) if kept else math.nan)
        losses = [_float(rows[update].get("loss")) for rows in per_rank.values() if update in rows]
        finite = [x for x in losses if math.isfinite(x)]
        series.loss.append(sum(finite) / len(finite) if finite else math.nan)
        row = first_rank.get(update, {})
        series.lr.append(_float(row.get("lr")))
        # The slowest rank sets the pace of an update.
        times = [_float(rows[update].get("update_time")) for rows in per_rank.values() if update in rows]
        finite_times = [t for t in times if math.isfinite(t)]
        series.update_time.append(max(finite_times) if finite_times else math.nan)
        series.samples_per_s.append(_float(row.get("samples_per_s")))
    series.segments = _segments(run)
    series.checkpoints = [c.update for c in list_checkpoints(run) if c.complete]
    series.exposure_updates, series.distinct_samples, series.total_exposures = _exposures(train_dir)
    series.manifest_size = _manifest_size(run)
    series.validation = _validation(run)
    return series


def _validation(run: RunDir) -> list[ValidationPoint]:
    from torchrelay.records.validation import read_records

    points = []
    for record in read_records(run).values():
        numeric = {
            k: float(v)
            for k, v in (record.metrics or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        points.append(ValidationPoint(record.update, record.status, numeric, record.reason, record.seconds))
    return points
