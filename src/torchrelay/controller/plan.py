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
fallbacks:                        # when the allocation has fewer devices per node than train.nproc_per_node
  - {name: gpu4, run_dir: runs/lm-4gpu, nproc_per_node: 4, args: [--config, configs/lm4.yaml]}
  - {name: gpu2, in_place: true, nproc_per_node: 2}   # the same run continued on 2 ranks, same global batch
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

from torchrelay.controller.slurm import NODES_LIMIT, PER_NODE_LIMIT, SlurmSpec
from torchrelay.errors import ConfigError, RecordError
from torchrelay.paths.rundir import RunDir
from torchrelay.util import schema
from torchrelay.util.dotted import flatten
from torchrelay.util.yaml_records import read_yaml

SMOKE_WHEN = ("always", "first", "never")
# Mappings whose keys are the user's own (config overrides, environment variables), not plan fields.
FREE_FORM = (("train", "overrides"), ("train", "env"), ("smoke", "overrides"), ("validate", "env"))
# Top-level keys starting with this are the plan writer's own (YAML anchors to reuse, `x-common: &common`, as in
# docker-compose): read past, never a field. Any other unknown key is still refused.
EXTENSION_PREFIX = "x-"
AT_LEAST_0 = {"min": 0}
AS_STR = {"as_str": True}  # YAML's `10` in argv or env is the string "10"
PROCS_PER_NODE = {"min": 1, "max": PER_NODE_LIMIT}  # each a process the launch starts: bounded before it does
NODES = {"min": 1, "max": NODES_LIMIT}
FRACTION = {"min": 0, "max": 1, "why": "a fraction of this host's RAM"}


@dataclass(kw_only=True, slots=True)
class CheckSpec:
    """A user preflight check: a shell command that must exit 0."""

    name: str
    run: str
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        schema.check(self, "plan.preflight.checks")
        if not self.name or not self.run.strip():
            raise ConfigError("plan preflight.checks: every check needs a non-empty 'name' and 'run'")


@dataclass(kw_only=True, slots=True)
class TrainSpec:
    """The training command: `torchrun [torchrun_args] script [args]` on every node."""

    script: str
    args: list[str] = field(default_factory=list, metadata=AS_STR)
    nproc_per_node: int = field(default=1, metadata=PROCS_PER_NODE)
    nnodes: int = field(default=1, metadata=NODES)
    torchrun_args: list[str] = field(default_factory=list, metadata=AS_STR)
    python: str = ""  # the interpreter that runs torchrun; empty: this one
    # start torchrun through srun and a per-node agent even on one node (always when nnodes > 1)
    srun: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict, metadata=AS_STR)
    # the formal run may continue the run on another world size with the same global batch (docs/ELASTIC.md)
    reshard: bool = False

    def __post_init__(self) -> None:
        schema.check(self, "plan.train")
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
    checkpoints_ahead: int = field(default=2, metadata=AT_LEAST_0)
    checks: list[CheckSpec] = field(default_factory=list)
    manifest: str = ""  # for a fresh run: the manifest (and data_root) whose files must exist
    data_root: str = ""

    def __post_init__(self) -> None:
        schema.check(self, "plan.preflight")
        names = [c.name for c in self.checks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"plan preflight.checks: check names must be unique, repeated: {dupes}")


@dataclass(kw_only=True, slots=True)
class SmokeSpec:
    """A few updates on all ranks in a throwaway run directory, before the formal run."""

    # always | first (until measurements exist) | never
    when: str = field(default="always", metadata={"choices": SMOKE_WHEN})
    updates: int = 3
    save_every: int = 2
    timeout_s: float = 600.0
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        schema.check(self, "plan.smoke")
        if self.updates < 2 or not 1 <= self.save_every <= self.updates:
            raise ConfigError(
                f"plan smoke: need updates >= 2 and 1 <= save_every <= updates "
                f"(one update to time, one save to time), got updates={self.updates} save_every={self.save_every}"
            )


@dataclass(kw_only=True, slots=True)
class BudgetSpec:
    """The safety margin of the cost model, and estimates used before anything was measured."""

    margin_s: float = field(default=10.0, metadata=AT_LEAST_0)
    update_s: float = field(default=0.0, metadata=AT_LEAST_0)
    save_s: float = field(default=0.0, metadata=AT_LEAST_0)
    startup_s: float = field(default=0.0, metadata=AT_LEAST_0)

    def __post_init__(self) -> None:
        schema.check(self, "plan.budget")


@dataclass(kw_only=True, slots=True)
class MemorySpec:
    """Host-memory guard of the training process tree; GiB values win over fractions of RAM."""

    soft_fraction: float = field(default=0.9, metadata=FRACTION)
    hard_fraction: float = field(default=0.97, metadata=FRACTION)
    soft_gib: float = field(default=0.0, metadata=AT_LEAST_0)
    hard_gib: float = field(default=0.0, metadata=AT_LEAST_0)
    poll_s: float = field(default=1.0, metadata=AT_LEAST_0)

    def __post_init__(self) -> None:
        schema.check(self, "plan.memory")
        if self.poll_s <= 0:
            raise ConfigError(f"plan memory: 'poll_s' must be > 0, got {self.poll_s}")


@dataclass(kw_only=True, slots=True)
class FallbackSpec:
    """Another configuration for an allocation with fewer devices per node than `train` needs.

    A run of its own in its own run directory (its own contract), or with `in_place` the primary's run continued
    on fewer ranks with the same global batch (grad_accum derived; a move recorded in history.jsonl,
    docs/ELASTIC.md). args, overrides: the primary's unless given.
    """

    name: str
    run_dir: str = ""
    nproc_per_node: int = field(metadata=PROCS_PER_NODE)
    in_place: bool = False
    args: list[str] | None = None
    overrides: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to train.env

    def __post_init__(self) -> None:
        schema.check(self, "plan.fallbacks")
        if not self.name or not (self.run_dir or self.in_place):
            raise ConfigError(
                "plan fallbacks: every fallback needs a 'name', and its own 'run_dir' or 'in_place: true'"
            )


EXPORT_KEYS = ("dtype", "drop", "rename", "include")
_UPDATES_SCHEMA = {
    "anyOf": [{"const": "kept"}, {"type": "array", "items": {"type": "integer", "minimum": 1}}]
}
_EXPORT_SCHEMA = {
    "anyOf": [
        {"type": "boolean"},
        {"type": "object", "properties": {k: {} for k in EXPORT_KEYS}, "additionalProperties": False},
    ]
}


@dataclass(kw_only=True, slots=True)
class ValidateSpec:
    """After the formal run exits (finished or stopped): a command on each named checkpoint not validated yet."""

    run: str = ""  # shell command in workdir; {checkpoint} {metrics} {update} {run_dir}; empty: no stage
    # a list of updates, or "kept": every complete checkpoint
    updates: Any = field(default="kept", metadata={"json_schema": _UPDATES_SCHEMA})
    # fail one validation after this long (0: only the deadline limits it)
    timeout_s: float = field(default=0.0, metadata=AT_LEAST_0)
    # seconds one validation takes, until one was measured (the cost model's input)
    estimate_s: float = field(default=0.0, metadata=AT_LEAST_0)
    env: dict[str, str] = field(default_factory=dict, metadata=AS_STR)
    # Export the checkpoint's weights for the command ({weights}): true, or options {dtype, drop, rename, include}
    export: bool | dict[str, Any] = field(default=False, metadata={"json_schema": _EXPORT_SCHEMA})

    def __post_init__(self) -> None:
        from torchrelay.records.validation import parse_updates

        schema.check(self, "plan.validate")
        parse_updates(self.updates, "plan validate.updates")
        if isinstance(self.export, dict):
            unknown = sorted(set(self.export) - set(EXPORT_KEYS))
            if unknown:
                raise ConfigError(
                    f"plan validate.export: unknown field(s) {unknown}", hint=f"known: {EXPORT_KEYS}"
                )

    @property
    def update_list(self) -> list[int] | None:
        """The named updates, or None for every kept checkpoint."""
        from torchrelay.records.validation import parse_updates

        return parse_updates(self.updates, "plan validate.updates")


@dataclass(kw_only=True, slots=True)
class Plan:
    """A resolved plan: absolute paths, every stage typed; `to_dict()` is what an attempt records."""

    run_dir: str = field(metadata={"doc": "the run directory the training writes"})
    workdir: str = "."
    train: TrainSpec
    preflight: PreflightSpec = field(default_factory=PreflightSpec)
    smoke: SmokeSpec = field(default_factory=SmokeSpec)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    validate: ValidateSpec = field(default_factory=ValidateSpec)
    name: str = ""
    fallbacks: list[FallbackSpec] = field(default_factory=list)
    # set on the plan `for_devices` derived from a fallback: which one, of which plan, and why
    fallback_of: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        schema.check(self, "plan")
        if not self.run_dir:
            raise ConfigError("plan: 'run_dir' is required: the run directory the training writes")
        if not self.name:
            self.name = Path(self.run_dir).name
        names = [f.name for f in self.fallbacks]
        for f in self.fallbacks:
            if names.count(f.name) > 1:
                raise ConfigError(f"plan fallbacks: names must be unique, {f.name!r} is repeated")
            if f.in_place and f.run_dir and Path(f.run_dir) != Path(self.run_dir):
                raise ConfigError(
                    f"plan fallbacks[{f.name!r}]: in_place continues the primary's run, but run_dir names "
                    f"{f.run_dir}",
                    hint="drop its run_dir (in place), or drop in_place (a run of its own)",
                )
            if not f.in_place and Path(f.run_dir) == Path(self.run_dir):
                raise ConfigError(
                    f"plan fallbacks[{f.name!r}]: its run_dir is the primary's; a fallback is a new run",
                    hint="give it a run directory of its own (its contract differs: another rank count)",
                )
            if f.nproc_per_node >= self.train.nproc_per_node:
                raise ConfigError(
                    f"plan fallbacks[{f.name!r}]: nproc_per_node {f.nproc_per_node} is not fewer than "
                    f"train.nproc_per_node {self.train.nproc_per_node}"
                )

    def for_devices(self, devices: int | None) -> Plan:
        """The plan to run on `devices` per node (None: unknown, the primary): this one, or its first fallback that
        fits, as a plan of its own; refused when none fits."""
        need = self.train.nproc_per_node
        if devices is None or devices >= need:
            return self
        fits = next((f for f in self.fallbacks if f.nproc_per_node <= devices), None)
        if fits is None:
            offered = [f.nproc_per_node for f in self.fallbacks]
            raise ConfigError(
                f"plan {self.name}: the allocation has {devices} device(s) per node, train.nproc_per_node needs "
                f"{need}" + (f" and no fallback fits (they need {offered})" if offered else ""),
                hint="run in a larger allocation, or add a fallback with fewer ranks (plan field 'fallbacks')",
            )
        t = self.train
        train = dataclasses.replace(
            t,
            nproc_per_node=fits.nproc_per_node,
            args=list(fits.args) if fits.args is not None else list(t.args),
            overrides=dict(fits.overrides) if fits.overrides is not None else dict(t.overrides),
            env={**t.env, **fits.env},
            reshard=t.reshard or fits.in_place,
        )
        why = {
            "fallback": fits.name,
            "plan": self.name,
            "primary_run_dir": self.run_dir,
            "primary_nproc_per_node": need,
            "devices": devices,
            "nproc_per_node": fits.nproc_per_node,
            **({"in_place": True} if fits.in_place else {}),
        }
        run_dir = self.run_dir if fits.in_place else fits.run_dir
        return dataclasses.replace(
            self, run_dir=run_dir, name=fits.name, train=train, fallbacks=[], fallback_of=why
        )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def run(self) -> RunDir:
        """The run directory this plan trains, as the path model every reader of it takes."""
        return RunDir(self.run_dir)

    def check_run_dir(self) -> None:
        """Refuse a run_dir that could not become this plan's run, before anything is written beside it (the
        controller's lock and attempts, the batch script): a file, or a directory that holds no torchrelay run and
        more than may come before one (what the training itself would refuse, after the launch wrote there)."""
        rd = self.run
        if not os.path.lexists(rd.path) or (rd.path.is_dir() and rd.exists()):
            return
        if not rd.path.is_dir():
            raise ConfigError(
                f"plan run_dir {rd.path} is not a directory",
                hint="name a new or empty directory, or the run directory of a run (plan field 'run_dir')",
            )
        leftovers = rd.unexplained_entries()[:5]
        if leftovers:
            raise ConfigError(
                f"plan run_dir {rd.path} is not empty ({leftovers}) and holds no torchrelay run",
                hint="name a new or empty directory, or the run directory of a run (plan field 'run_dir')",
            )

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
        data = {k: copy.deepcopy(v) for k, v in data.items() if not _is_extension(k)}
        base = Path(base_dir).resolve()
        for key in ("run_dir", "workdir"):
            if isinstance(data.get(key), str):
                data[key] = str((base / os.path.expandvars(data[key])).resolve())
        for fb in data.get("fallbacks") or []:
            if isinstance(fb, dict) and isinstance(fb.get("run_dir"), str) and fb["run_dir"]:
                fb["run_dir"] = str((base / os.path.expandvars(fb["run_dir"])).resolve())
        if "workdir" not in data:
            data["workdir"] = str(base)
        if "train" not in data:
            raise ConfigError(f"{source}: 'train' is required (script, args, nproc_per_node)")
        return schema.build(cls, data, source)


def _is_extension(key: Any) -> bool:
    """A top-level `x-...` key: the writer's own (anchors), ignored."""
    return isinstance(key, str) and key.startswith(EXTENSION_PREFIX)


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
