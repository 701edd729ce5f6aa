"""Validation of chosen checkpoints after training: a user command per checkpoint, its metrics on record.

The LingBot card validated steps 4000/8000/12000/20000 after the training process exited, each for about 31
minutes. Here a validation is a shell command run once per checkpoint with the checkpoint's path; it writes a small
JSON object of metrics. Each result is recorded in `RUN_DIR/validation/checkpoint-<N>/record.json` (command, time,
code identity, exit code, metrics), beside the command's `metrics.json` and `output.log`. A checkpoint with a
record that is `ok` or `failed` is not validated again (unless asked); an `interrupted` one (the allocation's time
or a stop signal) is. A failing or crashing command is recorded as failed: the checkpoint is only ever read.

Validation holds the run's writer lock, as `pack` does: retention of a training running at the same time could
otherwise delete the checkpoint under the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrelay.checkpoint.inventory import INVENTORY, validate_complete
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config import envvars
from torchrelay.config.relay import stored_config
from torchrelay.errors import ConfigError, RelayError
from torchrelay.identity import code_identity, find_code_dir
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import validation_fits
from torchrelay.records.validation import (
    KEPT,
    LOG,
    METRICS,
    METRICS_LIMIT,
    PENDING,
    RECORD,
    RECORD_FORMAT,
    RECORD_LIMIT,
    RECORD_SCHEMA,
    ValidationRecord,
    read_records,
    remove_stale_temps,
)
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.hashing import sha256_hex
from torchrelay.util.records import fit, read_json, read_json_or_none
from torchrelay.util.safepath import ensure_inside, open_writable

if TYPE_CHECKING:  # the export pulls in torch; status and plans read validation records without it
    from torchrelay.export import ExportOptions

PLACEHOLDERS = ("checkpoint", "metrics", "update", "run_dir", "weights")
WEIGHTS = "weights"  # the export of the checkpoint for {weights}, removed after the command
# Set by a controller for its own stages: a validation command must not inherit them (TORCHRELAY_RUN_DIR would
# redirect a Run.open inside it into the run being validated).
_STAGE_VARS = ("TORCHRELAY_RUN_DIR", "TORCHRELAY_OVERRIDES", "TORCHRELAY_DEADLINE", "TORCHRELAY_BUDGET_S")
KILL_GRACE_S = 10.0


@dataclass(kw_only=True, slots=True)
class ValidationSpec:
    """The command and which checkpoints it validates."""

    command: str
    updates: list[int] | None = None  # None: every complete checkpoint (KEPT)
    cwd: Path = field(default_factory=Path.cwd)
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 0.0  # 0: no limit of its own (a deadline still applies)
    estimate_s: float = 0.0  # how long one validation takes, before one was measured
    again: bool = False  # validate checkpoints with a record too
    # Export the checkpoint's weights (torchrelay export, these options) for the command: {weights} is the folder.
    # None: only when the command names {weights}, with the default options.
    export: ExportOptions | None = None

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise ConfigError("validation needs a command (plan validate.run, or --cmd)")
        if self.timeout_s < 0 or self.estimate_s < 0:
            raise ConfigError("validation timeout_s and estimate_s must be >= 0")


@dataclass(slots=True)
class Selection:
    """Which checkpoints a pass validates (`todo`), which are validated already, and which cannot be yet."""

    todo: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    missing: dict[int, str] = field(default_factory=dict)  # update -> why there is nothing to validate


def select(run: RunDir, updates: list[int] | None, *, again: bool = False) -> Selection:
    """Match the named updates (None: every complete checkpoint) against the run's checkpoints and records."""
    complete = {c.update: c for c in list_checkpoints(run) if c.complete}
    records = read_records(run)
    total = stored_config(run).total_updates
    reached = max(complete, default=0)
    sel = Selection()
    for update in sorted(complete) if updates is None else updates:
        if update in complete:
            if not again and update in records and records[update].done:
                sel.done.append(update)
            else:
                sel.todo.append(update)
        elif update > total:
            sel.missing[update] = f"past the end of the schedule ({total} updates)"
        elif update > reached:
            sel.missing[update] = f"not reached yet (newest complete checkpoint: {reached})"
        else:
            sel.missing[update] = (
                "no complete checkpoint: not saved, or deleted by retention (add it to keep_updates)"
            )
    return sel


@dataclass(slots=True)
class ValidationReport:
    """One pass: what ran (records), what it left for a later pass and why."""

    records: list[ValidationRecord] = field(default_factory=list)
    done_before: list[int] = field(default_factory=list)
    left: dict[int, str] = field(default_factory=dict)  # to do later: update -> why not now
    missing: dict[int, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[int]:
        return [r.update for r in self.records if r.status == "failed"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "validated": [r.update for r in self.records if r.status == "ok"],
            "failed": self.failed,
            "interrupted": [r.update for r in self.records if r.status == "interrupted"],
            "done_before": self.done_before,
            "left": {str(k): v for k, v in self.left.items()},
            "missing": {str(k): v for k, v in self.missing.items()},
        }


def estimate_seconds(run: RunDir, fallback: float) -> float:
    """The longest validation this run has measured (they are alike), else the given estimate."""
    measured = [r.seconds for r in read_records(run).values() if r.done and r.exit_code is not None]
    return max(measured) if measured else fallback


_LINK_HINT = "replace the link with a folder (or remove it): validation records live inside the run directory"


def validate_checkpoints(
    run_dir: str | os.PathLike[str] | RunDir,
    spec: ValidationSpec,
    *,
    deadline: float | None = None,
    margin_s: float = 0.0,
    should_stop: Callable[[], bool] = lambda: False,
    on_event: Callable[[str, int, ValidationRecord | None], None] = lambda *_: None,  # "start" | "end"
    clock: Callable[[], float] = time.time,
) -> ValidationReport:
    """Validate every selected checkpoint not validated yet, oldest first, while the cost model says one more fits
    before `deadline`; what does not fit (or follows a stop) is left, and written to `validation/pending.json`."""
    rd = RunDir.of(run_dir)  # the `validate` verb's and the controller's entry
    if not rd.exists():
        raise ConfigError(f"{rd.path} holds no torchrelay run", hint="validate a run directory")
    with RunLock(rd.path, "train").acquire(wait_s=envvars.LOCK_WAIT_S.get()):
        # records are read only from inside the run (read_json's root): none is written through a link out of it
        ensure_inside(rd.path, rd.validation_dir, source="validation", hint=_LINK_HINT)
        remove_stale_temps(rd)  # a pass killed while writing a record or pending.json
        sel = select(rd, spec.updates, again=spec.again)
        report = ValidationReport(done_before=sel.done, missing=dict(sel.missing))
        for i, update in enumerate(sel.todo):
            if should_stop():
                report.left.update({u: "a stop signal arrived" for u in sel.todo[i:]})
                break
            estimate = estimate_seconds(rd, spec.estimate_s)
            decision = validation_fits(estimate, deadline, clock(), margin_s)
            if not decision.go:
                report.left.update({u: decision.why for u in sel.todo[i:]})
                break
            on_event("start", update, None)
            end_by = None if deadline is None else deadline - margin_s
            record = run_one(rd, update, spec, end_by=end_by, should_stop=should_stop, clock=clock)
            report.records.append(record)
            if record.status == "interrupted":
                report.left[update] = record.reason
            on_event("end", update, record)
        write_pending(rd, spec, report, clock())
    return report


def write_pending(run: RunDir, spec: ValidationSpec, report: ValidationReport, now: float) -> None:
    doc = {
        "format": RECORD_FORMAT,
        "written": now,
        "command": spec.command,
        "updates": spec.updates if spec.updates is not None else KEPT,
        "left": {str(k): v for k, v in sorted(report.left.items())},
        "missing": {str(k): v for k, v in sorted(report.missing.items())},
    }
    where = run.validation_dir
    where.mkdir(exist_ok=True)
    atomic_write_text(where / PENDING, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def command_for(template: str, values: dict[str, str]) -> str:
    """The shell command with {checkpoint}, {metrics}, {update}, {run_dir} filled in (shell-quoted); other
    braces (`${VAR}`, JSON) are left alone."""
    out = template
    for name in PLACEHOLDERS:
        out = out.replace("{" + name + "}", shlex.quote(values[name]))
    return out


def _remove_weights(out: Path) -> None:
    """Remove the export a pass left in `out` (a link there is removed itself: what it points to is not ours)."""
    path = out / WEIGHTS
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def run_one(
    run: RunDir,
    update: int,
    spec: ValidationSpec,
    *,
    end_by: float | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.time,
) -> ValidationRecord:
    """Run the command on checkpoint-<update> and record how it went (never raises for the command's failure)."""
    run_dir = run.path
    ckpt = run.checkpoint(update)
    out = run.validation_of(update)
    ensure_inside(run_dir, out, source="validation", hint=_LINK_HINT)
    previous = read_records(run).get(update)
    out.mkdir(parents=True, exist_ok=True)
    for name in (METRICS, LOG):
        (out / name).unlink(missing_ok=True)  # a result of an earlier attempt must not pass for this one's
    _remove_weights(out)  # left by a killed controller
    values = {
        "checkpoint": str(ckpt),
        "metrics": str(out / METRICS),
        "update": str(update),
        "run_dir": str(run_dir),
        "weights": str(out / WEIGHTS),
    }
    command = command_for(spec.command, values)
    record = ValidationRecord(
        update=update,
        checkpoint=ckpt.name,
        command=command,
        status="failed",
        started=clock(),
        attempt=(previous.attempt + 1) if previous else 1,
        host=socket.gethostname(),
        cwd=str(spec.cwd),
        code=_code_of(spec.cwd),
        contract_sha256=_contract_sha(run),
    )
    try:
        validate_complete(ckpt, hashes=False)  # sizes: the trainer hashed it when it wrote it
        record.inventory_sha256 = sha256_hex(ckpt / INVENTORY)
    except RelayError as exc:
        record.reason = f"{checkpoint_name(update)} is damaged, not validated: {exc.message}"
        return _finish(out, record, clock)
    try:
        return _run_command(ckpt, out, record, spec, values, end_by, should_stop, clock)
    finally:
        _remove_weights(out)  # an export of the checkpoint: as large as the model


def _run_command(
    ckpt: Path,
    out: Path,
    record: ValidationRecord,
    spec: ValidationSpec,
    values: dict[str, str],
    end_by: float | None,
    should_stop: Callable[[], bool],
    clock: Callable[[], float],
) -> ValidationRecord:
    env = {k: v for k, v in os.environ.items() if k not in _STAGE_VARS}
    env.update(spec.env)
    env.update(
        TORCHRELAY_CHECKPOINT=values["checkpoint"],
        TORCHRELAY_VALIDATION_METRICS=values["metrics"],
        TORCHRELAY_VALIDATION_UPDATE=values["update"],
        TORCHRELAY_VALIDATION_RUN_DIR=values["run_dir"],
    )
    if spec.export is not None or "{weights}" in spec.command:
        from torchrelay.export import ExportOptions, export_weights

        try:
            export_weights(ckpt, out / WEIGHTS, spec.export or ExportOptions(), owned=out)
        except RelayError as exc:
            record.reason = f"exporting the weights for the command failed: {exc.message}"
            return _finish(out, record, clock)
        env["TORCHRELAY_VALIDATION_WEIGHTS"] = values["weights"]
    limit = record.started + spec.timeout_s if spec.timeout_s else None
    update = record.update
    # (removed above, so a link here was planted since: refused, never written through)
    with os.fdopen(open_writable(out / LOG, what="the validation command's log", truncate=True), "wb") as log:
        try:
            proc = subprocess.Popen(
                record.command, shell=True, cwd=spec.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            record.reason = f"could not start the command: {exc}"
            return _finish(out, record, clock)
        why = _wait(proc, limit, end_by, should_stop, clock)
    record.exit_code = proc.returncode
    if why == "timeout":
        record.reason = f"took longer than timeout_s={spec.timeout_s:g}s; killed"
    elif why:
        record.status, record.reason = "interrupted", why
    elif proc.returncode != 0:
        record.reason = f"exited with code {proc.returncode}" + (
            f" (signal {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else ""
        )
    else:
        record.metrics, record.reason = _read_metrics(out / METRICS)
        record.status = "ok" if record.metrics is not None else "failed"
    try:
        validate_complete(ckpt, hashes=False)
    except RelayError as exc:  # the command wrote into the checkpoint: say so on the record and in status
        record.status = "failed"
        record.reason = f"the command changed {checkpoint_name(update)}: {exc.message}"
    return _finish(out, record, clock)


def _wait(
    proc: subprocess.Popen[bytes],
    limit: float | None,
    end_by: float | None,
    should_stop: Callable[[], bool],
    clock: Callable[[], float],
) -> str:
    """Wait for the command; '' when it exited by itself, else why it was stopped (its process group killed)."""
    while proc.poll() is None:
        now = clock()
        why = ""
        if should_stop():
            why = "a stop signal arrived"
        elif end_by is not None and now >= end_by:
            why = "the allocation's time ran out"
        elif limit is not None and now >= limit:
            why = "timeout"
        if why:
            _kill_group(proc)
            return why
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    return ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's whole process group, SIGKILL after a grace: nothing of it survives."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what ignored SIGTERM, and children that outlived their shell
    proc.wait()


def _read_metrics(path: Path) -> tuple[dict[str, Any] | None, str]:
    try:
        data = read_json(path, what="the command's metrics", limit=RECORD_LIMIT)
    except FileNotFoundError:
        return None, f"exited 0 but wrote no metrics to {path.name} (the {{metrics}} path)"
    except (OSError, RelayError) as exc:  # not JSON, too deep or large, a link, a pipe
        return None, f"{path.name} is not valid JSON: {str(exc).splitlines()[0]}"
    if not isinstance(data, dict) or not data:
        return None, f"{path.name} must hold a non-empty JSON object of metrics, got {type(data).__name__}"
    size = len(json.dumps(data))
    if size > METRICS_LIMIT:  # echoed into record.json, which its reader would then refuse
        return None, f"{path.name} holds {size:,} bytes of metrics, more than {METRICS_LIMIT:,}"
    return data, ""


def _finish(out: Path, record: ValidationRecord, clock: Callable[[], float]) -> ValidationRecord:
    record.ended = clock()
    record.seconds = round(record.ended - record.started, 3)
    doc = fit(record.to_dict(), RECORD_SCHEMA)  # what validation_records.read_records takes
    atomic_write_text(out / RECORD, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return record


def _code_of(cwd: Path) -> dict[str, Any]:
    """The identity of the code the command runs from: a git checkout's commit; a plain folder is only named
    (hashing an arbitrary working directory could take long)."""
    top = find_code_dir(str(cwd))
    if top is not None and (top / ".git").exists():
        return {"dir": str(top), **code_identity(top)}
    return {"dir": str(top or cwd), "commit": None}


def _contract_sha(run: RunDir) -> str | None:
    doc = read_json_or_none(run.contract_path, what="the training contract", root=run.path)
    return str(doc.get("sha256")) if isinstance(doc, dict) else None


def export_options(export: Any, workdir: Path) -> Any:
    """The plan's validate.export as ExportOptions (None: export only for a command that names {weights})."""
    if export is False or export is None:
        return None
    from torchrelay.export import ExportOptions, parse_rename

    given = export if isinstance(export, dict) else {}
    return ExportOptions(
        dtype=given.get("dtype"),
        drop=list(given.get("drop") or []),
        rename=[parse_rename(str(r)) for r in given.get("rename") or []],
        include=[workdir / str(p) for p in given.get("include") or []],
    )
