"""`torchrelay stop RUN_DIR [--job ID] [--at-update N] [--before-start]`; `torchrelay stop --forget-memory
(RUN_DIR | --stale)`."""

from __future__ import annotations

import argparse

from torchrelay.commands import memory
from torchrelay.commands.argtypes import job_id, run_directory, update
from torchrelay.controller.supervisor import last_logged_update
from torchrelay.errors import ConfigError
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import write_request
from torchrelay.records.contract import load_contract
from torchrelay.records.train import metrics_path
from torchrelay.util.shown import visible


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=run_directory, nargs="?")
    p.add_argument(
        "--job", type=job_id, help="honoured only by this Slurm job id (others ignore and report it)"
    )
    p.add_argument("--at-update", type=update, help="stop after this update instead of the next one")
    p.add_argument(
        "--before-start",
        action="store_true",
        help="the run does not exist yet: leave the request for its first launch (the directory may be new or empty)",
    )
    p.add_argument(
        "--forget-memory",
        action="store_true",
        help="free RUN_DIR's memory tier on this node (whatever it holds; never while a run uses it), or with "
        "--stale every stale one of this user's (see status --memory)",
    )
    p.add_argument(
        "--stale", action="store_true", help="with --forget-memory: every stale memory tier on this node"
    )


def run(args: argparse.Namespace) -> int:
    if args.forget_memory:
        return memory.free(args)
    if args.stale:
        raise ConfigError("stop --stale goes with --forget-memory", hint="pass --forget-memory --stale")
    memory.check_memory_flags(args, "stop")
    run: RunDir = args.run_dir
    run_dir = run.path
    exists = run.contract_path.exists()
    if args.before_start:
        if exists:
            raise ConfigError(f"{run_dir} holds a run already", hint="drop --before-start")
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(
                f"{run_dir} is not empty and holds no run: its first launch would refuse it",
                hint="pass a new or empty run directory",
            )
        run_dir.mkdir(parents=True, exist_ok=True)
    elif not exists:
        raise ConfigError(
            f"{run_dir} holds no torchrelay run",
            hint="pass the run directory the trainer uses, or --before-start for a run not launched yet",
        )
    else:
        load_contract(run)  # a damaged contract is no run to stop: refused naming the file
        if args.at_update is not None:
            _refuse_past(run, args.at_update)
    path = write_request(run, job=args.job, at_update=args.at_update)
    when = f"after update {args.at_update}" if args.at_update else "at the next update boundary"
    who = f"job {args.job}" if args.job else "whichever job runs it"
    print(f"wrote {visible(path)}: {who} will save a complete checkpoint and stop {when}")
    return 0


def _refuse_past(run: RunDir, at_update: int) -> None:
    """A request for an update the run has done already would stop it at its next boundary, not there."""
    metrics = metrics_path(run.train_dir, 0)
    done = last_logged_update(metrics)
    if done is not None and at_update <= done:
        raise ConfigError(
            f"stop --at-update {at_update}: the run is past it, at update {done} ({visible(metrics)})",
            hint=f"pass an update after {done}, or leave out --at-update to stop at the next boundary",
        )
