"""Attempts: every launch of a plan is `RUN_DIR/attempts/attempt_NN/` with what it ran and how it ended.

```
RUN_DIR/attempts/
  plan.frozen.yaml           the first attempt's resolved plan: what later attempts are compared against
  attempt_01/
    plan.resolved.yaml       the plan this attempt ran (after --set)
    overrides.json           the --set assignments given on the command line
    plan.diff.json           [[dotted key, frozen value, this value], ...]: the change against the frozen plan
    measurements.json        update/save/startup seconds and checkpoint size from the smoke (when it ran)
    fallback.json            when the allocation had too few devices: which fallback of which plan ran, and why
    outcome.json             exit code, ended, stage reached, updates done, notes (written last)
    smoke/                   the throwaway run directory of the smoke run
```
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from torchrelay.controller.plan import plan_diff
from torchrelay.errors import ConfigError, RelayError
from torchrelay.paths.layout import ATTEMPTS_DIR
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import MEASUREMENTS_SCHEMA
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.records import Schema, check, read_json
from torchrelay.util.yaml_records import read_yaml

FROZEN_PLAN = "plan.frozen.yaml"
_NAME = re.compile(r"^attempt_(\d+)$")
STAGES = ("preflight", "smoke", "formal", "validate", "done")


@dataclass(kw_only=True, slots=True)
class Outcome:
    """How an attempt ended; `exit_code` is the controller's own."""

    exit_code: int
    ended: str  # finished | budget | request | signal | memory | memory-killed | crash | error | refused
    stage: str  # the last stage entered: preflight | smoke | formal | validate | done
    updates_before: int = 0
    updates_after: int = 0
    message: str = ""
    started: float = 0.0
    stopped: float = 0.0
    job: str | None = None
    notes: list[str] = field(default_factory=list)
    validation: dict[str, Any] = field(default_factory=dict)  # the validation stage's report, when it ran
    fallback: dict[str, Any] = field(
        default_factory=dict
    )  # the plan's fallback this attempt ran (fallback.json)

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ConfigError(f"attempt outcome: stage must be one of {STAGES}, got {self.stage!r}")

    @property
    def updates_done(self) -> int:
        return max(0, self.updates_after - self.updates_before)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "updates_done": self.updates_done}


class Attempt:
    """One attempt folder; files are written atomically, `outcome.json` last."""

    def __init__(self, path: Path, number: int) -> None:
        self.path = path
        self.number = number
        self.notes: list[str] = []

    @property
    def smoke_dir(self) -> Path:
        return self.path / "smoke"

    def note(self, text: str) -> None:
        """Remember a line for the outcome (and print nothing: the caller reports)."""
        self.notes.append(text)

    def write_json(self, name: str, data: Any) -> Path:
        path = self.path / name
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

    def read_json(self, name: str, schema: Schema | None = None) -> Any:
        """An attempt's record, None when there is none or it is damaged (an attempt killed mid-way); with
        `schema`, a record whose fields break it is refused (RecordError naming the file and field): values are
        written whole, so one out of range was put there by someone else."""
        try:
            data = read_json(self.path / name, what=name, root=self.path)
        except (OSError, RelayError):
            return None
        if schema is not None:
            check(data, schema, source=f"{self.path / name} ({name})")
        return data

    def finish(self, outcome: Outcome) -> Path:
        """Write outcome.json (with this attempt's notes)."""
        outcome.notes = [*outcome.notes, *(n for n in self.notes if n not in outcome.notes)]
        return self.write_json("outcome.json", outcome.to_dict())


class Attempts:
    """The attempts folder of a run directory.

    Run.open creates a run only in an empty directory, so before the run exists the attempts wait beside it in
    `.<name>.attempts/` and `settle()` moves them in once the formal run has created it.
    """

    def __init__(self, run: RunDir) -> None:
        self.run_dir = run.path
        self.run = run
        self.final = self.run.attempts_dir
        self.staging = self.run_dir.parent / f".{self.run_dir.name}.{ATTEMPTS_DIR}"
        self.settle()
        self.root = self.final if self.run.exists() or self.final.exists() else self.staging

    def settle(self, attempt: Attempt | None = None) -> Attempt | None:
        """Move staged attempts into the run directory once it holds a run; returns `attempt` at its new place."""
        if not self.staging.is_dir() or not self.run.exists():
            return attempt
        self.final.mkdir(exist_ok=True)
        for child in sorted(self.staging.iterdir()):
            target = self.final / child.name
            if child.name == FROZEN_PLAN and target.exists():
                child.unlink()
                continue
            os.replace(child, target)
        self.staging.rmdir()
        self.root = self.final
        if attempt is not None and attempt.path.parent != self.final:
            attempt.path = self.final / attempt.path.name
        return attempt

    def all(self) -> list[Attempt]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and child.is_dir():
                found.append(Attempt(child, int(m.group(1))))
        return sorted(found, key=lambda a: a.number)

    def frozen_plan(self) -> dict[str, Any] | None:
        path = self.root / FROZEN_PLAN
        if not path.exists():
            return None
        data = read_yaml(path, what="the plan frozen at the first attempt")
        return data if isinstance(data, dict) else None

    def start(self, plan: dict[str, Any], sets: dict[str, Any]) -> tuple[Attempt, list[tuple[str, Any, Any]]]:
        """Create the next attempt folder, freezing the plan on the first; returns it and its diff."""
        self.root.mkdir(parents=True, exist_ok=True)
        frozen = self.frozen_plan()
        if frozen is None:
            atomic_write_text(self.root / FROZEN_PLAN, _yaml(plan))
            frozen = plan
        number = (self.all()[-1].number + 1) if self.all() else 1
        while True:  # two launches at once must not share a folder
            path = self.root / f"attempt_{number:02d}"
            try:
                path.mkdir()
                break
            except FileExistsError:
                number += 1
        attempt = Attempt(path, number)
        diff = plan_diff(frozen, plan)
        atomic_write_text(path / "plan.resolved.yaml", _yaml(plan))
        attempt.write_json("overrides.json", sets)
        attempt.write_json("plan.diff.json", [list(d) for d in diff])
        attempt.write_json("started.json", {"time": time.time(), "pid": os.getpid()})
        return attempt, diff

    def latest_measurements(self) -> dict[str, Any] | None:
        """measurements.json of the newest attempt that has one (a later attempt may skip the smoke)."""
        for attempt in reversed(self.all()):
            data = attempt.read_json("measurements.json", MEASUREMENTS_SCHEMA)
            if isinstance(data, dict):
                return data
        return None


def describe_fallback(fallback: dict[str, Any]) -> str:
    """One line saying which fallback ran instead of which plan, and why."""
    how = (
        f"the same run continued in place on {fallback.get('nproc_per_node')} rank(s) per node, global batch kept"
        if fallback.get("in_place") is True
        else f"{fallback.get('nproc_per_node')} rank(s) per node in a run of its own (not a continuation of "
        f"{fallback.get('primary_run_dir')})"
    )
    return (
        f"fallback {fallback.get('fallback')!r} of plan {fallback.get('plan')!r}: the allocation has "
        f"{fallback.get('devices')} device(s) per node, the plan needs {fallback.get('primary_nproc_per_node')}; "
        + how
    )


def latest_fallback(run: RunDir) -> dict[str, Any] | None:
    """fallback.json of the run's newest attempt that has one: the run was started as a plan's fallback
    (reads only: a status must not settle staged attempts)."""
    root = run.attempts_dir
    numbered = [(int(m.group(1)), c) for c in root.glob("attempt_*") if (m := _NAME.match(c.name))]
    for _, folder in sorted(numbered, reverse=True):
        data = Attempt(folder, 0).read_json("fallback.json")
        if isinstance(data, dict):
            return data
    return None


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
