"""`torchrelay validate RUN_DIR --cmd '...' [--updates 10,20|kept]`: validate checkpoints, record their metrics."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchrelay.commands.argtypes import seconds
from torchrelay.controller.validation import ValidationSpec, validate_checkpoints
from torchrelay.errors import EXIT_BUDGET, EXIT_ERROR, EXIT_FINISHED, ConfigError
from torchrelay.paths.layout import checkpoint_name
from torchrelay.records.validation import KEPT, ValidationRecord, parse_updates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--cmd", required=True, metavar="COMMAND",
        help="shell command run once per checkpoint; {checkpoint}, {metrics}, {update}, {run_dir}, {weights} are filled in "
        "(also $TORCHRELAY_CHECKPOINT, $TORCHRELAY_VALIDATION_METRICS); it writes a JSON object of metrics to {metrics}",
    )  # fmt: skip
    parser.add_argument(
        "--updates", default=KEPT, metavar="N,M|kept",
        help="the checkpoints to validate: a list of updates, or 'kept' (every complete one; the default)",
    )  # fmt: skip
    parser.add_argument("--cwd", type=Path, default=None, help="where the command runs (default: here)")
    parser.add_argument(
        "--timeout", type=seconds, default=0.0, metavar="S", help="fail a validation after S s"
    )
    parser.add_argument(
        "--budget", type=seconds, default=None, metavar="S",
        help="stop starting validations that do not fit in S seconds; the rest stay to do",
    )  # fmt: skip
    parser.add_argument(
        "--estimate", type=seconds, default=0.0, metavar="S", help="seconds one validation takes"
    )
    parser.add_argument("--again", action="store_true", help="also validate checkpoints that have a record")
    parser.add_argument(
        "--weights", action="store_true",
        help="export each checkpoint's weights (as `torchrelay export`) into {weights} for the command, removed after",
    )  # fmt: skip
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="for --weights")
    parser.add_argument(
        "--drop", action="extend", nargs="+", default=[], metavar="PREFIX", help="for --weights"
    )
    parser.add_argument(
        "--rename", action="extend", nargs="+", default=[], metavar="OLD=NEW", help="for --weights"
    )
    parser.add_argument("--include", action="extend", nargs="+", default=[], type=Path, metavar="FILE",
                        help="for --weights: files copied beside the weights (config.json)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    spec = ValidationSpec(
        command=args.cmd,
        updates=parse_updates(args.updates, "--updates"),
        cwd=(args.cwd or Path.cwd()).resolve(),
        timeout_s=args.timeout,
        estimate_s=args.estimate,
        again=args.again,
        export=_export(args),
    )
    console = Console(highlight=False)

    def show(event: str, update: int, record: ValidationRecord | None) -> None:
        if event == "start":
            console.print(f"validating {checkpoint_name(update)} ...")
        elif record is not None:
            console.print(f"{checkpoint_name(update)}: {describe(record)}")

    deadline = time.time() + args.budget if args.budget is not None else None
    report = validate_checkpoints(args.run_dir, spec, deadline=deadline, on_event=show)
    table = Table(title=f"validation of {args.run_dir}", title_justify="left")
    for col in ("checkpoint", "result"):
        table.add_column(col)
    for update in report.done_before:
        table.add_row(checkpoint_name(update), "validated before (use --again to repeat)")
    for record in report.records:
        table.add_row(record.checkpoint, describe(record))
    for update, why in sorted({**report.missing, **report.left}.items()):
        table.add_row(
            checkpoint_name(update), f"left: {why}" if update in report.left else f"not available: {why}"
        )
    console.print(table)
    if report.failed:
        return EXIT_ERROR
    return EXIT_BUDGET if report.left else EXIT_FINISHED


def _export(args: argparse.Namespace) -> Any:
    if not args.weights:
        if args.dtype or args.drop or args.rename or args.include:
            raise ConfigError(
                "--dtype, --drop, --rename and --include shape the --weights export; add --weights"
            )
        return None
    from torchrelay.export import ExportOptions, parse_rename

    return ExportOptions(
        dtype=args.dtype,
        drop=list(args.drop),
        rename=[parse_rename(r) for r in args.rename],
        include=[p.resolve() for p in args.include],
    )


def describe(record: ValidationRecord) -> str:
    """One line: the status, its reason, the metrics and how long it took."""
    if record.status == "ok":
        metrics = ", ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in (record.metrics or {}).items()
        )
        return f"ok in {record.seconds:.1f}s: {metrics}"
    return f"{record.status} after {record.seconds:.1f}s: {record.reason}"
