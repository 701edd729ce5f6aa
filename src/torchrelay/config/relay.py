"""The typed configuration of a run, and which of its fields are runtime-only (the rest is the contract)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torchrelay.config.tuning import LoadTuning, SaveTuning
from torchrelay.errors import ConfigError, IntegrityError, install_excepthook
from torchrelay.paths.rundir import RunDir
from torchrelay.util import schema
from torchrelay.util.records import read_json

SAMPLERS = ("shuffled", "length_bucketed")
ELASTIC_MODES = ("default", "exact")
# Fields with metadata `runtime` do not change the math: they may differ between segments (server paths, worker
# count, when to save, how long to run). Everything else, and every key of `params` not in `runtime_params`, is part
# of the resume contract.
RUNTIME = {"runtime": True}
_KEEP_WHY = "the newest complete checkpoint is never deleted and one more survives a crash during a save"
_ELASTIC_HINT = "exact: bit-for-bit equal across world sizes (docs/ELASTIC.md); default: DDP's own reduction"


@dataclass(kw_only=True, slots=True)
class RelayConfig:
    """What torchrelay needs to know about a run; `params` holds the user's own hyper-parameters."""

    seed: int = field(
        metadata={
            "min": 0,
            "why": "the global order is drawn by numpy's SeedSequence, which takes no negative seed",
        }
    )
    micro_batch: int = field(metadata={"min": 1})
    grad_accum: int = field(default=1, metadata={"min": 1})
    total_updates: int = field(metadata={"min": 1})
    warmup_updates: int = field(default=0, metadata={"min": 0})
    sampler: str = field(default="shuffled", metadata={"choices": SAMPLERS})
    # length_bucketed: global batches sorted by length within this many batches
    bucket_size: int = field(default=64, metadata={"min": 1})
    manifest: str = field(metadata={**RUNTIME, "doc": "the JSONL file listing the samples"})
    data_root: str = field(default="", metadata=RUNTIME)
    num_workers: int = field(default=0, metadata={**RUNTIME, "min": 0})
    save_every: int = field(default=100, metadata={**RUNTIME, "min": 1})
    # the newest complete checkpoints kept for resuming
    keep: int = field(default=2, metadata={**RUNTIME, "min": 2, "why": _KEEP_WHY})
    # also keep every checkpoint whose update is a multiple of this (0: none)
    keep_every: int = field(
        default=0, metadata={**RUNTIME, "min": 0, "why": "0: keep no periodic checkpoints"}
    )
    # also keep (and save) these updates
    keep_updates: list[int] = field(default_factory=list, metadata=RUNTIME)
    # the memory tier (checkpoint/tiers.py): also save every this many updates into node-local memory (/dev/shm),
    # with the durable tier's proof, resumed from first after a crash (0: no memory tier)
    memory_every: int = field(default=0, metadata={**RUNTIME, "min": 0, "why": "0: no memory tier"})
    # the newest memory checkpoints kept on the node
    memory_keep: int = field(default=1, metadata={**RUNTIME, "min": 1})
    # write, hash and commit checkpoints in the background (false: the loop waits)
    async_save: bool = field(default=True, metadata=RUNTIME)
    # "exact": gradients summed in one layout-free order (run/exact_reduce.py)
    elastic: str = field(default="default", metadata={"choices": ELASTIC_MODES, "hint": _ELASTIC_HINT})
    pins: list[str] = field(default_factory=list)
    external_files: dict[str, str] = field(default_factory=dict, metadata=RUNTIME)
    params: dict[str, Any] = field(default_factory=dict)
    runtime_params: list[str] = field(default_factory=list, metadata=RUNTIME)
    # Refuse a resume whose numerics identity (CPU capability, libraries, GPU, TF32, ...) differs from the earlier
    # segments' instead of warning (docs/NUMERICS.md). Runtime-only: a policy of where the run may continue, not
    # of its math, so it may be turned on or off at any launch.
    strict_numerics: bool = field(default=False, metadata=RUNTIME)
    # refuse any changed file of the code's tree, not only the program's (docs/CODE_IDENTITY.md); runtime: how
    # strictly a launch checks the code is no part of the math, and may tighten or loosen from one to the next
    strict_code: bool = field(default=False, metadata=RUNTIME)
    # how fast saves and loads go (config/tuning.py): no byte saved or loaded changes, so they may differ per segment
    save_tuning: SaveTuning = field(
        default_factory=SaveTuning,
        metadata={**RUNTIME, "doc": "threads and buffers of a save (docs/CONFIG.md)"},
    )
    load_tuning: LoadTuning = field(
        default_factory=LoadTuning,
        metadata={**RUNTIME, "doc": "threads and buffers of a load (docs/CONFIG.md)"},
    )

    def __post_init__(self) -> None:
        try:
            self._validate()
        except ConfigError:
            # only on the error path: a script's refusal reaches its user as one line (errors.py); building a
            # valid configuration changes nothing process-wide
            install_excepthook()
            raise

    def _validate(self) -> None:
        schema.check(self, "config")
        if self.warmup_updates > self.total_updates:
            raise ConfigError(
                f"config field 'warmup_updates' must be in [0, total_updates={self.total_updates}], "
                f"got {self.warmup_updates}"
            )
        if not all(1 <= u <= self.total_updates for u in self.keep_updates):
            raise ConfigError(
                f"config field 'keep_updates' must be a list of updates in [1, total_updates="
                f"{self.total_updates}], got {self.keep_updates!r}"
            )
        self.keep_updates = sorted(set(self.keep_updates))
        if not self.manifest:
            raise ConfigError("config field 'manifest' is required: the JSONL file listing the samples")
        missing = [k for k in self.runtime_params if k not in self.params]
        if missing:
            raise ConfigError(f"runtime_params names keys not in params: {missing}")
        try:
            json.dumps(self.params, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config 'params' must be plain JSON values (no NaN): {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of every field."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RelayConfig:
        """Build from a dict (YAML or JSON), naming unknown (with a did-you-mean), missing and mistyped fields."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        hint = f"torchrelay fields are {known}; put your own hyper-parameters under 'params'"
        try:
            return schema.build(cls, data, source, hint=hint)
        except ConfigError as exc:
            install_excepthook()  # as in __post_init__: its refusals too are one line
            if source == "config" or source in exc.message:
                raise
            raise ConfigError(f"{source}: {exc.message}", hint=exc.hint) from None  # say which file

    def replace(self, **changes: Any) -> RelayConfig:
        """A copy with some fields changed (re-validated)."""
        return RelayConfig.from_dict({**self.to_dict(), **changes})

    def with_overrides(self, overrides: dict[str, Any]) -> RelayConfig:
        """Apply `key=value` overrides; `params.lr` style keys reach into params."""
        data = self.to_dict()
        dotted = {}
        for key, value in overrides.items():
            if (
                key.partition(".")[0] in data
            ):  # a field, or a key under one (params.lr, external_files.teacher)
                dotted[key] = value
            elif key in data["params"]:
                dotted[f"params.{key}"] = value
            else:
                raise ConfigError(
                    f"override {key!r} names no config field",
                    hint="use a torchrelay field (e.g. num_workers) or params.<name>",
                )
        return self.with_dotted(dotted, source="overrides")

    def runtime_keys(self) -> list[str]:
        """Flat dotted keys that may change between segments without breaking the contract."""
        keys = [k for k in RUNTIME_FIELDS if k != "external_files"]
        keys += [f"external_files.{name}" for name in self.external_files]
        keys += [f"params.{name}" for name in self.runtime_params]
        return keys

    def is_runtime(self, key: str) -> bool:
        """Whether the dotted key may change between segments (the one rule: see `is_runtime_key`)."""
        return is_runtime_key(key, self.runtime_params)

    def with_dotted(self, values: dict[str, Any], source: str) -> RelayConfig:
        """A copy with dotted keys set (`data_root`, `params.lr`, `external_files.teacher`), re-validated."""
        data = self.to_dict()
        for key, value in values.items():
            head, _, tail = key.partition(".")
            if head not in data or (tail and not isinstance(data[head], dict)):
                raise ConfigError(
                    f"{source}: {key!r} names no config field",
                    hint="use a torchrelay field (e.g. num_workers) or params.<name>",
                )
            data[head] = {**data[head], tail: value} if tail else value
        return RelayConfig.from_dict(data, source=source)

    def global_batch_for(self, world_size: int) -> int:
        return self.micro_batch * self.grad_accum * world_size


# The runtime-only fields, in declaration order (records/contract.py drops them from the contract).
RUNTIME_FIELDS = schema.fields_with(RelayConfig, "runtime")


def stored_config(run_dir: RunDir) -> RelayConfig:
    """The stored (live) configuration of a run, with the manifest pointing into the run directory."""
    try:
        data = read_json(run_dir.config_path, what="the run's configuration")
    except FileNotFoundError as exc:
        raise IntegrityError(
            f"{run_dir.config_path} is missing: {run_dir.path} holds no torchrelay run"
        ) from exc
    if not isinstance(data, dict):
        raise IntegrityError(f"{run_dir.config_path} does not hold a JSON object")
    return RelayConfig.from_dict(data, source=str(run_dir.config_path))


def is_runtime_key(key: str, runtime_params: Iterable[str]) -> bool:
    """Whether a dotted configuration key may change between segments: a runtime field or a key under one
    (`external_files.teacher`), or a parameter `runtime_params` names (`params.lr`)."""
    head, _, tail = key.partition(".")
    return head in RUNTIME_FIELDS or (head == "params" and tail in set(runtime_params))


def parse_value(text: str) -> Any:
    """A `--set KEY=VALUE` value: JSON when it parses (numbers, true, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """Turn ['a=1', 'b=x'] into {'a': 1, 'b': 'x'}, refusing items without '='."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_value(value)
    return out
