"""Every `TORCHRELAY_*` environment variable torchrelay reads or sets: its type, default and meaning, in one place.

Modules read a variable through its `Var` here, at the moment they need it (never at import time), so one rule
holds for all: unset or empty is the default; a value that does not parse is a `ConfigError` naming the variable.
docs/ENVIRONMENT.md is generated from this module (`python -m torchrelay.config.envvars > docs/ENVIRONMENT.md`;
tests/test_schema.py checks that the committed page is the generated one).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchrelay.errors import ConfigError

_FLAG_TRUE = ("1", "true", "yes")
_FLAG_FALSE = ("0", "false", "no")
_WHAT = {
    "str": "text",
    "path": "a path",
    "int": "an integer",
    "float": "a number",
    "flag": "a flag (1 or 0)",
    "json": "a JSON object",
    "ints": "comma-separated integers",
}


@dataclass(frozen=True, slots=True, eq=False)  # identity: a Var is one declaration
class Var:
    """One environment variable: `kind` says how its text parses; `by` who sets it (you, torchrelay, tests)."""

    name: str
    kind: str
    default: Any
    doc: str
    by: str = "you"
    low: float | None = None  # a number (each of `ints`) at least this
    high: float | None = None  # and at most this
    above: float | None = None  # and more than this
    choices: tuple[str, ...] | None = None  # text: one of these

    def text(self, env: Mapping[str, str] | None = None) -> str | None:
        """The raw value, None when unset or empty."""
        value = (os.environ if env is None else env).get(self.name, "").strip()
        return value or None

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The parsed value, or the default when unset; a bad value raises one line naming the variable."""
        text = self.text(env)
        if text is None:
            return self.default.copy() if isinstance(self.default, list | dict) else self.default
        try:
            value = _parse(self.kind, text)
        except (ValueError, TypeError, RecursionError) as exc:
            raise ConfigError(
                f"{self.name}={_shown(text)} is not {_WHAT[self.kind]}", hint=f"{self.name}: {self.doc}"
            ) from exc
        problem = self.problem(value)
        if problem:
            raise ConfigError(f"{self.name}={_shown(text)} {problem}", hint=f"{self.name}: {self.doc}")
        return value

    def problem(self, value: Any) -> str | None:
        """Why a parsed value is out of this variable's range (or not one of its choices), or None."""
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, bool) or not isinstance(v, int | float):
                if self.choices is not None and v not in self.choices:
                    return f"is not one of {', '.join(self.choices)}"
                if isinstance(v, str) and len(v) > _TEXT_LIMIT:
                    return f"is longer than {_TEXT_LIMIT} characters"
                continue
            if self.above is not None and not v > self.above:
                return f"must be more than {_num(self.above)}"
            if self.low is not None and v < self.low:
                return f"must be at least {_num(self.low)}"
            if self.high is not None and v > self.high:
                return f"must be at most {_num(self.high)}"
        return None

    def what(self) -> str:
        """Its type and range in words, as docs/ENVIRONMENT.md shows them."""
        bounds = [
            *([f"> {_num(self.above)}"] if self.above is not None else []),
            *([f">= {_num(self.low)}"] if self.low is not None else []),
            *([f"<= {_num(self.high)}"] if self.high is not None else []),
        ]
        if self.choices:
            return f"one of {', '.join(f'`{c}`' for c in self.choices)}"
        return _WHAT[self.kind] + (f" ({', '.join(bounds)})" if bounds else "")

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.text(env) is not None


_TEXT_LIMIT = 1 << 16  # a path or a JSON object of overrides: far below, yet no megabyte echoed into records


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _shown(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def check(variables: tuple[Var, ...], env: Mapping[str, str] | None = None) -> None:
    """Read each of `variables` once: the first one unset-or-valid passes, a bad one raises its ConfigError."""
    for var in variables:
        var.get(env)


def _parse(kind: str, text: str) -> Any:
    if kind in ("str", "path"):
        if len(text) > _TEXT_LIMIT:
            raise ValueError(text[:80])
        return text
    if kind == "int":
        return int(text)
    if kind == "float":
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value
    if kind == "flag":
        if text.lower() in _FLAG_TRUE:
            return True
        if text.lower() in _FLAG_FALSE:
            return False
        raise ValueError(text)
    if kind == "json":
        if len(text) > _TEXT_LIMIT:
            raise ValueError(text[:80])
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(text)
        return value
    if kind == "ints":
        return [int(part) for part in text.split(",") if part.strip()]
    raise AssertionError(f"unknown kind {kind!r}")


# --- what a training launch reads (set them yourself, or the controller sets them) ------------------------------
RUN_DIR = Var(
    "TORCHRELAY_RUN_DIR", "path", None, "overrides the run directory a script passes to `Run.open` "
    "(and `RelayTrainer`'s output_dir): audits, smoke runs", by="you, the controller and the audit",
)  # fmt: skip
OVERRIDES = Var(
    "TORCHRELAY_OVERRIDES", "json", {}, 'config overrides, e.g. `{"num_workers": 2}` (on a resume only runtime '
    "fields may change)", by="you, the controller and the audit",
)  # fmt: skip
DEADLINE = Var(
    "TORCHRELAY_DEADLINE", "float", None, "unix time by which the process must have stopped with a complete "
    "checkpoint", by="you and the controller", low=0, high=1e12,
)  # fmt: skip
BUDGET_S = Var(
    "TORCHRELAY_BUDGET_S", "float", None, "the same as seconds from the job's start: the torchrun agent's start "
    "(restarts keep it), else the process's; the earliest of TORCHRELAY_DEADLINE, this and SLURM_JOB_END_TIME (set "
    "by newer Slurm) wins", above=0, high=1e8,
)  # fmt: skip
SAVE_ESTIMATE_S = Var(
    "TORCHRELAY_SAVE_ESTIMATE_S", "float", None, "a save-time estimate until the segment's first save is measured "
    "(the controller passes the smoke run's)", by="you and the controller", low=0, high=1e7,
)  # fmt: skip
MARGIN_S = Var(
    "TORCHRELAY_MARGIN_S",
    "float",
    1.0,
    "the in-run cost model's safety margin, in seconds",
    low=0,
    high=1e7,
)
CHECK_EVERY = Var(
    "TORCHRELAY_CHECK_EVERY",
    "int",
    64,
    "at most this many updates between stop agreements (the interval "
    "adapts so agreeing costs < 0.1 % of update time and a stop lands within about a second)",
    low=1,
    high=1 << 20,
)
LOCK_WAIT_S = Var(
    "TORCHRELAY_LOCK_WAIT_S", "float", 3.0, "how long a launch waits for the run's writer lock before refusing "
    "(one writer per run, see [FORMATS](FORMATS.md))", low=0, high=1e6,
)  # fmt: skip
RESHARD = Var(
    "TORCHRELAY_RESHARD", "flag", False, "this launch may continue the run on another layout (world size, "
    "`micro_batch` × `grad_accum`) with the same global batch, like `Run.open(reshard=True)`",
)  # fmt: skip
RESHARD_BY = Var(
    "TORCHRELAY_RESHARD_BY", "str", None, "who asked for the layout change TORCHRELAY_RESHARD allows (`launch "
    "--reshard`, a plan's in-place fallback): recorded as the move's `asked_by` in history.jsonl",
    by="the controller",
)  # fmt: skip
RECLAIM = Var(
    "TORCHRELAY_RECLAIM", "flag", False, "continue from (or pack) a checkpoint that `pack` handed off (the fork "
    "guard), on purpose: a new lineage, on record",
)  # fmt: skip
COLLECTIVE_TIMEOUT_S = Var(
    "TORCHRELAY_COLLECTIVE_TIMEOUT_S", "float", 300.0, "how long an exchange between ranks waits for the "
    "slowest rank: longer than any rank's legitimate lead within a phase (rank 0 alone opens the run directory), "
    "short enough that a hung peer ends the job in minutes instead of torch's default 30", above=0, high=1e7,
)  # fmt: skip
PERSIST_STREAMS = Var(
    "TORCHRELAY_PERSIST_STREAMS",
    "int",
    None,
    "files a rank writes at once in the background (default 8)",
    low=1,
    high=1024,
)
LEDGER_PROOF_BYTES = Var(
    "TORCHRELAY_LEDGER_PROOF_BYTES", "int", 16 << 20, "after a checkpoint's commit, rank 0 starts the ledger's "
    "background prover (a low-priority process that proves the exposure logs up to that checkpoint, so that "
    "`torchrelay ledger` reads only their tail) when the logs grew by more than this many bytes since the last one "
    "started; 0: at every checkpoint, a negative value: never",
)  # fmt: skip
PERSIST_WRITER = Var(
    "TORCHRELAY_PERSIST_WRITER", "str", "auto", "what writes an async save's files: `process` (a writer "
    "process per rank, so the training process's interpreter is left to the loop), `thread` (a thread of the "
    "training process, as before issue 22 goal 3) or `auto`: the process where the rank has at least 4 cores to "
    "itself (its start-up, an import of torch, would take a core from the ranks of a smaller host); without memfd "
    "or a process, the thread, with one logged line", choices=("auto", "process", "thread"),
)  # fmt: skip
PERSIST_KICK_BYTES = Var(
    "TORCHRELAY_PERSIST_KICK_BYTES", "int", None, "every this many bytes a persist's file has its writeback "
    "started (default 64 MiB; 0: left to the kernel until the file's fsync)", low=0, high=1 << 50,
)  # fmt: skip
RECYCLE = Var(
    "TORCHRELAY_RECYCLE", "flag", True, "keep the newest checkpoint retention retires as the run's spare, whose "
    "tensor files the next save writes over instead of allocating new ones (0: delete it; the spare is removed "
    "when the segment ends either way)",
)  # fmt: skip
MEMORY_ROOT = Var(
    "TORCHRELAY_MEMORY_ROOT", "path", None, "where the memory tier keeps its checkpoints on each node (default "
    "/dev/shm/torchrelay-<uid>, a folder of the user's own; a tmpfs: it must outlive the training processes; the "
    "folders torchrelay makes under it are made 0700 and must be the user's alone, docs/CHECKPOINTS.md)",
)  # fmt: skip
PERSIST_STALL_S = Var(
    "TORCHRELAY_PERSIST_STALL_S", "float", 300.0, "how long a rank's checkpoint write may go without progress "
    "(bytes handed to the kernel, a file fsynced, the kernel's writeback during an fsync) before it counts as "
    "stuck: a writer process is killed, a persist thread (which cannot be killed) is left and its process ends; "
    "either way the save fails on every rank, exit 1, the last complete checkpoint kept. A slow disk that "
    "progresses never trips it; the default, the collective timeout's, lets a stalled network file system recover",
)  # fmt: skip
# --- the controller (`torchrelay launch`) and the command line ------------------------------------------------
MEM_SOFT_GIB = Var(
    "TORCHRELAY_MEM_SOFT_GIB",
    "float",
    None,
    "the memory guard's soft limit in GiB (wins over the plan)",
    above=0,
    high=1 << 20,
)
MEM_HARD_GIB = Var(
    "TORCHRELAY_MEM_HARD_GIB",
    "float",
    None,
    "the memory guard's hard limit in GiB (wins over the plan)",
    above=0,
    high=1 << 20,
)
TRACEBACK = Var(
    "TORCHRELAY_TRACEBACK",
    "flag",
    False,
    "a CLI verb shows the traceback of an error instead of its one-line message",
)
# --- object stores (storage/s3.py; credentials come from the standard AWS chain, never from here) ---------------
S3_ENDPOINT = Var(
    "TORCHRELAY_S3_ENDPOINT", "str", None, "the S3-compatible endpoint URL of s3:// URLs (wins over "
    "AWS_ENDPOINT_URL; unset: AWS's own)",
)  # fmt: skip
DURABLE = Var(
    "TORCHRELAY_DURABLE", "str", None, "a store URL (s3://BUCKET/PREFIX) that holds the run's durable tier: each "
    "committed checkpoint is copied there, and a resume lacking the newest downloads it (docs/OBJECT_STORAGE.md)",
)  # fmt: skip
S3_ATTEMPTS = Var(
    "TORCHRELAY_S3_ATTEMPTS", "int", 5, "attempts of one store request that met throttling, a 5xx or a cut body "
    "(exponential backoff between them)",
)  # fmt: skip
# --- the audit, inside the audited script ------------------------------------------------------------------------
AUDIT_PROBE = Var(
    "TORCHRELAY_AUDIT_PROBE", "path", None, "the folder the audit's probe writes rank<r>.jsonl into; unset: off",
    by="the audit",
)  # fmt: skip
AUDIT_STREAMS_AT = Var(
    "TORCHRELAY_AUDIT_STREAMS_AT", "ints", [], "updates at which the probe records the random streams",
    by="the audit", low=0, high=1 << 40,
)  # fmt: skip
# --- given to a validation command (read by your command, never by torchrelay) ----------------------------------
CHECKPOINT = Var("TORCHRELAY_CHECKPOINT", "path", None, "the checkpoint to validate", by="the validate stage")
VALIDATION_METRICS = Var(
    "TORCHRELAY_VALIDATION_METRICS", "path", None, "where the command writes its JSON metrics",
    by="the validate stage",
)  # fmt: skip
VALIDATION_UPDATE = Var(
    "TORCHRELAY_VALIDATION_UPDATE",
    "int",
    None,
    "the checkpoint's update",
    by="the validate stage",
    low=0,
    high=1 << 40,
)
VALIDATION_RUN_DIR = Var(
    "TORCHRELAY_VALIDATION_RUN_DIR", "path", None, "the run directory", by="the validate stage"
)
VALIDATION_WEIGHTS = Var(
    "TORCHRELAY_VALIDATION_WEIGHTS", "path", None, "the exported weights, when the command names {weights}",
    by="the validate stage",
)  # fmt: skip
ALL = tuple(v for v in list(globals().values()) if isinstance(v, Var))
# What a training process reads, checked together when a run opens (run/opening.py): a bad one is refused there,
# before any rank talks to another (a negative TORCHRELAY_COLLECTIVE_TIMEOUT_S failed inside gloo on every rank).
TRAINING = (
    RUN_DIR, OVERRIDES, DEADLINE, BUDGET_S, SAVE_ESTIMATE_S, MARGIN_S, CHECK_EVERY, LOCK_WAIT_S, RESHARD, RECLAIM,
    COLLECTIVE_TIMEOUT_S, PERSIST_STREAMS, LEDGER_PROOF_BYTES, PERSIST_WRITER, PERSIST_KICK_BYTES, RECYCLE,
    AUDIT_PROBE, AUDIT_STREAMS_AT,
)  # fmt: skip


def markdown() -> str:
    """docs/ENVIRONMENT.md: every variable, its type, default and meaning."""
    lines = [
        "# Environment variables",
        "",
        "<!-- generated from src/torchrelay/config/envvars.py by `python -m torchrelay.config.envvars`; edit that module -->",
        "",
        "Every `TORCHRELAY_*` variable torchrelay reads or sets. Unset or empty means the default; a value that",
        "does not parse, or lies outside its range, stops with one line naming the variable (exit 2), on whichever",
        "rank finds it first. Flags take 1/true/yes or 0/false/no; text is at most 65,536 characters.",
        "",
        "| variable | type | default | set by | meaning |",
        "|---|---|---|---|---|",
    ]
    for var in ALL:
        default = (
            ""
            if var.default in (None, [], {})
            else f"`{int(var.default) if var.kind == 'flag' else var.default}`"
        )
        lines.append(f"| `{var.name}` | {var.what()} | {default} | {var.by} | {var.doc} |")
    lines += [
        "",
        "No variable arms a test hook: the crash tests' kill points are armed explicitly in the process they kill",
        "(`torchrelay.util.kill_points.arm`; the example `train_lm.py --kill-at`).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
