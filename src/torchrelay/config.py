"""The typed configuration of a run, and which of its fields are runtime-only (the rest is the contract)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torchrelay.errors import ConfigError, install_excepthook

SAMPLERS = ("shuffled", "length_bucketed")
ELASTIC_MODES = ("default", "exact")

# Fields that do not change the math: they may differ between segments (server paths, worker count,
# when to save, how long to run). Everything else, and every key of `params` not in `runtime_params`,
# is part of the resume contract.
RUNTIME_FIELDS = (
    "manifest",
    "data_root",
    "num_workers",
    "save_every",
    "keep",
    "keep_every",
    "keep_updates",
    "async_save",
    "external_files",
    "runtime_params",
    "strict_code",
    "strict_numerics",
)


@dataclass(kw_only=True, slots=True)
class RelayConfig:
    """What torchrelay needs to know about a run; `params` holds the user's own hyper-parameters."""

    seed: int
    micro_batch: int
    grad_accum: int = 1
    total_updates: int
    warmup_updates: int = 0
    sampler: str = "shuffled"
    bucket_size: int = 64  # length_bucketed: global batches sorted by length within this many batches
    manifest: str
    data_root: str = ""
    num_workers: int = 0
    save_every: int = 100
    keep: int = 2  # the newest complete checkpoints kept for resuming
    keep_every: int = 0  # also keep every checkpoint whose update is a multiple of this (0: none)
    keep_updates: list[int] = field(default_factory=list)  # also keep (and save) these updates
    async_save: bool = True  # write, hash and commit checkpoints in the background (false: the loop waits)
    elastic: str = "default"  # "exact": gradients summed in one layout-free order (run/exact_reduce.py)
    pins: list[str] = field(default_factory=list)
    external_files: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    runtime_params: list[str] = field(default_factory=list)
    # Refuse a resume whose numerics identity (CPU capability, libraries, GPU, TF32, ...) differs from the earlier
    # segments' instead of warning (docs/NUMERICS.md). Runtime-only: a policy of where the run may continue, not
    # of its math, so it may be turned on or off at any launch.
    strict_numerics: bool = False
    # refuse any changed file of the code's tree, not only the program's (docs/CODE_IDENTITY.md); runtime: how
    # strictly a launch checks the code is no part of the math, and may tighten or loosen from one to the next
    strict_code: bool = False

    def __post_init__(self) -> None:
        install_excepthook()  # a refusal below reaches the script's user as one line (errors.py), not a traceback
        for name in ("seed", "micro_batch", "grad_accum", "total_updates", "warmup_updates", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
        for name in ("micro_batch", "grad_accum", "total_updates", "save_every", "bucket_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field {name!r} must be >= 1, got {getattr(self, name)!r}")
        if self.warmup_updates < 0 or self.warmup_updates > self.total_updates:
            raise ConfigError(
                f"config field 'warmup_updates' must be in [0, total_updates={self.total_updates}], "
                f"got {self.warmup_updates}"
            )
        if self.num_workers < 0:
            raise ConfigError(f"config field 'num_workers' must be >= 0, got {self.num_workers}")
        if self.keep < 2:
            raise ConfigError(
                f"config field 'keep' must be >= 2 (the newest complete checkpoint is never deleted "
                f"and one more survives a crash during a save), got {self.keep}"
            )
        for flag in ("async_save", "strict_code", "strict_numerics"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"config field {flag!r} must be true or false, got {getattr(self, flag)!r}")
        if not isinstance(self.keep_every, int) or isinstance(self.keep_every, bool) or self.keep_every < 0:
            raise ConfigError(
                f"config field 'keep_every' must be an integer >= 0 (0: keep no periodic checkpoints), "
                f"got {self.keep_every!r}"
            )
        if not isinstance(self.keep_updates, list) or not all(
            isinstance(u, int) and not isinstance(u, bool) and 1 <= u <= self.total_updates
            for u in self.keep_updates
        ):
            raise ConfigError(
                f"config field 'keep_updates' must be a list of updates in [1, total_updates="
                f"{self.total_updates}], got {self.keep_updates!r}"
            )
        self.keep_updates = sorted(set(self.keep_updates))
        if self.elastic not in ELASTIC_MODES:
            raise ConfigError(
                f"config field 'elastic' must be one of {ELASTIC_MODES}, got {self.elastic!r}",
                hint="exact: bit-for-bit equal across world sizes (docs/ELASTIC.md); default: DDP's own reduction",
            )
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"config field 'sampler' must be one of {SAMPLERS}, got {self.sampler!r}")
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
        """Build from a dict (YAML or JSON), naming unknown or missing fields."""
        install_excepthook()  # as in __post_init__: its refusals too are one line
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown field(s) {unknown}",
                hint=f"torchrelay fields are {sorted(known)}; put your own hyper-parameters under 'params'",
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        except ConfigError as exc:
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
            if key.startswith("params.") or key in data:
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
