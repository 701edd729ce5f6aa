"""What a layout change costs, measured: the ledger must be identical, each parameter may drift by rounding.

After a run moves to another world size, every update still sees the same samples in the same micro-batches (when
micro_batch is kept; data/order.py), but the gradient of an update is summed in another order (another split of
micro-steps and ranks, another all-reduce), so the parameters differ in their last bits, and the optimizer carries
those bits on. `torchrelay audit --vary world_size=2,1` (audit/layout_audit.py) runs the script uninterrupted on the
first world size and relayed across the others, then compares, each by its own rule:

- the ledger, layout-free: per update, the set of micro-batches (each a set of manifest indices), whatever rank
  and micro-step held them; any difference is a defect, not rounding;
- each trained parameter (a model tensor the optimizer keeps state for), on its own, against a tolerance in units
  of the optimizer's own step: ||a - b|| <= TOLERANCE_FACTOR x eps(dtype) x (k x ||a - m|| + ||a||), with m the
  tensor at the move (the uninterrupted run's checkpoint there), k the updates since. Elements whose gradient was
  only rounding noise are set aside first (below);
- the buffers (model tensors without optimizer state: BatchNorm statistics, counters) are reported, not judged: a
  move changes them by design. Per-rank values (`…@rank<r>`, DDP leaves BatchNorm statistics per rank) are merged
  as their mean on each side and compared as a relative L2; integers are compared as they are, and a BatchNorm's
  `num_batches_tracked` differs because each rank counts grad_accum forwards an update;
- the optimizer state, as a relative L2, for information.

Why per tensor, in units of the step. A change of reduction order perturbs an update's gradient by a few eps
relative; the optimizer turns that into a step perturbed by a few eps of the step, each later update adds its own,
so a tensor drifts by about eps x k x (its displacement since the move), plus the last rounding of each element
(eps x ||a||). Measured on tests/elastic_net.py (a CNN with a BatchNorm, AdamW lr 3e-3, 2 -> 1 rank after update
4, compared at 8): the worst judged tensor at 0.12 (float32) and 0.17 (float64) of these units; a learning rate 1%
higher from the move on at 2.1e4, one sample of one update left out at 1.8e5, the same samples regrouped into
micro-batches of 2 at 2.4e5 (float64: 1e13 and more). A factor of 100 leaves a margin near 1000 on one side and
200 on the other. A global relative L2 over the whole model (the rule before this one) mixes tensors whose step is
large against their size with tensors where it is small, and one noise-driven tensor decides it.

Why the noise is set aside. A parameter whose exact gradient is zero, such as a convolution bias feeding a
BatchNorm (the normalization removes any constant) or the key bias of attention (softmax ignores a constant added
to every key), receives only rounding noise. Adam divides its step by the root of the gradient's second moment, so
noise becomes a full-size step of lr, in a direction the reduction order decides: the two runs then differ there by
about lr x k, in float32 and float64 alike, which no tolerance in eps can hold. Such a parameter does not change
the model's function, so it is set aside, element by element, where the optimizer's own second moment (Adam's
exp_avg_sq, RMSprop's square_avg) has its RMS gradient at most NOISE_FACTOR x eps of the whole model's RMS gradient:
measured 0.9 eps for that bias in both float32 and float64, against 5e6 eps and more (float32) for every trained
tensor. Elements whose gradient is exactly nil (a ReLU unit that never fires, an embedding row never drawn) fall
under the same rule; they move apart by nothing anyway. An optimizer without a second moment (SGD) does not
amplify noise, and nothing is set aside.

Why a step that depends on the layout has its own term. torch.optim.Muon's Newton-Schulz step on a matrix that FSDP2
shards rounds otherwise on another number of ranks (audit/step_probe.py): 2 to 8 % of the step, in bfloat16, far
past eps. The audit takes that step at both layouts from the state at the move and measures its rounding rho; each
parameter's bound then adds LAYOUT_FACTOR x rho x ||a - m|| (the rounding comes back with every update, in
proportion to the step), with rho the measured rounding on the stepped matrices and, on every other parameter,
that rounding times one step's relative size on the matrices (what of it reaches their gradient), from the second
update after the move on (the first update's gradients are taken from the same weights on both layouts). Elements whose
RMS gradient is under bfloat16's eps of the model's are then rounding noise (the step runs in bfloat16). Measured
on the LingBot-shaped example (FSDP2, bf16 compute, fp32 reduce, Muon on the matrices and AdamW on the rest, 2 ->
1 -> 2 ranks, compared 8 updates after the first move): a correct move at 0.55 of the bound (rho 0.076), the
learning rate 1 % higher at 1.7, one sample left out at 6.5; the margin is that narrow because a 1 % change moves
the AdamW parameters only 3 to 10 times further than Muon's rounding does, and the matrices themselves cannot tell
them apart at all (the layout's rounding there is larger than 1 %).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torchrelay.audit.step_probe import StepRounding
from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import rank_logs
from torchrelay.util.jsonl import iter_records

TOLERANCE_FACTOR = 100.0
# A layout-dependent step's measured rounding spreads over a run within this factor (module docstring).
LAYOUT_FACTOR = 3.0
_BF16_EPS = float(torch.finfo(torch.bfloat16).eps)
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


def micro_batches_by_update(run: RunDir) -> dict[int, list[tuple[int, ...]]]:
    """Per update, its micro-batches as sorted tuples of manifest indices, sorted (no rank, no micro-step)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for _rank, path in rank_logs(run.train_dir, "exposures").items():
        for row in iter_records(path):
            if isinstance(row.get("u"), int):
                out.setdefault(int(row["u"]), []).append(tuple(sorted(int(i) for i in row.get("i") or [])))
    return {u: sorted(groups) for u, groups in sorted(out.items())}


def compare_ledgers(a: RunDir, b: RunDir) -> LedgerDiff:
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
    rounding: str = ""  # a layout-dependent step's measured rounding, when the bound holds it (step_probe.py)

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
        noise = [t.name for t in self.of_kind("noise")]
        noise += [
            f"part of {t.name} ({t.detail.split(' elements')[0]})"
            for t in self.of_kind("parameter")
            if t.detail
        ]
        if noise:
            head += f"; set aside, gradient nil or rounding noise: {', '.join(noise)}"
        buffers = [t for t in self.of_kind("buffer") if t.drift]
        if buffers:
            head += "; buffers differ by design: " + ", ".join(
                f"{t.name} ({t.detail or f'{t.drift:.2g} relative'})" for t in buffers[:4]
            )
        if self.rounding:
            head += f"; {self.rounding}"
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


def _model_rms(moments: dict[str, torch.Tensor], params: set[str]) -> float:
    """The whole model's RMS gradient, from the optimizer's second moments (0.0 where it keeps none)."""
    have = [moments[n] for n in sorted(params) if n in moments and moments[n].numel()]
    count = sum(m.numel() for m in have)
    return math.sqrt(max(sum(float(m.sum()) for m in have), 0.0) / count) if count else 0.0


def measure_drift(
    ckpt_a: Path,
    ckpt_b: Path,
    updates_since_change: int,
    reference: Path | None = None,
    rounding: StepRounding | None = None,
) -> Drift:
    """The drift between two checkpoints of the same update; `reference`: run a's checkpoint at the move (its
    parameters there give the size of the optimizer's own step since). See the module's docstring for the rule."""
    from torchrelay.checkpoint.reader import load_tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ta, tb = _named(ckpt_a, load_tensors(ckpt_a)), _named(ckpt_b, load_tensors(ckpt_b))
        tm = _named(reference, load_tensors(reference)) if reference is not None else {}
    return drift_of(ta, tb, updates_since_change, tm, rounding)


def _named(ckpt: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with a DeepSpeed ZeRO-1/2 engine's flat partitions (`optim@rank<r>.…`, another
    number of them on each layout) replaced by the optimizer state per parameter (zero_reshard.named_state)."""
    if not any(k.startswith("optim@rank") for k in tensors):
        return dict(tensors)
    from torchrelay.checkpoint.deepspeed_engine import DS_DIR, DS_TAG, safe_load
    from torchrelay.checkpoint.state import read_trainer_state
    from torchrelay.checkpoint.zero_reshard import named_state

    record = read_trainer_state(ckpt).get("deepspeed") or {}
    if record.get("zero_stage") not in (1, 2):
        return dict(tensors)
    folder = ckpt / str(record.get("dir", DS_DIR)) / str(record.get("tag", DS_TAG))
    kept = {k: v for k, v in tensors.items() if not k.startswith("optim@rank")}
    return kept | named_state(folder, safe_load)


def drift_of(
    tensors_a: dict[str, torch.Tensor],
    tensors_b: dict[str, torch.Tensor],
    updates_since_change: int,
    reference: dict[str, torch.Tensor] | None = None,
    rounding: StepRounding | None = None,
) -> Drift:
    """measure_drift on checkpoints' flat tensors (`model.…`, `optim.…`, per rank `…@rank<r>`); `rounding`: the
    measured rounding of a step that depends on the layout (step_probe.py), held in each parameter's bound."""
    layout = rounding is not None and rounding.applies
    ta, tb, tm = split_ranks(tensors_a), split_ranks(tensors_b), split_ranks(reference or {})
    k = max(1, updates_since_change)
    moments = _second_moments(ta)
    model_names = sorted(n for n in set(ta) | set(tb) if n.startswith("model."))
    # A trained parameter is what the optimizer keeps state for; everything else of the model is a buffer.
    trained = {n for n in model_names if any(m.startswith("optim." + n[6:] + ".") for m in ta)}
    model_rms = _model_rms(moments, trained)
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
            noise = max(NOISE_FACTOR * eps, _BF16_EPS) if layout else NOISE_FACTOR * eps
            rho = rounding.rho(name, k) if rounding is not None else 0.0
            x, y = a.double(), b.double()
            m = _merged(tm[name]).double() if name in tm and tm[name][0].shape == a.shape else x
            # Elements whose RMS gradient is rounding noise: Adam normalizes it into full-size steps (module doc).
            quiet = torch.zeros(x.shape, dtype=torch.bool)
            if name in moments and model_rms > 0 and moments[name].shape == a.shape:
                quiet = moments[name].clamp(min=0).sqrt() <= noise * model_rms
            keep = ~quiet
            diff, step, size = _norm((x - y)[keep]), _norm((x - m)[keep]), _norm(x[keep])
            scale = eps * (k * step + size) + rho * step * LAYOUT_FACTOR / TOLERANCE_FACTOR
            units = 0.0 if diff == 0 else (diff / scale if scale > 0 else math.inf)
            pairs.append((x, y))
            n_quiet = int(quiet.sum())
            if n_quiet == x.numel() and x.numel():
                rows.append(
                    TensorDrift(name, "noise", 0.0, "every element's gradient is nil or rounding noise")
                )
            else:
                detail = (
                    f"{n_quiet} of {x.numel()} elements' gradient is nil or rounding noise" if n_quiet else ""
                )
                rows.append(TensorDrift(name, "parameter", units, detail))
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
        rounding=rounding.line() if layout and rounding is not None else "",
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
