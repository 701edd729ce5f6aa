"""`torchrelay diff A B`: the contract difference between two runs, checkpoints or bundles, field by field."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchrelay.handoff.diff import diff, format_report
from torchrelay.util.shown import visible


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="a run dir, a bundle, or a checkpoint-N dir")
    parser.add_argument("b", type=Path, help="a run dir, a bundle, or a checkpoint-N dir")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when the contracts are identical (runtime fields may differ), 1 when they differ."""
    report = diff(args.a, args.b)
    if args.json:
        out = {
            "same_contract": report.same_contract,
            "contract": [[d.key, d.a, d.b] for d in report.contract],
            "runtime": [[d.key, d.a, d.b] for d in report.runtime],
            # per side: what its own files hold against its own contract (a resume of it refuses any)
            "sides": {
                name: {
                    "config_drift": [list(d) for d in side.drift],
                    "data_drift": [list(d) for d in side.data_drift],
                    "data_problem": side.data_problem,
                }
                for name, side in (("a", report.a), ("b", report.b))
            },
        }
        print(json.dumps(out, indent=1, default=str))
    else:
        # the fields' names and values are the configuration files' (or a bundle's): an ESC in one is shown as text
        print("\n".join(visible(line) for line in format_report(report)))
    return 0 if report.same_contract else 1
