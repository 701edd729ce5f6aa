"""Compare two run directories that should be equal: final tensors, exposure ledgers and metric logs."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import rank_logs
from torchrelay.util.jsonl import iter_records

# Wall-clock keys differ between any two runs; they say nothing about resumability.
TIMING_KEYS = frozenset({"update_time", "time", "samples_per_s"})

TensorLoader = Callable[[Path], Mapping[str, torch.Tensor]]
ValueLoader = Callable[[Path], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor that differs: its flat name and largest absolute difference (inf when shapes or presence differ)."""

    name: str
    max_abs: float
    note: str = ""


@dataclass(slots=True)
class TensorComparison:
    """The comparison of two checkpoints' tensors, the largest differences first."""

    compared: int = 0
    differing: list[TensorDiff] = field(default_factory=list)
    values_compared: int = (
        0  # besides the tensors: the restored values that are not tensors (audit/values.py)
    )

    @property
    def equal(self) -> bool:
        return not self.differing


@dataclass(slots=True)
class LogComparison:
    """Where two per-rank logs part: the first update, the rank, and the keys that differ there."""

    what: str
    first_update: int | None = None
    rank: int | None = None
    keys: list[str] = field(default_factory=list)
    first_by_key: dict[str, int] = field(default_factory=dict)
    detail: str = ""
    compared_updates: int = 0

    @property
    def equal(self) -> bool:
        return self.first_update is None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_tensor(a: torch.Tensor, b: torch.Tensor, atol: float) -> tuple[bool, float, str]:
    if a.shape != b.shape:
        return False, math.inf, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return False, math.inf, f"dtype {a.dtype} vs {b.dtype}"
    if a.numel() == 0:
        return True, 0.0, ""
    if not (a.is_floating_point() or a.is_complex()):
        diff = float((a.to(torch.int64) - b.to(torch.int64)).abs().max())
        return diff <= atol, diff, ""
    da, db = a.detach().to(torch.float64), b.detach().to(torch.float64)
    both_nan = torch.isnan(da) & torch.isnan(db)
    delta = torch.where(both_nan, torch.zeros_like(da), (da - db).abs())
    delta = torch.nan_to_num(delta, nan=math.inf)
    diff = float(delta.max())
    if atol == 0.0:
        # Bit for bit: equal values with different bits (-0.0 vs 0.0) still count as a difference.
        same = torch.equal(_bytes(a), _bytes(b))
        return same, diff, "" if same or diff else "same values, different bits (signed zero or NaN payload)"
    return diff <= atol, diff, ""


def compare_tensors(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], atol: float = 0.0
) -> TensorComparison:
    """Compare every tensor by name: bit for bit when atol is 0, else within atol (absolute)."""
    result = TensorComparison()
    for name in sorted(set(a) | set(b)):
        result.compared += 1
        if name not in a or name not in b:
            side = "interrupted" if name not in b else "uninterrupted"
            result.differing.append(TensorDiff(name, math.inf, f"missing in the {side} run"))
            continue
        same, diff, note = _same_tensor(a[name], b[name], atol)
        if not same:
            result.differing.append(TensorDiff(name, diff, note))
    result.differing.sort(key=lambda d: (-d.max_abs, d.name))
    return result


def load_checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors (core reader) plus the tensors of registered statefuls, under `state/`.

    What a checkpoint stores per rank (a buffer or a stateful that differed between ranks) is named `…@rank<r>`.
    """
    from torchrelay.checkpoint.reader import flat_tensors, load_statefuls, load_tensors

    with warnings.catch_warnings():
        # DCP warns that no process group is up; reading every shard in one process is exactly the intent.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        tensors = dict(load_tensors(ckpt_dir))
    for name, state in load_statefuls(ckpt_dir).items():
        tensors |= flat_tensors(state, f"state/{name}")
    return tensors


def compare_checkpoints(
    a: Path,
    b: Path,
    atol: float = 0.0,
    loader: TensorLoader | None = None,
    values: ValueLoader | None = None,
) -> TensorComparison:
    """Compare everything two checkpoint directories restore: every tensor, each rank's generators, and every
    other value (numbers, strings, containers of statefuls, the optimizer's param groups, the loop's position;
    audit/values.py).

    A custom tensor `loader` compares only what it loads, unless `values` is given too."""
    from torchrelay.audit.values import align_ranks, load_checkpoint_values, rng_tensors, value_differences

    def everything(ckpt: Path) -> Mapping[str, torch.Tensor]:
        return load_checkpoint_tensors(ckpt) | rng_tensors(ckpt)

    load = loader or everything
    result = compare_tensors(*align_ranks(load(a), load(b)), atol)
    load_values = values or (load_checkpoint_values if loader is None else None)
    if load_values is not None:
        va, vb = align_ranks(load_values(a), load_values(b))
        result.values_compared = len(set(va) | set(vb))
        result.differing += [TensorDiff(k, d, note) for k, d, note in value_differences(va, vb, atol)]
        result.differing.sort(key=lambda d: (-d.max_abs, d.name))
    return result


def _close(x: Any, y: Any, atol: float) -> bool:
    if isinstance(x, bool) or isinstance(y, bool):
        return x == y
    if isinstance(x, int | float) and isinstance(y, int | float):
        if atol == 0.0:
            # JSON floats round-trip exactly, so == on parsed values is bit equality (NaN logged as NaN is equal).
            return x == y or (
                isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
            )
        return abs(x - y) <= atol or (math.isnan(float(x)) and math.isnan(float(y)))
    return bool(x == y)


def _metrics_by_update(path: Path | None, ignore: frozenset[str]) -> dict[int, dict[str, Any]]:
    if path is None:
        return {}
    rows: dict[int, dict[str, Any]] = {}
    skip = TIMING_KEYS | ignore | {"update"}
    for row in iter_records(path):
        if isinstance(row.get("update"), int):
            rows[row["update"]] = {k: v for k, v in row.items() if k not in skip}
    return rows


def _record_first(result: LogComparison, update: int, rank: int, keys: list[str], detail: str) -> None:
    if result.first_update is None or (update, rank) < (result.first_update, result.rank or 0):
        result.first_update, result.rank, result.keys, result.detail = update, rank, keys, detail
    elif update == result.first_update:
        result.keys = sorted(set(result.keys) | set(keys))


def compare_metrics(
    a_dir: RunDir, b_dir: RunDir, atol: float = 0.0, ignore: frozenset[str] = frozenset()
) -> LogComparison:
    """Compare train/metrics-rank*.jsonl line by line, timing and ignored keys left out; note where each key parts."""
    result = LogComparison(what="metrics")
    a_files, b_files = (rank_logs(d.train_dir, "metrics") for d in (a_dir, b_dir))
    for rank in sorted(set(a_files) | set(b_files)):
        a_rows, b_rows = (
            _metrics_by_update(a_files.get(rank), ignore),
            _metrics_by_update(b_files.get(rank), ignore),
        )
        for update in sorted(set(a_rows) | set(b_rows)):
            result.compared_updates = max(result.compared_updates, update)
            if update not in a_rows or update not in b_rows:
                side = "interrupted" if update not in b_rows else "uninterrupted"
                _record_first(
                    result,
                    update,
                    rank,
                    ["<line>"],
                    f"rank {rank} logged no update {update} in the {side} run",
                )
                continue
            ra, rb = a_rows[update], b_rows[update]
            keys = sorted(k for k in set(ra) | set(rb) if not _close(ra.get(k), rb.get(k), atol))
            for key in keys:
                if key not in result.first_by_key or update < result.first_by_key[key]:
                    result.first_by_key[key] = update
            if keys:
                shown = ", ".join(f"{k}: {ra.get(k)!r} vs {rb.get(k)!r}" for k in keys[:3])
                _record_first(result, update, rank, keys, f"rank {rank} update {update}: {shown}")
    return result


def _ledger_by_update(path: Path | None) -> dict[int, list[tuple[int, list[int]]]]:
    if path is None:
        return {}
    rows: dict[int, list[tuple[int, list[int]]]] = {}
    for row in iter_records(path):
        update, micro, indices = row.get("u"), row.get("m"), row.get("i")
        if isinstance(update, int):
            rows.setdefault(update, []).append((int(micro or 0), [int(i) for i in indices or []]))
    return {u: sorted(v) for u, v in rows.items()}


def compare_ledgers(a_dir: RunDir, b_dir: RunDir) -> LogComparison:
    """Compare train/exposures-rank*.jsonl: the same manifest indices in the same micro-steps of the same updates."""
    result = LogComparison(what="ledger")
    a_files, b_files = (rank_logs(d.train_dir, "exposures") for d in (a_dir, b_dir))
    for rank in sorted(set(a_files) | set(b_files)):
        a_rows, b_rows = _ledger_by_update(a_files.get(rank)), _ledger_by_update(b_files.get(rank))
        for update in sorted(set(a_rows) | set(b_rows)):
            result.compared_updates = max(result.compared_updates, update)
            ra, rb = a_rows.get(update), b_rows.get(update)
            if ra == rb:
                continue
            if ra is None or rb is None:
                side = "interrupted" if rb is None else "uninterrupted"
                detail = f"rank {rank} recorded no exposures for update {update} in the {side} run"
            else:
                first_a = ra[0][1][:4] if ra else []
                first_b = rb[0][1][:4] if rb else []
                detail = f"rank {rank} update {update}: samples {first_a}… vs {first_b}…"
            _record_first(result, update, rank, ["i"], detail)
    return result


def compare_own_batches(a_probe: Path, b_probe: Path) -> LogComparison:
    """Compare the digests of batches from the script's own DataLoaders (see probe.py), in drawing order."""
    from torchrelay.audit.probe import read

    result = LogComparison(what="own loaders")
    a_runs, b_runs = read(a_probe), read(b_probe)
    for rank in sorted(set(a_runs) | set(b_runs)):
        ra, rb = a_runs.get(rank, []), b_runs.get(rank, [])
        result.compared_updates = max([result.compared_updates] + [u for u, _ in ra + rb])
        for n in range(max(len(ra), len(rb))):
            if n < len(ra) and n < len(rb) and ra[n] == rb[n]:
                continue
            if n >= len(ra) or n >= len(rb):
                update = (ra[n] if n < len(ra) else rb[n])[0]
                detail = (
                    f"rank {rank}: one run drew {abs(len(ra) - len(rb))} more batch(es) from its own loader"
                )
            else:
                update = min(ra[n][0], rb[n][0])
                detail = f"rank {rank}: own batch {n}, drawn in update {rb[n][0]}, holds other data"
            _record_first(result, update, rank, ["batch"], detail)
            break
    return result


@dataclass(slots=True)
class StreamComparison:
    """The random streams each run held at the start of the updates where the interrupted run resumed."""

    # update -> (streams compared on every rank, the types of streams whose state differs there)
    at: dict[int, tuple[int, list[str]]] = field(default_factory=dict)
    # update -> state tensors (buffers, tracked objects' tensors) whose value differs between the ranks of the
    # uninterrupted run there, and (rank, name) of those the interrupted run starts that update with otherwise
    across_ranks: dict[int, list[str]] = field(default_factory=dict)
    lost: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    # The global generators (`random`, numpy, torch, CUDA) an update draws from: their state moved between the
    # starts of updates 1 and 2 of the uninterrupted run; None where the probe did not record both.
    drawn: list[str] | None = None
    # The dropout modules (p > 0) the processes held; None where the probe did not look.
    dropout: list[str] | None = None

    def differing(self, update: int) -> list[str]:
        return self.at.get(update, (0, []))[1]

    def lost_tensors(self, update: int) -> list[tuple[int, str]]:
        return self.lost.get(update, [])

    def rank_divergent(self, update: int) -> list[str]:
        """Lost tensors of `update` that also differ between the uninterrupted run's ranks there."""
        split = set(self.across_ranks.get(update, []))
        return sorted({name for _, name in self.lost_tensors(update) if name in split})

    def seen(self, update: int) -> bool:
        return update in self.at

    def unseeded(self) -> list[str]:
        """The streams that start update 1 in another state in the two runs: both were fresh launches of the
        same script, so these were seeded from the OS (or the clock), not from the run's seed."""
        return sorted(set(self.differing(1)))


def compare_streams(a_probe: Path, b_probe: Path) -> StreamComparison:
    """Compare the probe's stream digests at each (rank, update) both runs recorded (see probe.py)."""
    from torchrelay.audit.probe import read_dropout, read_globals, read_streams, read_tensors

    result = StreamComparison()
    a_rows, b_rows = read_streams(a_probe), read_streams(b_probe)
    a_globals, b_globals = read_globals(a_probe), read_globals(b_probe)
    for rank, update in sorted(set(a_rows) & set(b_rows)):
        a_streams, b_streams = list(a_rows[(rank, update)]), list(b_rows[(rank, update)])
        ga, gb = a_globals.get((rank, update), {}), b_globals.get((rank, update), {})
        differ = [f"{name} (global)" for name in sorted(set(ga) & set(gb)) if ga[name] != gb[name]]
        for stream in b_streams:  # a multiset difference: the same stream may exist twice
            if stream in a_streams:
                a_streams.remove(stream)
            else:
                differ.append(stream[0])
        count, before = result.at.get(update, (0, []))
        result.at[update] = (count + len(b_rows[(rank, update)]), before + differ)
    _compare_state_tensors(result, read_tensors(a_probe), read_tensors(b_probe))
    ranks = {rank for rank, _ in a_globals}
    if any((r, 1) in a_globals and (r, 2) in a_globals for r in ranks):
        result.drawn = sorted({
            name
            for r in ranks
            for name, digest in a_globals.get((r, 1), {}).items()
            if (r, 2) in a_globals and a_globals[(r, 2)].get(name) != digest
        })  # fmt: skip
    result.dropout = read_dropout(a_probe)
    return result


def _compare_state_tensors(
    result: StreamComparison,
    a_rows: dict[tuple[int, int], dict[str, str]],
    b_rows: dict[tuple[int, int], dict[str, str]],
) -> None:
    """Fill `across_ranks` (from the uninterrupted run `a`) and `lost` (interrupted `b` against `a`)."""
    by_update: dict[int, dict[int, dict[str, str]]] = {}
    for (rank, update), digests in a_rows.items():
        by_update.setdefault(update, {})[rank] = digests
    for update, per_rank in by_update.items():
        names = set().union(*(set(d) for d in per_rank.values()))
        split = sorted(n for n in names if len({d.get(n) for d in per_rank.values()}) > 1)
        if len(per_rank) > 1 and split:
            result.across_ranks[update] = split
    for rank, update in sorted(set(a_rows) & set(b_rows)):
        a_digests, b_digests = a_rows[(rank, update)], b_rows[(rank, update)]
        lost = [
            (rank, n) for n in sorted(set(a_digests) | set(b_digests)) if a_digests.get(n) != b_digests.get(n)
        ]
        if lost:
            result.lost.setdefault(update, []).extend(lost)


def compare_digests(a_dir: RunDir, b_dir: RunDir) -> LogComparison:
    """Compare the per-update digests of the parameters (train/digests-rank*.jsonl, records/digests.py): the first update
    after which the two runs hold other parameters on some rank, among the updates both recorded."""
    from torchrelay.records.digests import first_parting, read_digests

    a, b = read_digests(a_dir), read_digests(b_dir)
    result = LogComparison(what="digests")
    result.compared_updates = max((u for rows in a.values() for u in rows), default=0)
    update, ranks = first_parting(a, b)
    if update is not None:
        result.first_update, result.rank, result.keys = update, ranks[0], ["params"]
        result.detail = f"the parameters after update {update} differ on rank(s) {', '.join(map(str, ranks))}"
    return result
