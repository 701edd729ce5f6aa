"""Preflight: everything that can refuse a launch before a GPU-hour is spent.

Built in: the resume contract against the run directory (the trainer's own `validate_resume`), free disk for the
next K checkpoints (size measured from the newest COMPLETE.json, or the smoke's), the data manifest's files, the
installed versions the contract pins. Then the plan's own checks: shell commands that must exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay import proctree
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.controller.plan import CheckSpec, Plan
from torchrelay.errors import EXIT_REFUSED, RelayError
from torchrelay.identity import find_code_dir
from torchrelay.manifest import Manifest
from torchrelay.rundir import RunDir

GIB = 1024**3
OUTPUT_LINES = 30  # lines of a failed check's output shown in the message


class PreflightFailed(RelayError):
    """A preflight check failed; nothing was started."""

    exit_code = EXIT_REFUSED


@dataclass(slots=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    skipped: bool = False


@dataclass(slots=True)
class PreflightReport:
    results: list[CheckResult] = field(default_factory=list)

    def add(self, name: str, detail: str, *, skipped: bool = False) -> None:
        self.results.append(CheckResult(name, True, detail, skipped))

    def to_list(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "ok": r.ok, "skipped": r.skipped, "detail": r.detail} for r in self.results]


def checkpoint_bytes(run_dir: str | os.PathLike[str]) -> int:
    """Size of the newest complete checkpoint (sum of its COMPLETE.json sizes), 0 when there is none."""
    complete = [c for c in list_checkpoints(run_dir) if c.complete]
    return complete[-1].size if complete else 0


def check_disk(path: Path, ckpt_bytes: int, ahead: int, report: PreflightReport) -> None:
    """Refuse when the file system of `path` cannot hold `ahead` more checkpoints of `ckpt_bytes`."""
    if ahead == 0 or ckpt_bytes == 0:
        report.add("disk", "checkpoint size not known yet", skipped=True)
        return
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = ckpt_bytes * ahead
    detail = f"{free / GIB:.2f} GiB free on {probe}, {ahead} checkpoint(s) of {ckpt_bytes / GIB:.3f} GiB need {need / GIB:.2f} GiB"
    if free < need:
        raise PreflightFailed(
            f"preflight check 'disk' failed: {detail}",
            hint="free disk space, lower preflight.checkpoints_ahead, or move the run directory",
        )
    report.add("disk", detail)


def check_manifest(manifest: Path, data_root: str, report: PreflightReport) -> None:
    m = Manifest.load(manifest, data_root)
    missing = m.check_files()
    if missing:
        shown = "\n".join(f"  {p}" for p in missing[:10])
        more = f"\n  ... and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise PreflightFailed(
            f"preflight check 'manifest' failed: {len(missing)} of the files {manifest} names do not exist "
            f"(data_root {data_root!r}):\n{shown}{more}",
            hint="fix data_root (a runtime override) or restore the data",
        )
    count = sum(1 for _ in m.paths())
    report.add("manifest", f"{len(m)} samples, {count} file(s) under {data_root or '(no data root)'} present")


def check_pins(pins: list[str], python: str, report: PreflightReport) -> None:
    """The training interpreter must have exactly the pinned versions."""
    if not pins:
        report.add("versions", "the contract pins no packages", skipped=True)
        return
    code = (
        "import json, sys\n"
        "from importlib import metadata\n"
        "out = {}\n"
        "for pin in json.loads(sys.argv[1]):\n"
        "    name = pin.split('==', 1)[0].strip()\n"
        "    try:\n"
        "        out[pin] = metadata.version(name)\n"
        "    except metadata.PackageNotFoundError:\n"
        "        out[pin] = 'not installed'\n"
        "print(json.dumps(out))\n"
    )
    proc = proctree.run(
        [python, "-c", code, json.dumps(pins)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise PreflightFailed(
            f"preflight check 'versions' failed: {python} could not report versions:\n{proc.stderr}"
        )
    have = json.loads(proc.stdout)
    wrong = [(pin, have.get(pin)) for pin in pins if pin.split("==", 1)[1].strip() != have.get(pin)]
    if wrong:
        lines = "\n".join(f"  {pin}: installed {got}" for pin, got in wrong)
        raise PreflightFailed(
            f"preflight check 'versions' failed: the contract pins versions {python} does not have:\n{lines}",
            hint="install the pinned versions in the training environment (plan train.python)",
        )
    report.add("versions", ", ".join(f"{p} ok" for p in pins))


def check_contract(plan: Plan, report: PreflightReport) -> dict[str, Any] | None:
    """Run the trainer's own resume validation; returns the stored config when the run exists."""
    from torchrelay.resume import validate_resume  # imports torch: only when there is a run to check

    rd = RunDir(plan.run_path)
    if not rd.exists():
        report.add("contract", f"{rd.path} holds no run yet: the formal run creates it", skipped=True)
        return None
    cfg = rd.load_config()
    if plan.train.overrides:
        cfg = cfg.with_overrides(plan.train.overrides)
    script = str(plan.work_path / plan.train.script)
    code_dir = find_code_dir(script)
    # Sizes only: the ranks hash every checkpoint file themselves when they open the run; hashing a 70 GiB
    # checkpoint twice would cost minutes of the allocation. The script is part of the code whether git tracks
    # it or not; the modules it imports are the run's recorded ones (the ranks check what they import).
    check = validate_resume(rd.path, cfg, plan.train.world_size, code_dir, deep=False, code_files=[script])
    report.add("contract", "; ".join(check.passed))
    return cfg.to_dict()


def run_user_check(check: CheckSpec, cwd: Path, env: dict[str, str], report: PreflightReport) -> None:
    """A user check passes when its command exits 0; otherwise its output is the message."""
    try:
        proc = proctree.run(  # a timeout ends what the check's shell started too
            check.run,
            shell=True,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=check.timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        raise PreflightFailed(
            f"preflight check {check.name!r} timed out after {check.timeout_s:.0f}s ({check.run}):\n{_last(out)}",
            hint=f"fix the check, or raise preflight.checks[{check.name}].timeout_s",
        ) from exc
    if proc.returncode != 0:
        raise PreflightFailed(
            f"preflight check {check.name!r} failed with exit code {proc.returncode} ({check.run}); "
            f"its output:\n{_last(proc.stdout)}",
            hint="no training was started; fix what the check reports and launch again",
        )
    report.add(check.name, f"exit 0 ({check.run})")


def _last(text: str) -> str:
    lines = (text or "").rstrip().splitlines()
    shown = lines[-OUTPUT_LINES:]
    prefix = [f"  ... {len(lines) - len(shown)} earlier line(s)"] if len(lines) > len(shown) else []
    return "\n".join(prefix + [f"  | {line}" for line in shown]) if lines else "  (no output)"


def run_preflight(
    plan: Plan, env: dict[str, str], on_result: Callable[[CheckResult], None] = lambda r: None
) -> PreflightReport:
    """Every check in order; the first failure raises PreflightFailed naming it."""
    report = PreflightReport()

    def step(fn: Callable[..., Any], *args: Any) -> Any:
        before = len(report.results)
        out = fn(*args, report)
        for result in report.results[before:]:
            on_result(result)
        return out

    stored = step(check_contract, plan)
    rd = RunDir(plan.run_path)
    step(check_disk, plan.run_path, checkpoint_bytes(plan.run_path), plan.preflight.checkpoints_ahead)
    if stored is not None:
        manifest = Path(stored["manifest"])
        step(
            check_manifest,
            manifest if manifest.is_absolute() else rd.path / manifest,
            stored.get("data_root", ""),
        )
        step(check_pins, list(stored.get("pins", [])), plan.train.python)
    elif plan.preflight.manifest:
        step(check_manifest, Path(plan.preflight.manifest), plan.preflight.data_root)
    for check in plan.preflight.checks:
        step(run_user_check, check, plan.work_path, env)
    return report
