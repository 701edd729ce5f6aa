"""`torchrelay stop RUN_DIR [--job ID] [--at-update N]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.errors import ConfigError
from torchrelay.stop import write_request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--job", help="honoured only by this Slurm job id (others ignore and report it)")
    p.add_argument("--at-update", type=int, help="stop after this update instead of the next one")


def run(args: argparse.Namespace) -> int:
    if not (Path(args.run_dir) / "resume_contract.json").exists():
        raise ConfigError(
            f"{args.run_dir} holds no torchrelay run", hint="pass the run directory the trainer uses"
        )
    path = write_request(args.run_dir, job=args.job, at_update=args.at_update)
    when = f"after update {args.at_update}" if args.at_update else "at the next update boundary"
    who = f"job {args.job}" if args.job else "whichever job runs it"
    print(f"wrote {path}: {who} will save a complete checkpoint and stop {when}")
    return 0
