"""`torchrelay report RUN_DIR [--out DIR]`: draw a run into PNGs and one self-contained HTML page."""

from __future__ import annotations

import argparse

from torchrelay.audit.verdict import shown_for_run
from torchrelay.commands.argtypes import run_directory
from torchrelay.config.relay import stored_config
from torchrelay.paths.rundir import RunDir
from torchrelay.report import render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=run_directory, metavar="RUN_DIR", help="the run directory to draw")
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="where to write the report (default RUN_DIR/report)"
    )


def run(args: argparse.Namespace) -> int:
    run: RunDir = args.run_dir
    if run.path.is_dir():  # a directory that holds no run is refused as such (exit 2), as by `status`
        stored_config(run)
    found = shown_for_run(run)
    result = render(run, args.out, audit=str(found["verdict"]) if found else None)
    print(f"report: {result.html}")
    for path in result.pngs():
        print(f"  plot: {path}")
    print(f"  {result.updates} update(s), {result.segments} segment(s)")
    return 0
