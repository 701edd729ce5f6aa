"""A launch plan (YAML): the training command, the run directory and the stages, typed and validated.

```yaml
run_dir: runs/lm                  # relative paths are relative to the plan file's folder
workdir: .                        # where the training command runs (its code directory)
train:
  script: examples/train_lm.py
  args: [--run-dir, runs/lm]
  nproc_per_node: 2
  nnodes: 1                       # >1 only inside a Slurm allocation (srun starts one torchrun per node)
  overrides: {num_workers: 0}     # TORCHRELAY_OVERRIDES of the formal run
  env: {OMP_NUM_THREADS: "1"}
preflight:
  checkpoints_ahead: 2            # free disk for this many more checkpoints
  checks: [{name: mask-cache, run: "python tools/check_cache.py", timeout_s: 600}]
smoke: {when: always, updates: 3, save_every: 2, timeout_s: 600}
budget: {margin_s: 10}
memory: {soft_fraction: 0.9, hard_fraction: 0.97}
slurm: {time: "04:00:00", nodes: 1, gpus_per_node: 8, signal_s: 300}
validate: {run: "python tools/validate.py --checkpoint {checkpoint} --out {metrics}", updates: [4000, 8000]}
```
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError, RecordError
from torchrelay.util.dotted import flatten
from torchrelay.util.records import read_yaml

SMOKE_WHEN = ("always", "first", "never")
# Mappings whose keys are the user's own (config overrides, environment variables), not plan fields.
FREE_FORM = (("train", "overrides"), ("train", "env"), ("smoke", "overrides"), ("validate", "env"))


def _check_type(source: str, name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise ConfigError(f"{source}: field {name!r} must be {_kind_name(kind)}, got {value!r}")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@dataclass(kw_only=True, slots=True)
class CheckSpec:
    """A user preflight check: a shell command that must exit 0."""

    name: str
    run: str
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check_type("plan preflight.checks", "name", self.name, str)
        _check_type(f"plan preflight check {self.name!r}", "run", self.run, str)
        _check_type(f"plan preflight check {self.name!r}", "timeout_s", self.timeout_s, (int, float))
        if not self.name or not self.run.strip():
            raise ConfigError("plan preflight.checks: every check needs a non-empty 'name' and 'run'")


@dataclass(kw_only=True, slots=True)
class TrainSpec:
    """The training command: `torchrun [torchrun_args] script [args]` on every node."""

    script: str
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    torchrun_args: list[str] = field(default_factory=list)
    python: str = ""  # the interpreter that runs torchrun; empty: this one
    srun: bool = (
        False  # start torchrun through srun and a per-node agent even on one node (always when nnodes > 1)
    )
    overrides: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        src = "plan train"
        _check_type(src, "script", self.script, str)
        for name in ("nproc_per_node", "nnodes"):
            _check_type(src, name, getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ConfigError(f"{src}: field {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ("args", "torchrun_args"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(a, str | int | float) for a in value):
                raise ConfigError(f"{src}: field {name!r} must be a list of strings, got {value!r}")
            setattr(self, name, [str(a) for a in value])
        _check_type(src, "overrides", self.overrides, dict)
        _check_type(src, "env", self.env, dict)
        _check_type(src, "srun", self.srun, bool)
        self.env = {str(k): str(v) for k, v in self.env.items()}
        if not self.python:
            self.python = sys.executable

    @property
    def uses_srun(self) -> bool:
        return self.srun or self.nnodes > 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass(kw_only=True, slots=True)
class PreflightSpec:
    checkpoints_ahead: int = 2
    checks: list[CheckSpec] = field(default_factory=list)
    manifest: str = ""  # for a fresh run: the manifest (and data_root) whose files must exist
    data_root: str = ""

    def __post_init__(self) -> None:
        _check_type("plan preflight", "checkpoints_ahead", self.checkpoints_ahead, int)
        if self.checkpoints_ahead < 0:
            raise ConfigError(
                f"plan preflight: 'checkpoints_ahead' must be >= 0, got {self.checkpoints_ahead}"
            )
        if not isinstance(self.checks, list):
            raise ConfigError(f"plan preflight: 'checks' must be a list, got {self.checks!r}")
        self.checks = [
            c if isinstance(c, CheckSpec) else _build(CheckSpec, c, "preflight.checks") for c in self.checks
        ]
        names = [c.name for c in self.checks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"plan preflight.checks: check names must be unique, repeated: {dupes}")


@dataclass(kw_only=True, slots=True)
class SmokeSpec:
    """A few updates on all ranks in a throwaway run directory, before the formal run."""

    when: str = "always"  # always | first (until measurements exist) | never
    updates: int = 3
    save_every: int = 2
    timeout_s: float = 600.0
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.when not in SMOKE_WHEN:
            raise ConfigError(f"plan smoke: 'when' must be one of {SMOKE_WHEN}, got {self.when!r}")
        for name in ("updates", "save_every"):
            _check_type("plan smoke", name, getattr(self, name), int)
        if self.updates < 2 or not 1 <= self.save_every <= self.updates:
            raise ConfigError(
                f"plan smoke: need updates >= 2 and 1 <= save_every <= updates "
                f"(one update to time, one save to time), got updates={self.updates} save_every={self.save_every}"
            )
        _check_type("plan smoke", "timeout_s", self.timeout_s, (int, float))
        _check_type("plan smoke", "overrides", self.overrides, dict)


@dataclass(kw_only=True, slots=True)
class BudgetSpec:
    """The safety margin of the cost model, and estimates used before anything was measured."""

    margin_s: float = 10.0
    update_s: float = 0.0
    save_s: float = 0.0
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("margin_s", "update_s", "save_s", "startup_s"):
            _check_type("plan budget", name, getattr(self, name), (int, float))
            if getattr(self, name) < 0:
                raise ConfigError(f"plan budget: {name!r} must be >= 0, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class MemorySpec:
    """Host-memory guard of the training process tree; GiB values win over fractions of RAM."""

    soft_fraction: float = 0.9
    hard_fraction: float = 0.97
    soft_gib: float = 0.0
    hard_gib: float = 0.0
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("soft_fraction", "hard_fraction", "soft_gib", "hard_gib", "poll_s"):
            _check_type("plan memory", name, getattr(self, name), (int, float))
            if getattr(self, name) < 0:
                raise ConfigError(f"plan memory: {name!r} must be >= 0, got {getattr(self, name)}")
        if self.poll_s <= 0:
            raise ConfigError(f"plan memory: 'poll_s' must be > 0, got {self.poll_s}")


@dataclass(kw_only=True, slots=True)
class SlurmSpec:
    """What `torchrelay sbatch` asks Slurm for; command-line flags override these."""

    time: str = "01:00:00"
    nodes: int = 0  # 0: train.nnodes
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str = ""
    partition: str = ""
    account: str = ""
    job_name: str = ""
    signal_s: int = 120
    max_requeues: int = 20
    output: str = ""  # log file; default RUN_DIR/slurm-%j.out (appended to by every requeued run)
    extra: list[str] = field(default_factory=list)  # more `#SBATCH` options, e.g. ["--exclusive"]

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpus_per_task", "signal_s", "max_requeues"):
            _check_type("plan slurm", name, getattr(self, name), int)
            if getattr(self, name) < 0:
                raise ConfigError(f"plan slurm: {name!r} must be >= 0, got {getattr(self, name)}")
        self.time = str(self.time)
        if not isinstance(self.extra, list):
            raise ConfigError(f"plan slurm: 'extra' must be a list of sbatch options, got {self.extra!r}")


EXPORT_KEYS = ("dtype", "drop", "rename", "include")


@dataclass(kw_only=True, slots=True)
class ValidateSpec:
    """After the formal run exits (finished or stopped): a command on each named checkpoint not validated yet."""

    run: str = ""  # shell command in workdir; {checkpoint} {metrics} {update} {run_dir}; empty: no stage
    updates: Any = "kept"  # a list of updates, or "kept": every complete checkpoint
    timeout_s: float = 0.0  # fail one validation after this long (0: only the deadline limits it)
    estimate_s: float = 0.0  # seconds one validation takes, until one was measured (the cost model's input)
    env: dict[str, str] = field(default_factory=dict)
    # Export the checkpoint's weights for the command ({weights}): true, or options {dtype, drop, rename, include}
    export: Any = False

    def __post_init__(self) -> None:
        from torchrelay.validation_records import parse_updates

        _check_type("plan validate", "run", self.run, str)
        parse_updates(self.updates, "plan validate.updates")
        for name in ("timeout_s", "estimate_s"):
            _check_type("plan validate", name, getattr(self, name), (int, float))
            if getattr(self, name) < 0:
                raise ConfigError(f"plan validate: {name!r} must be >= 0, got {getattr(self, name)}")
        _check_type("plan validate", "env", self.env, dict)
        self.env = {str(k): str(v) for k, v in self.env.items()}
        _check_type("plan validate", "export", self.export, (bool, dict))
        if isinstance(self.export, dict):
            unknown = sorted(set(self.export) - set(EXPORT_KEYS))
            if unknown:
                raise ConfigError(
                    f"plan validate.export: unknown field(s) {unknown}", hint=f"known: {EXPORT_KEYS}"
                )

    @property
    def update_list(self) -> list[int] | None:
        """The named updates, or None for every kept checkpoint."""
        from torchrelay.validation_records import parse_updates

        return parse_updates(self.updates, "plan validate.updates")


@dataclass(kw_only=True, slots=True)
class Plan:
    """A resolved plan: absolute paths, every stage typed; `to_dict()` is what an attempt records."""

    run_dir: str
    workdir: str = "."
    train: TrainSpec
    preflight: PreflightSpec = field(default_factory=PreflightSpec)
    smoke: SmokeSpec = field(default_factory=SmokeSpec)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    validate: ValidateSpec = field(default_factory=ValidateSpec)
    name: str = ""

    def __post_init__(self) -> None:
        _check_type("plan", "run_dir", self.run_dir, str)
        if not self.run_dir:
            raise ConfigError("plan: 'run_dir' is required: the run directory the training writes")
        if not self.name:
            self.name = Path(self.run_dir).name

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def work_path(self) -> Path:
        return Path(self.workdir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | os.PathLike[str], source: str = "plan") -> Plan:
        """Build from a parsed YAML mapping; relative paths are made absolute against `base_dir`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a plan must be a YAML mapping, got {type(data).__name__}")
        data = copy.deepcopy(data)
        base = Path(base_dir).resolve()
        for key in ("run_dir", "workdir"):
            if isinstance(data.get(key), str):
                data[key] = str((base / os.path.expandvars(data[key])).resolve())
        if "workdir" not in data:
            data["workdir"] = str(base)
        if "train" not in data:
            raise ConfigError(f"{source}: 'train' is required (script, args, nproc_per_node)")
        sections = {
            "train": TrainSpec,
            "preflight": PreflightSpec,
            "smoke": SmokeSpec,
            "budget": BudgetSpec,
            "memory": MemorySpec,
            "slurm": SlurmSpec,
            "validate": ValidateSpec,
        }
        for key, spec in sections.items():
            if key in data and not isinstance(data[key], spec):
                data[key] = _build(spec, data[key] if data[key] is not None else {}, key, source)
        return _build(cls, data, "", source)


def _build(cls: Any, data: Any, section: str, source: str = "plan") -> Any:
    where = f"{source} {section}".strip()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping, got {data!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}", hint=f"known fields: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def apply_sets(data: dict[str, Any], sets: dict[str, Any]) -> dict[str, Any]:
    """Apply `--set a.b.c=value` assignments to a raw plan mapping (a copy is returned)."""
    out = copy.deepcopy(data)
    for key, value in sets.items():
        parts = key.split(".")
        for (
            section
        ) in FREE_FORM:  # their keys are dotted themselves: train.overrides.params.lr -> "params.lr"
            if tuple(parts[: len(section)]) == section and len(parts) > len(section) + 1:
                parts = [*section, ".".join(parts[len(section) :])]
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section of the plan (it is {child!r})")
            node = child
        node[parts[-1]] = value
    return out


def read_plan_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw mapping of a plan file, with the file named in any error."""
    p = Path(path)
    try:
        data = read_yaml(
            p, what="plan file", follow=True
        )  # bounded size and depth: one line for a hostile plan
    except FileNotFoundError as exc:
        raise ConfigError(f"plan file {p} does not exist", hint="pass the path of a plan YAML") from exc
    except RecordError as exc:
        raise ConfigError(exc.message, hint=exc.hint) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"plan file {p} must hold a mapping (run_dir, train, ...), got {type(data).__name__}"
        )
    return data


def load_plan(path: str | os.PathLike[str], sets: dict[str, Any] | None = None) -> Plan:
    """Read a plan file, apply `--set` overrides and resolve it."""
    p = Path(path)
    return Plan.from_dict(apply_sets(read_plan_file(p), sets or {}), p.resolve().parent, source=f"plan {p}")


def plan_diff(frozen: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """[(dotted key, frozen value, current value)] for every key that differs."""
    a, b = flatten(frozen, keep_empty=False), flatten(current, keep_empty=False)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            out.append((key, None if va is missing else va, None if vb is missing else vb))
    return out
