"""Slurm: the time a job has left, its hosts, and the self-requeueing batch script that runs a plan.

The batch script asks for a warning signal to the batch shell (`--signal=B:USR1@SECONDS`: without `B:` only job
steps would get it), traps it and forwards it to the controller, which forwards it to the training ranks; they save
and exit 5. A clean stop that did not finish the run (controller exit 3 or 5) requeues the job with
`scontrol requeue`; the requeued job appends to the same log and resumes, one history segment per job.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
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


class SlurmError(RelayError):
    """A Slurm command failed or answered something unexpected."""


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
    log = spec.output or str(spec.run_dir.parent / f"{spec.run_dir.name}.slurm-%j.out")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --time={spec.time}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --signal=B:USR1@{spec.signal_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    for flag, value in (("--mem", spec.mem), ("--partition", spec.partition), ("--account", spec.account)):
        if value:
            lines.append(f"#SBATCH {flag}={value}")
    lines += [f"#SBATCH {opt}" for opt in spec.extra]
    launch = [spec.python, "-m", "torchrelay", "launch", str(spec.plan_path)]
    for item in spec.sets:
        launch += ["--set", item]
    launch += spec.launch_args
    exports = "".join(f"export {k}={q(v)}\n" for k, v in sorted(spec.env.items()))
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
