"""What a layout change costs, measured: the ledger must be identical, the parameters may drift by rounding.

After a run moves to another world size, every update still sees the same samples in the same micro-batches (when
micro_batch is kept; data/order.py), but the gradient of an update is summed in another order (another split of
micro-steps and ranks, another all-reduce), so the parameters differ in their last bits, and Adam carries those
bits on. `torchrelay audit --vary world_size=2,1` runs the script uninterrupted on the first world size and
relayed across the others, then reports both differences:

- the ledger, layout-free: per update, the set of micro-batches (each a set of manifest indices), whatever rank
  and micro-step held them; any difference is a defect, not rounding;
- the drift of the parameters, as the relative L2 distance ||a - b|| / ||a|| over every model tensor, against a
  tolerance of TOLERANCE_FACTOR x eps(dtype) x (updates run since the first layout change).

Why that tolerance: a change of reduction order perturbs each update's gradient by a few units of the dtype's
rounding (eps, relative), and each later update adds its own perturbation, so the drift grows about linearly in
updates, in units of eps. Measured on the example LM (d_model 32, AdamW lr 3e-3, 12 updates, 2 -> 1 -> 2 ranks):
relative L2 drift 2.6e-6 in float32 and 6.1e-15 in float64, about 1.8 and 2.3 x eps x updates; the ratio of the
two drifts (4e8) is the ratio of the two eps (5e8), which is what rounding, and only rounding, gives. The largest
single contributor is the attention key bias, whose exact gradient is zero (softmax ignores a constant added to
every key): its float32 rounding noise is normalized by Adam into steps of lr x noise / Adam's epsilon. A factor
of 100 leaves a margin of about 50 over what was measured. A real change of the math is far beyond it in float64
and still beyond it in float32: the same samples regrouped into micro-batches of 2 instead of 4 (the example's loss
is a mean over each micro-batch's tokens, so the grouping is math for it) moved the parameters by 5.7e-4 relative
after 16 updates, in float64 and float32 alike, against tolerances of 3.6e-13 and 1.9e-4.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torchrelay.audit.runner import AuditError, run_segments, subprocess_launcher
from torchrelay.train_records import rank_logs
from torchrelay.util.jsonl import iter_records

TOLERANCE_FACTOR = 100.0


@dataclass(slots=True)
class LedgerDiff:
    """Updates whose micro-batches differ between two runs, whatever the ranks that held them."""

    compared: int
    differing: list[int]
    detail: str = ""

    @property
    def equal(self) -> bool:
        return not self.differing


def micro_batches_by_update(run_dir: Path) -> dict[int, list[tuple[int, ...]]]:
    """Per update, its micro-batches as sorted tuples of manifest indices, sorted (no rank, no micro-step)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for _rank, path in rank_logs(Path(run_dir) / "train", "exposures").items():
        for row in iter_records(path):
            if isinstance(row.get("u"), int):
                out.setdefault(int(row["u"]), []).append(tuple(sorted(int(i) for i in row.get("i") or [])))
    return {u: sorted(groups) for u, groups in sorted(out.items())}


def compare_ledgers(a: Path, b: Path) -> LedgerDiff:
    """The same samples in the same micro-batches of the same updates, in both runs."""
    ga, gb = micro_batches_by_update(a), micro_batches_by_update(b)
    differing = [u for u in sorted(set(ga) | set(gb)) if ga.get(u) != gb.get(u)]
    detail = ""
    if differing:
        u = differing[0]
        xa, xb = ga.get(u, []), gb.get(u, [])
        same_samples = sorted(i for g in xa for i in g) == sorted(i for g in xb for i in g)
        detail = f"update {u}: " + (
            "the same samples, split into other micro-batches (micro_batch changed)"
            if same_samples
            else f"{len(xa)} micro-batch(es) vs {len(xb)}, other samples"
        )
    return LedgerDiff(compared=len(set(ga) | set(gb)), differing=differing, detail=detail)


@dataclass(slots=True)
class Drift:
    """How far two checkpoints' parameters are apart, against the rounding tolerance of their dtype."""

    dtype: str
    params_rel_l2: float
    optimizer_rel_l2: float
    worst_tensor: str
    worst_max_abs: float
    updates_since_change: int
    tolerance: float

    @property
    def within(self) -> bool:
        return self.params_rel_l2 <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within": self.within}

    def line(self) -> str:
        verdict = "within" if self.within else "OUTSIDE"
        return (
            f"parameters: relative L2 drift {self.params_rel_l2:.3g} ({self.dtype}), {verdict} the tolerance "
            f"{self.tolerance:.3g} = {TOLERANCE_FACTOR:g} x eps x {self.updates_since_change} update(s); largest "
            f"in {self.worst_tensor} ({self.worst_max_abs:.3g}); optimizer state {self.optimizer_rel_l2:.3g}"
        )


def tolerance_for(dtype: torch.dtype, updates_since_change: int) -> float:
    """TOLERANCE_FACTOR x eps(dtype) x updates (see the module's docstring for why)."""
    return TOLERANCE_FACTOR * torch.finfo(dtype).eps * max(1, updates_since_change)


def _rel_l2(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    num = sum(float(((x - y) ** 2).sum()) for x, y in pairs)
    den = sum(float((x**2).sum()) for x, _ in pairs)
    if num == 0.0:
        return 0.0
    return math.sqrt(num / den) if den > 0 else math.inf


def measure_drift(ckpt_a: Path, ckpt_b: Path, updates_since_change: int) -> Drift:
    """The drift between two checkpoints of the same update (model tensors; the optimizer's for information)."""
    from torchrelay.checkpoint.reader import load_tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ta, tb = load_tensors(ckpt_a), load_tensors(ckpt_b)
    if set(ta) != set(tb):
        missing = sorted(set(ta) ^ set(tb))[:3]
        raise ValueError(f"{ckpt_a} and {ckpt_b} hold different tensors, e.g. {missing}")
    params: list[tuple[torch.Tensor, torch.Tensor]] = []
    optim: list[tuple[torch.Tensor, torch.Tensor]] = []
    worst, worst_abs, dtype = "", 0.0, torch.float32
    for name in sorted(ta):
        a, b = ta[name], tb[name]
        if not a.is_floating_point() or a.shape != b.shape:
            continue
        pair = (a.double(), b.double())
        if name.startswith("model."):
            params.append(pair)
            dtype = a.dtype
            diff = float((pair[0] - pair[1]).abs().max()) if a.numel() else 0.0
            if diff > worst_abs or not worst:
                worst, worst_abs = name, diff
        else:
            optim.append(pair)
    return Drift(
        dtype=str(dtype).removeprefix("torch."),
        params_rel_l2=_rel_l2(params),
        optimizer_rel_l2=_rel_l2(optim),
        worst_tensor=worst,
        worst_max_abs=worst_abs,
        updates_since_change=updates_since_change,
        tolerance=tolerance_for(dtype, updates_since_change),
    )


# --- the audit: --vary world_size=A,B,... ------------------------------------------------------------------------

_NPROC = ("--nproc_per_node", "--nproc-per-node")


def with_world_size(launch: list[str], world_size: int) -> list[str]:
    """The launch command with its torchrun `--nproc_per_node` set to `world_size`."""
    out = list(launch)
    for i, arg in enumerate(out):
        name, sep, _ = arg.partition("=")
        if name in _NPROC:
            if sep:
                out[i] = f"{name}={world_size}"
            elif i + 1 < len(out):
                out[i + 1] = str(world_size)
            return out
    raise AuditError(
        "--vary world_size: the launch command names no --nproc_per_node to vary",
        hint="launch with torchrun --nproc_per_node=N ... after --",
    )


@dataclass(slots=True)
class LayoutAudit:
    """The verdict of an audit across world sizes: the ledger identical and the drift within its tolerance."""

    worlds: list[int]
    stops: list[int]
    ledger: LedgerDiff
    drift: dict[int, Drift]  # per compared checkpoint
    run_dirs: dict[str, str]

    @property
    def ok(self) -> bool:
        return self.ledger.equal and all(d.within for d in self.drift.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "worlds": self.worlds,
            "stops": self.stops,
            "ledger": {**asdict(self.ledger), "equal": self.ledger.equal},
            "drift": {str(p): d.to_dict() for p, d in sorted(self.drift.items())},
            "run_dirs": self.run_dirs,
        }

    def lines(self) -> list[str]:
        worlds = " -> ".join(str(self.worlds[i % len(self.worlds)]) for i in range(len(self.stops) + 1))
        out = [
            f"layout audit: uninterrupted on {self.worlds[0]} rank(s) against relayed on {worlds} rank(s), "
            f"stopped after updates {', '.join(map(str, self.stops))}",
            f"ledger: {len(self.ledger.differing)} of {self.ledger.compared} update(s) differ"
            + (
                f" ({self.ledger.detail})"
                if self.ledger.detail
                else " (the same samples in the same micro-batches)"
            ),
        ]
        out += [f"checkpoint-{p}: {d.line()}" for p, d in sorted(self.drift.items())]
        out.append(
            "WITHIN TOLERANCE: the same samples in the same updates; the parameters differ by reduction order only"
            if self.ok
            else "OUTSIDE TOLERANCE: the layout change altered more than the reduction order"
        )
        return out


def run_layout_audit(plan: Any, worlds: list[int], on_segment: Any = None) -> LayoutAudit:
    """Run `plan` (audit/orchestrator.py AuditPlan) uninterrupted on worlds[0] ranks and relayed with the world size cycling
    through `worlds` at each stop (TORCHRELAY_RESHARD=1), then compare ledgers and measure the drift."""
    import os
    import tempfile

    from torchrelay.audit.orchestrator import comparison_points
    from torchrelay.reshard import RESHARD_ENV

    if len(worlds) < 2 or any(not isinstance(w, int) or w < 1 for w in worlds):
        raise AuditError(
            f"--vary world_size={','.join(map(str, worlds))}: give two or more rank counts, e.g. 2,1"
        )
    stops = plan.stop_updates()
    work = (
        Path(plan.work_dir)
        if plan.work_dir is not None
        else Path(tempfile.mkdtemp(prefix="torchrelay-audit-"))
    )
    target = plan.updates
    points = comparison_points(stops, target)
    others = {k: v for k, v in plan.vary.items() if k != "world_size"}
    env = dict(os.environ)
    straight = run_segments(
        "uninterrupted",
        with_world_size(plan.launch, worlds[0]),
        work / "uninterrupted",
        work / "logs",
        [target],
        vary={k: v[:1] for k, v in others.items()},
        env=env,
        launcher=subprocess_launcher,
        timeout_s=plan.timeout_s,
        on_segment=on_segment,
        extra_overrides={"keep_updates": points},
    )
    relayed = run_segments(
        "interrupted",
        plan.launch,
        work / "interrupted",
        work / "logs",
        [*stops, target],
        vary=others,
        env=env | {RESHARD_ENV: "1"},
        argv_for=lambda i: with_world_size(plan.launch, worlds[i % len(worlds)]),
        launcher=subprocess_launcher,
        timeout_s=plan.timeout_s,
        on_segment=on_segment,
        extra_overrides={"keep_updates": points},
    )
    a, b = straight.run_dir, relayed.run_dir
    drift = {
        p: measure_drift(a / f"checkpoint-{p}", b / f"checkpoint-{p}", p - stops[0])
        for p in points
        if p > stops[0]
    }
    return LayoutAudit(
        worlds=list(worlds),
        stops=stops,
        ledger=compare_ledgers(a, b),
        drift=drift,
        run_dirs={"uninterrupted": str(a), "interrupted": str(b)},
    )
