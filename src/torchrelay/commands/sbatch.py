"""`torchrelay sbatch PLAN.yaml`: write (and with --submit, submit) a self-requeueing Slurm batch script."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from torchrelay.commands.argtypes import count
from torchrelay.config.relay import parse_assignments
from torchrelay.controller.plan import load_plan
from torchrelay.controller.slurm import (
    NODES_LIMIT,
    PER_NODE_LIMIT,
    BatchSpec,
    directive_value,
    refuse_control,
    render_batch_script,
    submit,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", type=Path, help="the plan YAML")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="plan override, per launch"
    )
    parser.add_argument(
        "--time", default=None, help="time limit per job (Slurm format); default plan slurm.time"
    )
    parser.add_argument("--nodes", type=count(1, NODES_LIMIT), default=None, help="default plan train.nnodes")
    parser.add_argument(
        "--gpus-per-node",
        type=count(0, PER_NODE_LIMIT),
        default=None,
        help="default plan slurm.gpus_per_node",
    )
    parser.add_argument(
        "--signal", type=count(1), default=None, metavar="SECONDS", help="warning signal before the end"
    )
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument(
        "--output", type=Path, default=None, help="where to write the script (default RUN_DIR.sbatch)"
    )
    parser.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")


def run(args: argparse.Namespace) -> int:
    # a flag's value is named as the flag, before the plan's own fields are (BatchSpec names those)
    for flag in ("time", "partition", "account"):
        if getattr(args, flag) is not None:
            directive_value(getattr(args, flag), f"--{flag}")
    for item in args.set:
        refuse_control(item, "--set")
    refuse_control(str(args.plan), "the plan's path")
    sets = parse_assignments(args.set)
    plan = load_plan(args.plan, sets)
    s = plan.slurm
    refuse_control(plan.run_dir, "run_dir")  # before `name`, which defaults to its last part
    if not s.job_name:
        directive_value(plan.name, "name")  # the job's name is relay-NAME
    spec = BatchSpec.from_request(
        s,
        plan_path=args.plan.resolve(),
        run_dir=plan.run_path,
        workdir=plan.work_path,
        time=args.time or s.time,
        nodes=args.nodes or s.nodes or plan.train.nnodes,
        gpus_per_node=s.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node,
        partition=args.partition or s.partition,
        account=args.account or s.account,
        job_name=s.job_name or f"relay-{plan.name}",
        signal_s=args.signal or s.signal_s,
        sets=list(args.set),
        python=plan.train.python,
    )
    if spec.nodes != plan.train.nnodes:
        spec.sets.append(f"train.nnodes={spec.nodes}")
    plan.check_run_dir()  # the script goes beside it: refused first
    script = args.output or plan.run_path.parent / f"{plan.run_path.name}.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render_batch_script(spec))
    os.chmod(script, 0o755)
    print(f"wrote {script}")
    if args.submit:
        print(f"submitted job {submit(script)}")
    return 0
