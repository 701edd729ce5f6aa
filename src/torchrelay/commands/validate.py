"""`torchrelay validate RUN_DIR --cmd '...' [--updates 10,20|kept]`: validate checkpoints, record their metrics."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from torchrelay.errors import EXIT_BUDGET, EXIT_ERROR, EXIT_FINISHED
from torchrelay.validation import KEPT, ValidationRecord, ValidationSpec, parse_updates, validate_checkpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--cmd", required=True, metavar="COMMAND",
        help="shell command run once per checkpoint; {checkpoint}, {metrics}, {update}, {run_dir} are filled in "
        "(also $TORCHRELAY_CHECKPOINT, $TORCHRELAY_VALIDATION_METRICS); it writes a JSON object of metrics to {metrics}",
    )  # fmt: skip
    parser.add_argument(
        "--updates", default=KEPT, metavar="N,M|kept",
        help="the checkpoints to validate: a list of updates, or 'kept' (every complete one; the default)",
    )  # fmt: skip
    parser.add_argument("--cwd", type=Path, default=None, help="where the command runs (default: here)")
    parser.add_argument("--timeout", type=float, default=0.0, metavar="S", help="fail a validation after S s")
    parser.add_argument(
        "--budget", type=float, default=None, metavar="S",
        help="stop starting validations that do not fit in S seconds; the rest stay to do",
    )  # fmt: skip
    parser.add_argument(
        "--estimate", type=float, default=0.0, metavar="S", help="seconds one validation takes"
    )
    parser.add_argument("--again", action="store_true", help="also validate checkpoints that have a record")


def run(args: argparse.Namespace) -> int:
    spec = ValidationSpec(
        command=args.cmd,
        updates=parse_updates(args.updates, "--updates"),
        cwd=(args.cwd or Path.cwd()).resolve(),
        timeout_s=args.timeout,
        estimate_s=args.estimate,
        again=args.again,
    )
    console = Console(highlight=False)

    def show(event: str, update: int, record: ValidationRecord | None) -> None:
        if event == "start":
            console.print(f"validating checkpoint-{update} ...")
        elif record is not None:
            console.print(f"checkpoint-{update}: {describe(record)}")

    deadline = time.time() + args.budget if args.budget is not None else None
    report = validate_checkpoints(args.run_dir, spec, deadline=deadline, on_event=show)
    table = Table(title=f"validation of {args.run_dir}", title_justify="left")
    for col in ("checkpoint", "result"):
        table.add_column(col)
    for update in report.done_before:
        table.add_row(f"checkpoint-{update}", "validated before (use --again to repeat)")
    for record in report.records:
        table.add_row(record.checkpoint, describe(record))
    for update, why in sorted({**report.missing, **report.left}.items()):
        table.add_row(
            f"checkpoint-{update}", f"left: {why}" if update in report.left else f"not available: {why}"
        )
    console.print(table)
    if report.failed:
        return EXIT_ERROR
    return EXIT_BUDGET if report.left else EXIT_FINISHED


def describe(record: ValidationRecord) -> str:
    """One line: the status, its reason, the metrics and how long it took."""
    if record.status == "ok":
        metrics = ", ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (record.metrics or {}).items()
        )
        return f"ok in {record.seconds:.1f}s: {metrics}"
    return f"{record.status} after {record.seconds:.1f}s: {record.reason}"
