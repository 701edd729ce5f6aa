"""`torchrelay audit --vary world_size=A,B,...`: the run uninterrupted on A ranks against the same run moved to B, ...
at each stop, compared by audit/drift.py's rules (the ledger exactly, each parameter against its rounding
tolerance, the buffers by theirs; every bit under `elastic: exact`), with the likely cause named when outside.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrelay.audit import diagnose
from torchrelay.audit.drift import TOLERANCE_FACTOR, Drift, LedgerDiff, compare_ledgers, measure_drift
from torchrelay.audit.runner import AuditError, fresh_run, run_segments, subprocess_launcher
from torchrelay.audit.step_probe import StepRounding, measure_step_rounding
from torchrelay.checkpoint.deepspeed_engine import DS_DIR
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.records import read_json_or_none

if TYPE_CHECKING:
    from torchrelay.audit.compare import StreamComparison

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
                f"{checkpoint_name(p)}: "
                + (f"{len(v)} tensor(s) differ, e.g. {', '.join(v[:3])}" if v else "bit for bit")
                for p, v in sorted(self.bit_differing.items())
            ]
        else:
            out += [f"{checkpoint_name(p)}: {d.line()}" for p, d in sorted(self.drift.items())]
        if self.ok:
            out.append(
                "EQUAL: bit for bit on every layout (elastic: exact)"
                if self.exact
                else "WITHIN TOLERANCE: the same samples in the same updates; the parameters differ by "
                "reduction order only"
                + (
                    " and the optimizer's measured rounding"
                    if any(d.rounding for d in self.drift.values())
                    else ""
                )
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


def likely_causes(
    ledger: LedgerDiff, drift: dict[int, Drift], facts: StreamComparison | None = None
) -> list[dict[str, str]]:
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
        f", from {checkpoint_name(first)}" if first else ""
    )
    per_rank = sorted({t.name for d in drift.values() for t in d.tensors if "per rank" in t.detail})
    # Named only from evidence: dropout where the processes held it (the audit's probe), per-rank buffers where
    # some were stored per rank; else what differs first, and "unknown" (audit/diagnose.py).
    dropout = diagnose.layout_dropout_cause(facts, spread)
    causes = [dropout] if dropout else []
    if per_rank:
        causes.append(
            {
                "name": "per-rank buffers",
                "evidence": f"stored per rank: {', '.join(per_rank[:3])}; each rank's statistics come from its own "
                "micro-batches, so a forward that reads them (eval mode, a loss on them) changes with the layout",
                "fix": "use SyncBatchNorm (CUDA) or GroupNorm/LayerNorm, or keep running statistics out of the loss",
            }
        )
    if not causes:
        at = drift[first] if first is not None else next(iter(drift.values()))
        worst = sorted((t for t in at.judged if t.drift > TOLERANCE_FACTOR), key=lambda t: -t.drift)
        same = [t.name for t in at.judged if t.drift == 0.0]
        causes.append(diagnose.layout_unknown_cause(spread, [t.name for t in worst], same, facts))
    causes.append(
        {
            "name": "a hyper-parameter computed from the layout",
            "evidence": "a learning rate scaled by world_size, or a loss divided by a fixed accumulation count",
            "fix": "compute them from the global batch (cfg.global_batch_for) or cfg.grad_accum as the run has it",
        }
    )
    return causes


def _elastic_exact(run: RunDir) -> bool:
    """Whether the run was made with `elastic: exact` (config.json)."""
    cfg = read_json_or_none(run.config_path, what="the run's configuration", root=run.path)
    return isinstance(cfg, dict) and cfg.get("elastic") == "exact"


def layout_verdict(
    a: str | os.PathLike[str] | RunDir,
    b: str | os.PathLike[str] | RunDir,
    worlds: list[int],
    stops: list[int],
    points: list[int],
    rounding: StepRounding | None = None,
) -> LayoutAudit:
    """Compare an uninterrupted run `a` with the same run relayed across world sizes `b` (moved after each stop)
    at checkpoints `points`: the ledgers, then each parameter's drift (or every bit, under elastic: exact);
    `rounding`: a layout-dependent step's rounding measured before (else measured here from `a` at the move)."""
    from torchrelay.audit.compare import compare_checkpoints, load_checkpoint_tensors

    run_a, run_b = RunDir.of(a), RunDir.of(b)  # a test's or a trainer's own paths, or the audit's runs
    ledger = compare_ledgers(run_a, run_b)
    reference = run_a.checkpoint(stops[0])
    # the parameters at the move: DCP's model folder, or a DeepSpeed engine's files
    ref = reference if (reference / "model").is_dir() or (reference / DS_DIR).is_dir() else None
    compared = [p for p in points if p > stops[0]]
    exact = _elastic_exact(run_a)
    # A step that depends on the layout (Muon on sharded matrices) is taken at each world size from the state at
    # the move: its own rounding joins each parameter's bound (audit/step_probe.py).
    if rounding is None and ref is not None and not exact:
        rounding = measure_step_rounding(ref, worlds)
    drift = {
        p: measure_drift(run_a.checkpoint(p), run_b.checkpoint(p), p - stops[0], ref, rounding)
        for p in compared
    }
    bits = {}
    if exact:
        bits = {
            p: [
                d.name
                for d in compare_checkpoints(
                    # the tensors only: generators and per-rank values are the layout's own
                    run_a.checkpoint(p),
                    run_b.checkpoint(p),
                    loader=load_checkpoint_tensors,
                ).differing
            ]
            for p in compared
        }
    audit = LayoutAudit(
        worlds=list(worlds),
        stops=list(stops),
        ledger=ledger,
        drift=drift,
        run_dirs={"uninterrupted": str(run_a.path), "interrupted": str(run_b.path)},
        exact=exact,
        bit_differing=bits,
    )
    if not audit.ok:
        from torchrelay.audit.compare import compare_streams

        probe = run_a.path.parent / "probe"  # run_layout_audit's probe records, where it ran one
        facts = compare_streams(probe / run_a.path.name, probe / run_b.path.name) if probe.is_dir() else None
        audit.causes = likely_causes(ledger, drift, facts)
    return audit


def run_layout_audit(spec: Any, worlds: list[int], on_segment: Any = None) -> LayoutAudit:
    """Run `spec` (audit/orchestrator.py AuditSpec) uninterrupted on worlds[0] ranks and relayed with the world size cycling
    through `worlds` at each stop (TORCHRELAY_RESHARD=1), then compare ledgers and measure the drift."""
    import os
    import tempfile

    from torchrelay.audit.orchestrator import comparison_points
    from torchrelay.records.reshard import RESHARD_ENV

    if len(worlds) < 2 or any(not isinstance(w, int) or w < 1 for w in worlds):
        raise AuditError(
            f"--vary world_size={','.join(map(str, worlds))}: give two or more rank counts, e.g. 2,1"
        )
    stops = spec.stop_updates()
    work = (
        Path(spec.work_dir)
        if spec.work_dir is not None
        else Path(tempfile.mkdtemp(prefix="torchrelay-audit-"))
    )
    target = spec.updates
    points = comparison_points(stops, target)
    # The first stop's checkpoint too: the parameters at the move, from which the optimizer's own step is measured.
    keep = sorted({*points, stops[0]})
    others = {k: v for k, v in spec.vary.items() if k != "world_size"}
    from torchrelay.audit import probe

    env = dict(os.environ)
    # The probe looks inside the processes (dropout modules, which generators an update draws from) for the cause.
    env[probe.STREAMS_AT_ENV] = "1,2"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe.SITE_DIR), env.get("PYTHONPATH")) if p)
    straight = run_segments(
        "uninterrupted",
        with_world_size(spec.launch, worlds[0]),
        fresh_run(work, "uninterrupted"),
        work / "logs",
        [target],
        vary={k: v[:1] for k, v in others.items()},
        env=env | {probe.ENV: str(work / "probe" / "uninterrupted")},
        launcher=subprocess_launcher,
        timeout_s=spec.timeout_s,
        on_segment=on_segment,
        extra_overrides={"keep_updates": keep},
    )
    relayed = run_segments(
        "interrupted",
        spec.launch,
        fresh_run(work, "interrupted"),
        work / "logs",
        [*stops, target],
        vary=others,
        env=env | {RESHARD_ENV: "1", probe.ENV: str(work / "probe" / "interrupted")},
        argv_for=lambda i: with_world_size(spec.launch, worlds[i % len(worlds)]),
        launcher=subprocess_launcher,
        timeout_s=spec.timeout_s,
        on_segment=on_segment,
        extra_overrides={"keep_updates": keep},
    )
    return layout_verdict(straight.run, relayed.run, worlds, stops, points)
