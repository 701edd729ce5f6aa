"""`torchrelay launch PLAN.yaml`: one attempt of a plan (preflight, smoke, formal run), exit code of its outcome."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.argtypes import count, seconds
from torchrelay.config.relay import parse_assignments
from torchrelay.controller.slurm import PER_NODE_LIMIT
from torchrelay.policy.costmodel import parse_deadline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", type=Path, help="the plan YAML (training command, run directory, stages)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a plan field (dotted key)"
    )
    parser.add_argument(
        "--deadline", default=None, help="stop cleanly by this time (unix seconds or ISO 8601)"
    )
    parser.add_argument(
        "--budget",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="stop cleanly within this, counted from the command's start",
    )
    parser.add_argument(
        "--devices",
        type=count(0, PER_NODE_LIMIT),
        default=None,
        metavar="N",
        help="devices per node this allocation has (default: the GPUs CUDA sees); fewer than the plan's "
        "train.nproc_per_node runs its first fallback that fits",
    )
    parser.add_argument(
        "--reshard",
        action="store_true",
        help="continue the run in place on this plan's world size even where its checkpoint has another, with the "
        "same global batch (grad_accum derived; recorded in history.jsonl, docs/ELASTIC.md)",
    )


def run(args: argparse.Namespace) -> int:
    # here, not at the top: the controller imports torch (~2 s), which `launch --help` does not need
    from torchrelay.controller.launcher import LaunchRequest, launch
    from torchrelay.controller.preflight import process_started

    request = LaunchRequest(
        plan_path=args.plan,
        sets=parse_assignments(args.set),
        deadline=parse_deadline(args.deadline) if args.deadline else None,
        budget_s=args.budget,
        started=process_started(),
        devices=args.devices,
        reshard=args.reshard,
    )
    return launch(request).exit_code
