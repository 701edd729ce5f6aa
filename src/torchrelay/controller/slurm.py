"""Slurm: the time a job has left, its hosts, and the self-requeueing batch script that runs a plan.

The batch script asks for a warning signal to the batch shell (`--signal=B:USR1@SECONDS`: without `B:` only job
steps would get it), traps it and forwards it to the controller, which forwards it to the training ranks; they save
and exit 5. A clean stop that did not finish the run (controller exit 3 or 5) requeues the job with
`scontrol requeue`; the requeued job appends to the same log and resumes, one history segment per job.

Every value a plan or a flag puts into the script is hostile until checked: a control character is refused (a
newline ends an `#SBATCH` line and the next one runs in the job); an `#SBATCH` value is written as sbatch's own
parser of those lines reads it back (`directive_value`), a line of the shell body through `shlex.quote`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from torchrelay.errors import EXIT_BUDGET, EXIT_SIGNAL, ConfigError, RelayError
from torchrelay.util import schema

Runner = Callable[[Sequence[str]], str]
REQUEUE_CODES = (EXIT_BUDGET, EXIT_SIGNAL)
STALE_WARNING_S = 10
# Bounds of a count a plan or a flag gives (processes or devices of one node, nodes of a job): past any machine's,
# so only a slip (`1e23`, a negative) meets them, before it starts that many processes.
PER_NODE_LIMIT = 1024
NODES_LIMIT = 65_536
PER_NODE = {"min": 0, "max": PER_NODE_LIMIT}
# sbatch reads `#SBATCH` lines itself, without a shell (src/sbatch/opt.c, `_get_argument`): whitespace ends an
# argument, `"` and `'` quote (older releases: `"` only), a backslash escapes the next character (inside quotes
# too), an unquoted `#` starts a comment (older releases: a `#` anywhere), and a line holding `hetjob` or `packjob`
# anywhere, in any case, starts another component of a heterogeneous job. A value with none of these is written as
# it is; one with a space, a quoting or a non-ASCII character inside `"..."`, each of `\ " ' #` escaped (read back
# the same by either parser); one naming a component is refused.
_DIRECTIVE_QUOTED = frozenset("\\\"'#")
_COMPONENT_WORDS = ("hetjob", "packjob")
DIRECTIVE_LIMIT = 4096  # characters of one value: a path at most (PATH_MAX), far past any name or size
_EXTRA_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SlurmError(RelayError):
    """A Slurm command failed or answered something unexpected."""


def _shown(value: str, limit: int = 60) -> str:
    """`value` as a refusal shows it: quoted, its control characters escaped, a long one cut."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def refuse_control(value: str, where: str) -> str:
    """`value`, refused (one line naming `where`) when it holds a control character: C0 (a newline, a carriage
    return, NUL), DEL, C1, or a Unicode line or paragraph separator."""
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise ConfigError(
            f"{where} {_shown(value)} holds the control character {bad!r}, which no line of a batch script can "
            "hold (a newline would end it, and the rest run as a command)",
            hint=f"remove it from {where}",
        )
    return value


def directive_value(value: str, where: str) -> str:
    """`value` written for an `#SBATCH` line, as sbatch's own parser reads it back as one argument (see
    _DIRECTIVE_QUOTED); refused, naming `where`, when no writing can: a control character, a component word,
    a value longer than any path."""
    refuse_control(value, where)
    if len(value) > DIRECTIVE_LIMIT:
        raise ConfigError(f"{where} is {len(value):,} characters long, more than {DIRECTIVE_LIMIT:,}")
    word = next((w for w in _COMPONENT_WORDS if w in value.lower()), None)
    if word is not None:
        raise ConfigError(
            f"{where} {_shown(value)} holds {word!r}, which sbatch reads in an #SBATCH line as the start "
            "of another component of a heterogeneous job",
            hint=f"choose another value for {where}",
        )
    # non-ASCII too: in a single-byte locale sbatch's isspace() may take a byte of its UTF-8 for a space
    if not any(c.isspace() or not c.isascii() or c in _DIRECTIVE_QUOTED for c in value):
        return value
    return '"' + "".join("\\" + c if c in _DIRECTIVE_QUOTED else c for c in value) + '"'


def extra_directive(option: str, where: str) -> str:
    """One `slurm.extra` item (`--exclusive`, `--constraint=a100`) as one `#SBATCH` argument: the option's name as
    it is, its value through `directive_value`."""
    name, eq, value = option.partition("=")
    refuse_control(option, where)
    if not _EXTRA_OPTION.fullmatch(name):
        raise ConfigError(
            f"{where} {_shown(option)} is not one sbatch option (--name or --name=value)",
            hint="one option per item, its value after '=': --constraint=a100, not -C a100",
        )
    return name + (eq + directive_value(value, where) if eq else "")


def run_command(argv: Sequence[str]) -> str:
    """Run a Slurm client command and return its stdout; the error names the command and its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise SlurmError(
            f"{argv[0]} is not installed here", hint="run on a Slurm login or compute node"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{shlex.join(argv)} did not answer within 60 s") from exc
    if proc.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or None


def parse_end_time(text: str) -> float | None:
    """squeue's `%e` (local time, no zone; 'N/A' or 'Unknown' without a limit) as unix seconds."""
    text = text.strip()
    if not text or text in ("N/A", "Unknown", "NONE", "INVALID"):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError as exc:
        raise SlurmError(f"squeue printed end time {text!r}, not YYYY-MM-DDTHH:MM:SS") from exc


def job_end_time(job: str, runner: Runner = run_command) -> float | None:
    """When the job's time limit ends (Slurm 22.05 has no SLURM_JOB_END_TIME, so ask squeue)."""
    return parse_end_time(runner(["squeue", "-h", "-j", job, "-o", "%e"]))


def hostnames(nodelist: str, runner: Runner = run_command) -> list[str]:
    """Expand a Slurm node list (`gpu[01-04]`) with `scontrol show hostnames`."""
    return [h for h in runner(["scontrol", "show", "hostnames", nodelist]).split() if h]


def rendezvous(env: Mapping[str, str] | None = None, runner: Runner = run_command) -> tuple[str, int, int]:
    """(master address, master port, number of nodes) of the current allocation."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job = env.get("SLURM_JOB_ID")
    if not nodelist or not job:
        raise SlurmError(
            "multi-node training needs a Slurm allocation (SLURM_JOB_NODELIST and SLURM_JOB_ID are not set)",
            hint="submit with `torchrelay sbatch`, or set train.nnodes: 1",
        )
    hosts = hostnames(nodelist, runner)
    # One port per job so two jobs sharing a first node do not collide.
    return hosts[0], 20000 + int("".join(c for c in job if c.isdigit()) or "0") % 20000, len(hosts)


@dataclass(kw_only=True, slots=True)
class SlurmSpec:
    """What `torchrelay sbatch` asks Slurm for (a plan's `slurm` section); command-line flags override these."""

    time: str = field(default="01:00:00", metadata={"as_str": True})
    nodes: int = field(default=0, metadata={"min": 0, "max": NODES_LIMIT, "doc": "0: train.nnodes"})
    gpus_per_node: int = field(default=0, metadata=PER_NODE)
    cpus_per_task: int = field(default=0, metadata=PER_NODE)
    mem: str = ""
    partition: str = ""
    account: str = ""
    job_name: str = ""
    signal_s: int = field(default=120, metadata={"min": 0})
    max_requeues: int = field(default=20, metadata={"min": 0})
    output: str = ""  # log file; default RUN_DIR/slurm-%j.out (appended to by every requeued run)
    extra: list[str] = field(default_factory=list)  # more `#SBATCH` options, e.g. ["--exclusive"]

    def __post_init__(self) -> None:
        schema.check(self, "plan.slurm")


@dataclass(kw_only=True, slots=True)
class BatchSpec(SlurmSpec):
    """Everything the batch script needs: the plan's `slurm` section with the command-line flags applied, and
    how to start the controller."""

    plan_path: Path
    run_dir: Path
    workdir: Path
    # resolved: never "0: train.nnodes"
    nodes: int = field(default=1, metadata={"min": 1, "max": NODES_LIMIT})
    job_name: str = "torchrelay"
    sets: list[str] = field(default_factory=list)  # `--set KEY=VALUE` passed on to every launch
    launch_args: list[str] = field(default_factory=list)  # more `torchrelay launch` flags
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        schema.check(self, "sbatch")
        self._check_text()
        if self.signal_s < 1:
            raise ConfigError(
                f"sbatch: the warning signal must come >= 1 s before the end, got {self.signal_s}"
            )
        minutes = time_limit_minutes(self.time)
        if minutes * 60 <= self.signal_s:
            raise ConfigError(
                f"sbatch: time limit {self.time!r} ({minutes} min) leaves no time before the warning signal "
                f"{self.signal_s}s before the end",
                hint="raise --time or lower slurm.signal_s",
            )

    def _check_text(self) -> None:
        """Refuse, naming the field, a value the script could not hold as one argument: each `#SBATCH` value as
        render_batch_script writes it (directive_value), every value of the shell body free of control characters
        (shlex.quote keeps a newline inside quotes, but a job's argv is no place for one), an env name a word."""
        for name in ("job_name", "time", "mem", "partition", "account", "output"):
            directive_value(getattr(self, name), f"slurm.{name}")
        if not self.output:
            directive_value(self.default_log, "run_dir")
        for i, option in enumerate(self.extra):
            extra_directive(option, f"slurm.extra[{i}]")
        paths = {"plan": self.plan_path, "run_dir": self.run_dir, "workdir": self.workdir}
        for where, text in [(k, str(v)) for k, v in paths.items()] + [("train.python", self.python)]:
            refuse_control(text, where)
        for i, item in enumerate(self.sets):
            refuse_control(item, f"--set[{i}]")
        for i, item in enumerate(self.launch_args):
            refuse_control(item, f"launch_args[{i}]")
        for key, value in self.env.items():
            if not _ENV_NAME.fullmatch(key):
                raise ConfigError(f"env name {_shown(key)} is not a shell variable name")
            refuse_control(value, f"env.{key}")

    @property
    def default_log(self) -> str:
        """The job's log when slurm.output names none: beside the run directory, appended by every requeued job."""
        return str(self.run_dir.parent / f"{self.run_dir.name}.slurm-%j.out")

    @classmethod
    def from_request(cls, request: SlurmSpec, **changes: Any) -> BatchSpec:
        """The plan's request with `changes` (the flags, the plan's paths) applied; an unset nodes or job_name
        (0, "": derived from the plan) takes the batch default unless `changes` resolves it."""
        asked = {
            f.name: getattr(request, f.name)
            for f in fields(SlurmSpec)
            if getattr(request, f.name) or f.name not in ("nodes", "job_name")
        }
        return cls(**{**asked, "extra": list(request.extra), **changes})


def time_limit_minutes(text: str) -> float:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    text = str(text).strip()
    try:
        days = 0
        if "-" in text:
            d, text = text.split("-", 1)
            days = int(d)
            parts = [int(p) for p in text.split(":")]
            h, m, s = (parts + [0, 0])[:3]
        else:
            parts = [int(p) for p in text.split(":")]
            if len(parts) == 1:
                h, m, s = 0, parts[0], 0
            elif len(parts) == 2:
                h, m, s = 0, parts[0], parts[1]
            elif len(parts) == 3:
                h, m, s = parts
            else:
                raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(
            f"sbatch: time limit {text!r} is not a Slurm time", hint="use minutes, H:M:S or D-H:M:S"
        ) from exc
    return days * 1440 + h * 60 + m + s / 60


def render_batch_script(spec: BatchSpec) -> str:
    """The batch script text; every path is absolute so the requeued job does not depend on a cwd."""
    q = shlex.quote
    d = directive_value  # spec checked them all (BatchSpec._check_text): here only written
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={d(spec.job_name, 'slurm.job_name')}",
        f"#SBATCH --time={d(spec.time, 'slurm.time')}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --signal=B:USR1@{spec.signal_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={d(spec.output, 'slurm.output') if spec.output else d(spec.default_log, 'run_dir')}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    for flag, name in (("--mem", "mem"), ("--partition", "partition"), ("--account", "account")):
        if getattr(spec, name):
            lines.append(f"#SBATCH {flag}={d(getattr(spec, name), f'slurm.{name}')}")
    lines += [f"#SBATCH {extra_directive(opt, f'slurm.extra[{i}]')}" for i, opt in enumerate(spec.extra)]
    launch = [spec.python, "-m", "torchrelay", "launch", str(spec.plan_path)]
    for item in spec.sets:
        launch += ["--set", item]
    launch += spec.launch_args
    exports = "".join(f"export {k}={q(v)}\n" for k, v in sorted(spec.env.items()))  # names: words (checked)
    body = f"""
# Written by `torchrelay sbatch`. Runs the plan's controller: preflight, smoke, formal run (budget-aware).
set -u

# --signal=B:USR1 reaches this shell only; hand it to the controller, which hands it to the ranks.
# Slurm 22.05 delivers the previous run's warning again the moment a requeued job starts: a USR1 within
# {STALE_WARNING_S} s of a requeued start is that stale warning (the controller's deadline from squeue still holds).
started=$(date +%s)
ctl=""
forward() {{
  if [ "$1" = USR1 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && [ $(( $(date +%s) - started )) -lt {STALE_WARNING_S} ]; then
    echo "torchrelay: ignoring USR1 at the start of requeued run ${{SLURM_RESTART_COUNT}} (the previous run's warning)"
    return
  fi
  echo "torchrelay: $1 received at $(date -u +%FT%TZ); asking the run to save and stop"
  [ -n "$ctl" ] && kill -"$1" "$ctl" 2>/dev/null
}}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

{exports}cd {q(str(spec.workdir))}
echo "torchrelay: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $(hostname -s) at $(date -u +%FT%TZ)"

# Started with USR1/TERM ignored, so a signal before Python has installed its handlers cannot kill it.
( trap '' USR1 TERM; exec {shlex.join(launch)} ) &
ctl=$!
# `wait` returns early when a trapped signal arrives; wait again until the controller has really exited.
while :; do
  wait "$ctl"
  rc=$?
  kill -0 "$ctl" 2>/dev/null || break
done
echo "torchrelay: controller exited $rc at $(date -u +%FT%TZ)"

# 3 (budget) and 5 (signal): a clean stop with a complete checkpoint that did not finish: continue in a new job.
case "$rc" in
  {"|".join(str(c) for c in REQUEUE_CODES)})
    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {spec.max_requeues} ]; then
      echo "torchrelay: requeueing job $SLURM_JOB_ID"
      scontrol requeue "$SLURM_JOB_ID" && exit 0
      echo "torchrelay: scontrol requeue failed; resubmit by hand"
    else
      echo "torchrelay: not requeueing: {spec.max_requeues} requeues done (slurm.max_requeues)"
    fi
    ;;
esac
exit "$rc"
"""
    return "\n".join(lines) + "\n" + body


def submit(script: Path, runner: Runner = run_command) -> str:
    """sbatch the script and return the job id."""
    out = runner(["sbatch", "--parsable", str(script)]).strip()
    job = out.split(";")[0]
    if not job.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id")
    return job


def wait_for(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 1.0) -> bool:
    """Poll until predicate() or timeout; True when it came true."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()
