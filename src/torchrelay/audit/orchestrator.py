"""The audit's orchestrator: an uninterrupted and an interrupted run of the same launch (each one launched by
runner.py), compared and diagnosed."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.audit import compare, diagnose, probe, verdict
from torchrelay.audit.runner import (
    AuditError,
    Launcher,
    RunLaunches,
    SegmentLaunch,
    check_stops,
    choose_stops,
    fresh_run,
    run_segments,
    subprocess_launcher,
)
from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.config.relay import stored_config
from torchrelay.errors import ConfigError
from torchrelay.identity import numerics
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.history import read_history
from torchrelay.util.hashing import sha256_or_none

TOP_TENSORS = 5


@dataclass(kw_only=True, slots=True)
class AuditSpec:
    """What to audit and how: the launch command, U updates, where to stop, what to vary, the tolerance."""

    launch: list[str]
    updates: int = 12
    stops: int | None = 3
    stop_at: list[int] | None = None
    random_stops: bool = False
    seed: int | None = None
    vary: dict[str, list[Any]] = field(default_factory=dict)
    atol: float = 0.0
    ignore_keys: list[str] = field(default_factory=list)  # metric keys that may differ (memory, host names)
    work_dir: Path | None = None
    keep: bool = False
    timeout_s: float = 600.0
    confirm_nondeterminism: bool = True
    probe: bool = True  # watch the script's own DataLoaders from inside (see probe.py)

    def __post_init__(self) -> None:
        if not self.launch:
            raise AuditError(
                "no launch command", hint="put it after --, e.g. -- torchrun --nproc_per_node=2 train.py"
            )
        if self.atol < 0 or self.atol != self.atol:
            raise AuditError(f"--atol {self.atol}: must be a number >= 0")
        for key, values in self.vary.items():
            if not values:
                raise AuditError(f"--vary {key}=: give at least one value, e.g. --vary {key}=0,2")

    def stop_updates(self) -> list[int]:
        """The updates after which the interrupted run stops, sorted."""
        if self.stop_at:
            return check_stops(self.updates, self.stop_at)
        rng = random.Random(self.seed) if self.random_stops else None
        return choose_stops(self.updates, self.stops or 1, rng=rng)


# Its name before issue 20 (a plan is the launch's, controller/plan.py): kept for programs that import it.
AuditPlan = AuditSpec


def find_script(launch: Sequence[str]) -> str | None:
    """The user's training script in the launch command: the first argument naming an existing .py file."""
    for arg in launch:
        if arg.endswith(".py") and Path(arg).is_file():
            return str(Path(arg).resolve())
    return None


def _check_vary(run: RunDir, vary: dict[str, list[Any]]) -> None:
    """Refuse, before the interrupted run, to vary a field the run's contract fixes (its resume would be refused)."""
    if not vary:
        return
    cfg = stored_config(run)
    for key in vary:
        dotted = key if key.startswith("params.") or key in cfg.to_dict() else f"params.{key}"
        if not cfg.is_runtime(dotted):
            raise AuditError(
                f"--vary {key}: not a runtime field of this run, so a resume with another value is refused",
                hint=f"vary one of: {', '.join(sorted(cfg.runtime_keys()))}",
            )


def comparison_points(stops: Sequence[int], updates: int) -> list[int]:
    """The checkpoints both runs are compared at: the first update after each resume, and the last update.

    Comparing right after each resume means a difference the resume made cannot fade before it is seen.
    """
    return sorted({stop + 1 for stop in stops if stop + 1 <= updates} | {updates})


def compare_points(
    a: RunDir, b: RunDir, points: Sequence[int], atol: float
) -> dict[int, compare.TensorComparison]:
    """The tensors of checkpoint-P of both runs for each P; a missing one is an AuditError naming it."""
    out = {}
    for point in points:
        ca, cb = a.checkpoint(point), b.checkpoint(point)
        missing = [c for c in (ca, cb) if not (c / INVENTORY).is_file()]
        if missing:
            raise AuditError(
                f"no complete {missing[0].name} in {missing[0].parent}: the audit compares state there",
                hint="the run must save and keep the updates in its keep_updates "
                "(torchrelay.Run does both; the audit sets them as a runtime override)",
            )
        out[point] = compare.compare_checkpoints(ca, cb, atol)
    return out


def _difference(
    a: RunDir, b: RunDir, points: Sequence[int], atol: float, ignore: frozenset[str]
) -> str | None:
    """Where run b parts from run a (metrics, then ledger, then tensors), or None when bit for bit equal."""
    metrics = compare.compare_metrics(a, b, atol, ignore)
    if not metrics.equal:
        return f"metric logs part at update {metrics.first_update} ({metrics.detail})"
    ledger = compare.compare_ledgers(a, b)
    if not ledger.equal:
        return f"exposure ledgers part at update {ledger.first_update} ({ledger.detail})"
    for point, tensors in compare_points(a, b, points, atol).items():
        if not tensors.equal:
            top = tensors.differing[0]
            return f"{len(tensors.differing)} tensor(s) differ in {checkpoint_name(point)}, most {top.name} by {top.max_abs:.3g}"
    return None


def _numerics_of(*run_dirs: RunDir) -> list[dict[str, Any]]:
    """The distinct numerics identities the audited runs' segments recorded, in order of first use."""
    seen: dict[str, dict[str, Any]] = {}
    for run_dir in run_dirs:
        for seg in read_history(run_dir):
            if isinstance(seg.get("numerics"), dict):
                seen.setdefault(numerics.fingerprint(seg["numerics"]), seg["numerics"])
    return list(seen.values())


def run_audit(
    spec: AuditSpec,
    *,
    launcher: Launcher = subprocess_launcher,
    on_segment: Callable[[str, SegmentLaunch], None] | None = None,
) -> verdict.Verdict:
    """Launch the spec's command uninterrupted and interrupted, compare, diagnose, and record the verdict."""
    started = time.monotonic()
    stops = spec.stop_updates()
    owned = spec.work_dir is None
    work = (
        Path(spec.work_dir)
        if spec.work_dir is not None
        else Path(tempfile.mkdtemp(prefix="torchrelay-audit-"))
    )
    if not owned and work.is_dir() and any(work.iterdir()):
        raise ConfigError(
            f"{work}: the audit's work directory is not empty", hint="pass an empty or new --work-dir"
        )
    logs = work / "logs"
    target = spec.updates  # both runs end with checkpoint-<target>
    points = comparison_points(stops, target)

    def launch(name: str, stop_after: list[int], vary: dict[str, list[Any]]) -> RunLaunches:
        env = dict(os.environ)
        if spec.probe:
            env[probe.ENV] = str(work / "probe" / name)
            # Update 1 (both runs fresh launches: a stream that differs there was never seeded), update 2 (which
            # global generators an update draws from) and the first update of each continued segment.
            env[probe.STREAMS_AT_ENV] = ",".join(
                str(u) for u in sorted({1, 2, *(stop + 1 for stop in stops)})
            )
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe.SITE_DIR), env.get("PYTHONPATH")) if p)
        return run_segments(
            name,
            spec.launch,
            fresh_run(work, name),
            logs,
            stop_after,
            vary=vary,
            launcher=launcher,
            timeout_s=spec.timeout_s,
            on_segment=on_segment,
            env=env,
            # Saved and kept in both runs (a runtime field, the same in every segment): later saves would
            # otherwise delete them before the comparison.
            extra_overrides={"keep_updates": points},
        )

    first_values = {k: v[:1] for k, v in spec.vary.items()}
    straight = launch("uninterrupted", [target], first_values)
    _check_vary(straight.run, spec.vary)
    relayed = launch("interrupted", [*stops, target], spec.vary)

    a, b = straight.run, relayed.run
    by_point = compare_points(a, b, points, spec.atol)
    differing_at = [p for p, t in by_point.items() if not t.equal]
    tensors_at = differing_at[0] if differing_at else target
    tensors = by_point[tensors_at]
    ignore = frozenset(spec.ignore_keys)
    metrics = compare.compare_metrics(a, b, spec.atol, ignore)
    ledger = compare.compare_ledgers(a, b)
    digests = compare.compare_digests(a, b)
    own = compare.compare_own_batches(work / "probe" / "uninterrupted", work / "probe" / "interrupted")
    own_loaders = probe.samplers(work / "probe" / "interrupted")
    streams = compare.compare_streams(work / "probe" / "uninterrupted", work / "probe" / "interrupted")

    def rerun() -> str | None:
        again = launch("uninterrupted-again", [target], first_values)
        return _difference(a, again.run, points, spec.atol, ignore)

    evidence = diagnose.Evidence(
        stops=stops,
        metrics=metrics,
        ledger=ledger,
        tensors=tensors,
        own_batches=own if own_loaders else None,
        own_samplers=own_loaders,
        streams=streams if spec.probe else None,
        tensors_at=tensors_at,
        final_equal=by_point[target].equal,
        digests=digests,
    )
    causes = diagnose.diagnose(evidence, rerun if spec.confirm_nondeterminism else None)
    equal = tensors.equal and metrics.equal and ledger.equal and digests.equal
    script = find_script(spec.launch)
    history = read_history(b)
    result = verdict.Verdict(
        equal=equal,
        launch=list(spec.launch),
        script=script,
        script_sha256=sha256_or_none(script) if script else None,
        updates=target,
        stops=stops,
        vary=spec.vary,
        atol=spec.atol,
        ignored_keys=sorted(ignore),
        tensors_equal=tensors.equal,
        tensors_compared=tensors.compared,
        values_compared=tensors.values_compared,
        tensors_differing=len(tensors.differing),
        top_tensors=[
            {"name": d.name, "max_abs": d.max_abs, "note": d.note} for d in tensors.differing[:TOP_TENSORS]
        ],
        tensors_first_update=differing_at[0] if differing_at else None,
        checkpoints=[
            {
                "update": point,
                "after_stop": point - 1 if point - 1 in stops else None,
                "compared": t.compared,
                "values": t.values_compared,
                "differing": len(t.differing),
                "top": t.differing[0].name if t.differing else None,
            }
            for point, t in by_point.items()
        ],
        metrics_equal=metrics.equal,
        metrics_first_update=metrics.first_update,
        metrics_keys=metrics.keys,
        metrics_detail=metrics.detail,
        ledger_equal=ledger.equal,
        ledger_first_update=ledger.first_update,
        ledger_detail=ledger.detail,
        digests_compared=digests.compared_updates,
        digests_first_update=digests.first_update,
        digests_detail=digests.detail,
        own_loaders=own_loaders,
        own_batches_equal=own.equal,
        own_batches_first_update=own.first_update,
        own_batches_detail=own.detail,
        causes=[c.to_dict() for c in causes],
        seconds=time.monotonic() - started,
        code=dict(history[-1].get("code") or {}) if history else {},
        numerics=_numerics_of(a, b),
    )
    keep = spec.keep or not owned or not equal
    if keep:
        result.run_dirs = {"uninterrupted": str(a.path), "interrupted": str(b.path)}
        if (work / "uninterrupted-again").is_dir():
            result.run_dirs["uninterrupted-again"] = str(work / "uninterrupted-again")
    verdict.save(result)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return result
