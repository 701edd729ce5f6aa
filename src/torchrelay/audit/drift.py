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

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrelay.audit.runner import AuditError, run_segments, subprocess_launcher
from torchrelay.train_records import rank_logs
from torchrelay.util.jsonl import iter_records

TOLERANCE_FACTOR = 100.0
# A parameter whose RMS gradient is at most this many eps of the whole model's received only rounding noise.
NOISE_FACTOR = 1000.0


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
class TensorDrift:
    """One model tensor of a compared pair: its kind, its drift and, for a trained parameter, in which units."""

    name: str
    kind: str  # "parameter" (judged), "noise" (a parameter that got only rounding noise), "buffer", "missing"
    drift: float  # parameter/noise: in units of the tolerance's eps x (k x step + size); buffer: relative L2
    detail: str = ""


@dataclass(slots=True)
class Drift:
    """How far two checkpoints of the same update are apart: each trained parameter against its rounding
    tolerance, the buffers by their own rule (reported, not judged), the optimizer state for information."""

    dtype: str
    updates_since_change: int
    tensors: list[TensorDrift]
    params_rel_l2: float  # the whole model's relative L2, for information
    optimizer_rel_l2: float
    reference: bool  # whether the parameters at the move were known (else the step term is left out)

    @property
    def judged(self) -> list[TensorDrift]:
        return [t for t in self.tensors if t.kind in ("parameter", "missing")]

    @property
    def worst(self) -> TensorDrift | None:
        return max(self.judged, key=lambda t: t.drift, default=None)

    @property
    def within(self) -> bool:
        return all(t.drift <= TOLERANCE_FACTOR for t in self.judged)

    def of_kind(self, kind: str) -> list[TensorDrift]:
        return [t for t in self.tensors if t.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row in data["tensors"]:
            row["drift"] = row["drift"] if math.isfinite(row["drift"]) else None
        return {**data, "within": self.within, "tolerance_factor": TOLERANCE_FACTOR}

    def line(self) -> str:
        """One line: the worst judged parameter against the tolerance, and what was set aside and why."""
        worst = self.worst
        verdict = "within" if self.within else "OUTSIDE"
        head = (
            f"parameters ({self.dtype}, {len(self.judged)} judged): worst {worst.name} at {worst.drift:.3g} x eps x "
            f"(k x step + size), {verdict} the tolerance {TOLERANCE_FACTOR:g}, k = {self.updates_since_change}"
            if worst is not None
            else f"parameters ({self.dtype}): none judged"
        )
        noise = self.of_kind("noise")
        if noise:
            head += f"; set aside, gradient only rounding noise: {', '.join(t.name for t in noise)}"
        buffers = [t for t in self.of_kind("buffer") if t.drift]
        if buffers:
            head += "; buffers differ by design: " + ", ".join(
                f"{t.name} ({t.detail or f'{t.drift:.2g} relative'})" for t in buffers[:4]
            )
        return (
            head
            + f"; whole model {self.params_rel_l2:.3g} relative, optimizer state {self.optimizer_rel_l2:.3g}"
        )


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm()) if t.numel() else 0.0


def _rel_l2(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    num = sum(float(((x - y) ** 2).sum()) for x, y in pairs)
    den = sum(float((x**2).sum()) for x, _ in pairs)
    if num == 0.0:
        return 0.0
    return math.sqrt(num / den) if den > 0 else math.inf


def split_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Base name -> its values: one, or one per rank for what a checkpoint stores per rank (`…@rank<r>`)."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, value in tensors.items():
        base, sep, rank = name.rpartition("@rank")
        if sep and rank.isdigit():
            out.setdefault(base, []).append((int(rank), value))
        else:
            out.setdefault(name, []).append((-1, value))
    return {k: [v for _, v in sorted(vs, key=lambda x: x[0])] for k, vs in out.items()}


def _merged(values: list[torch.Tensor]) -> torch.Tensor:
    """Per-rank values as one: their mean (floats; what the ranks estimate together), rank 0's (integers)."""
    if len(values) == 1 or not values[0].is_floating_point():
        return values[0]
    return torch.stack([v.double() for v in values]).mean(0)


def _second_moments(tensors: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Parameter name -> the optimizer's running mean of its squared gradient (Adam's exp_avg_sq, RMSprop's
    square_avg), where the optimizer keeps one: what says whether a tensor's gradient was only noise."""
    out = {}
    for name, values in tensors.items():
        for key in ("exp_avg_sq", "square_avg"):
            if name.startswith("optim.") and name.endswith("." + key):
                out["model." + name.removeprefix("optim.").removesuffix("." + key)] = values[0].double()
    return out


def _noise_level(moments: dict[str, torch.Tensor], params: list[str]) -> dict[str, float]:
    """Per parameter, its RMS gradient in units of the whole model's (both from the same optimizer steps)."""
    have = [n for n in params if n in moments and moments[n].numel()]
    total = sum(float(moments[n].sum()) for n in have)
    count = sum(moments[n].numel() for n in have)
    if not have or total <= 0:
        return {}
    model_rms = math.sqrt(total / count)
    return {n: math.sqrt(max(float(moments[n].mean()), 0.0)) / model_rms for n in have}


def measure_drift(
    ckpt_a: Path, ckpt_b: Path, updates_since_change: int, reference: Path | None = None
) -> Drift:
    """The drift between two checkpoints of the same update; `reference`: run a's checkpoint at the move (its
    parameters there give the size of the optimizer's own step since). See the module's docstring for the rule."""
    from torchrelay.checkpoint.reader import load_tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ta, tb = split_ranks(dict(load_tensors(ckpt_a))), split_ranks(dict(load_tensors(ckpt_b)))
        tm = split_ranks(dict(load_tensors(reference))) if reference is not None else {}
    k = max(1, updates_since_change)
    moments = _second_moments(ta)
    model_names = sorted(n for n in set(ta) | set(tb) if n.startswith("model."))
    # A trained parameter is what the optimizer keeps state for; everything else of the model is a buffer.
    trained = {n for n in model_names if any(m.startswith("optim." + n[6:] + ".") for m in ta)}
    noise = _noise_level(moments, sorted(trained))
    rows: list[TensorDrift] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    dtype = torch.float32
    for name in model_names:
        va, vb = ta.get(name), tb.get(name)
        if va is None or vb is None:
            side = "relayed" if vb is None else "uninterrupted"
            rows.append(TensorDrift(name, "missing", math.inf, f"missing in the {side} run"))
            continue
        a, b = _merged(va), _merged(vb)
        if a.shape != b.shape:
            rows.append(TensorDrift(name, "missing", math.inf, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"))
            continue
        if name in trained and a.is_floating_point():
            if len(va) > 1 or len(vb) > 1:
                rows.append(
                    TensorDrift(
                        name, "missing", math.inf, "stored per rank: the ranks train apart (no DDP/FSDP?)"
                    )
                )
                continue
            dtype = va[0].dtype
            eps = torch.finfo(dtype).eps
            step = _norm(a.double() - _merged(tm[name]).double()) if name in tm else 0.0
            scale = eps * (k * step + _norm(a))
            diff = _norm(a.double() - b.double())
            units = 0.0 if diff == 0 else (diff / scale if scale > 0 else math.inf)
            pairs.append((a.double(), b.double()))
            level = noise.get(name)
            if level is not None and level <= NOISE_FACTOR * eps:
                detail = f"RMS gradient {level / eps:.2g} x eps of the model's"
                rows.append(TensorDrift(name, "noise", units, detail))
            else:
                rows.append(TensorDrift(name, "parameter", units))
            continue
        rows.append(_buffer_row(name, a, b, len(va), len(vb)))
    optim: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in sorted(set(ta) & set(tb)):
        if name.startswith("optim.") and len(ta[name]) == len(tb[name]) == 1:
            x, y = ta[name][0], tb[name][0]
            if x.is_floating_point() and x.shape == y.shape and x.dim() > 0:
                optim.append((x.double(), y.double()))
    return Drift(
        dtype=str(dtype).removeprefix("torch."),
        updates_since_change=updates_since_change,
        tensors=rows,
        params_rel_l2=_rel_l2(pairs),
        optimizer_rel_l2=_rel_l2(optim),
        reference=bool(tm),
    )


def _buffer_row(name: str, a: torch.Tensor, b: torch.Tensor, ranks_a: int, ranks_b: int) -> TensorDrift:
    """A buffer: compared as one value (per-rank values merged), reported with what makes it differ."""
    per_rank = (
        f"; per rank in the run on {max(ranks_a, ranks_b)} rank(s), merged as their mean"
        if max(ranks_a, ranks_b) > 1
        else ""
    )
    if not a.is_floating_point():
        if torch.equal(a, b):
            return TensorDrift(name, "buffer", 0.0)
        shown = f"{a.tolist()} vs {b.tolist()}" if a.numel() == 1 else "integers differ"
        why = (
            ": a BatchNorm counts its forwards, grad_accum per update on each rank, so another split counts "
            "otherwise"
            if name.endswith("num_batches_tracked")
            else ""
        )
        return TensorDrift(name, "buffer", 1.0, shown + why + per_rank)
    rel = _rel_l2([(a.double(), b.double())])
    return TensorDrift(name, "buffer", rel, (f"{rel:.2g} relative" + per_rank) if rel else "")


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
    """The verdict of an audit across world sizes: the ledger identical and each parameter within its tolerance
    (under `elastic: exact`, every tensor of every compared checkpoint bit for bit)."""

    worlds: list[int]
    stops: list[int]
    ledger: LedgerDiff
    drift: dict[int, Drift]  # per compared checkpoint
    run_dirs: dict[str, str]
    exact: bool = False
    bit_differing: dict[int, list[str]] = field(default_factory=dict)  # exact: per checkpoint, what differs
    causes: list[dict[str, str]] = field(default_factory=list)  # {"name", "evidence", "fix"}, likeliest first

    @property
    def ok(self) -> bool:
        if self.exact:
            return self.ledger.equal and not any(self.bit_differing.values())
        return self.ledger.equal and all(d.within for d in self.drift.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exact": self.exact,
            "worlds": self.worlds,
            "stops": self.stops,
            "ledger": {**asdict(self.ledger), "equal": self.ledger.equal},
            "drift": {str(p): d.to_dict() for p, d in sorted(self.drift.items())},
            "bit_differing": {str(p): v for p, v in sorted(self.bit_differing.items())},
            "causes": self.causes,
            "run_dirs": self.run_dirs,
        }

    def lines(self) -> list[str]:
        worlds = " -> ".join(str(self.worlds[i % len(self.worlds)]) for i in range(len(self.stops) + 1))
        out = [
            f"layout audit: uninterrupted on {self.worlds[0]} rank(s) against relayed on {worlds} rank(s), "
            f"stopped after updates {', '.join(map(str, self.stops))}"
            + (" (elastic: exact)" if self.exact else ""),
            f"ledger: {len(self.ledger.differing)} of {self.ledger.compared} update(s) differ"
            + (
                f" ({self.ledger.detail})"
                if self.ledger.detail
                else " (the same samples in the same micro-batches)"
            ),
        ]
        if self.exact:
            out += [
                f"checkpoint-{p}: "
                + (f"{len(v)} tensor(s) differ, e.g. {', '.join(v[:3])}" if v else "bit for bit")
                for p, v in sorted(self.bit_differing.items())
            ]
        else:
            out += [f"checkpoint-{p}: {d.line()}" for p, d in sorted(self.drift.items())]
        if self.ok:
            out.append(
                "EQUAL: bit for bit on every layout (elastic: exact)"
                if self.exact
                else "WITHIN TOLERANCE: the same samples in the same updates; the parameters differ by "
                "reduction order only"
            )
        else:
            out.append(
                "NOT EQUAL: elastic: exact promised the same bits"
                if self.exact
                else "OUTSIDE TOLERANCE: the layout change altered more than the reduction order"
            )
            out += [
                f"{'likely cause' if i == 0 else 'also possible'}: {c['name']}: {c['evidence']}; fix: {c['fix']}"
                for i, c in enumerate(self.causes)
            ]
        return out


def likely_causes(ledger: LedgerDiff, drift: dict[int, Drift]) -> list[dict[str, str]]:
    """What most likely moved the run beyond rounding, from what the comparison saw (likeliest first)."""
    if not ledger.equal:
        if "micro_batch changed" in ledger.detail:
            return [
                {
                    "name": "a changed micro-batch",
                    "evidence": ledger.detail,
                    "fix": "keep micro_batch across the move (only world_size and grad_accum change); a loss that "
                    "is a mean over a micro-batch, or a BatchNorm, makes the grouping math",
                }
            ]
        return [
            {
                "name": "other samples",
                "evidence": ledger.detail,
                "fix": "read batches from run.dataloader (its order is world-size free) and keep the global batch",
            }
        ]
    outside = [t for d in drift.values() for t in d.judged if t.drift > TOLERANCE_FACTOR]
    if not outside:
        return []
    first = min((p for p, d in drift.items() if not d.within), default=None)
    share = len({t.name for t in outside})
    judged = len({t.name for d in drift.values() for t in d.judged})
    spread = f"{share} of {judged} parameter tensors outside" + (
        f", from checkpoint-{first}" if first else ""
    )
    per_rank = sorted({t.name for d in drift.values() for t in d.tensors if "per rank" in t.detail})
    causes = [
        {
            "name": "per-rank random numbers",
            "evidence": f"{spread}; the ledger is the same, so the forward itself changed: a rank's torch RNG is "
            "re-derived at a move, so nn.Dropout (or torch.rand on it) draws other masks",
            "fix": "draw dropout per sample with tr.sample_dropout (docs/ELASTIC.md), or set p to 0",
        },
        {
            "name": "per-rank buffers",
            "evidence": (
                f"stored per rank: {', '.join(per_rank[:3])}; each rank's statistics come from its own "
                "micro-batches, so a forward that reads them (eval mode, a loss on them) changes with the layout"
                if per_rank
                else "no buffer is stored per rank here"
            ),
            "fix": "use SyncBatchNorm (CUDA) or GroupNorm/LayerNorm, or keep running statistics out of the loss",
        },
        {
            "name": "a hyper-parameter computed from the layout",
            "evidence": "a learning rate scaled by world_size, or a loss divided by a fixed accumulation count",
            "fix": "compute them from the global batch (cfg.global_batch_for) or cfg.grad_accum as the run has it",
        },
    ]
    if not per_rank:
        causes.pop(1)
    return causes


def _elastic_exact(run_dir: Path) -> bool:
    """Whether the run was made with `elastic: exact` (config.json)."""
    try:
        return json.loads((run_dir / "config.json").read_text(encoding="utf-8")).get("elastic") == "exact"
    except (OSError, ValueError, AttributeError):
        return False


def layout_verdict(a: Path, b: Path, worlds: list[int], stops: list[int], points: list[int]) -> LayoutAudit:
    """Compare an uninterrupted run `a` with the same run relayed across world sizes `b` (moved after each stop)
    at checkpoints `points`: the ledgers, then each parameter's drift (or every bit, under elastic: exact)."""
    from torchrelay.audit.compare import compare_checkpoints

    ledger = compare_ledgers(a, b)
    reference = a / f"checkpoint-{stops[0]}"
    ref = reference if (reference / "model").is_dir() else None
    compared = [p for p in points if p > stops[0]]
    drift = {
        p: measure_drift(a / f"checkpoint-{p}", b / f"checkpoint-{p}", p - stops[0], ref) for p in compared
    }
    exact = _elastic_exact(a)
    bits = {}
    if exact:
        bits = {
            p: [d.name for d in compare_checkpoints(a / f"checkpoint-{p}", b / f"checkpoint-{p}").differing]
            for p in compared
        }
    audit = LayoutAudit(
        worlds=list(worlds),
        stops=list(stops),
        ledger=ledger,
        drift=drift,
        run_dirs={"uninterrupted": str(a), "interrupted": str(b)},
        exact=exact,
        bit_differing=bits,
    )
    if not audit.ok:
        audit.causes = likely_causes(ledger, drift)
    return audit


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
    # The first stop's checkpoint too: the parameters at the move, from which the optimizer's own step is measured.
    keep = sorted({*points, stops[0]})
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
        extra_overrides={"keep_updates": keep},
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
        extra_overrides={"keep_updates": keep},
    )
    return layout_verdict(straight.run_dir, relayed.run_dir, worlds, stops, points)
