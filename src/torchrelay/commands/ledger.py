"""`torchrelay ledger RUN_DIR [--json] [--full]`: exit 1 on any repeat, gap or out-of-order exposure."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from torchrelay.ledger.exposure import prove
from torchrelay.util.shown import shown


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--full",
        action="store_true",
        help="read every exposure, ignoring the checkpoints' proofs of the logs' prefixes (the report is the same)",
    )


def run(args: argparse.Namespace) -> int:
    rep = prove(args.run_dir, full=args.full)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
        return 0 if rep.ok else 1
    con = Console()
    con.print(f"updates        {rep.updates:,}")
    con.print(f"exposures      {rep.exposures:,}")
    con.print(f"distinct       {rep.distinct:,}")
    con.print(f"repeats        {rep.repeats:,}")
    con.print(f"skipped        {rep.skipped:,}")
    con.print(
        f"remaining      {rep.remaining_in_epoch:,} in epoch {rep.epoch} ({rep.epoch_fraction:.4f} epochs done)"
    )
    con.print(f"prefix of order {'yes' if rep.prefix_ok else 'NO'}")
    for problem in rep.problems:
        con.print(f"[red]  {shown(problem)}[/]")  # names manifest ids: `[/]` or an ESC in one is text
    con.print(
        "[green]LEDGER_OK: every sample exactly once, in the run's order[/]"
        if rep.ok
        else "[red]LEDGER_FAIL[/]"
    )
    return 0 if rep.ok else 1
