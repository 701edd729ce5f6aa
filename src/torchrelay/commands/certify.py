"""`torchrelay certify RUN [--checkpoint N] [--updates K] [--json] -- LAUNCH…`: replay K updates from a checkpoint
and compare the parameters' digests with those the training recorded (audit/certify.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchrelay.commands.argtypes import count, positive_seconds
from torchrelay.paths.layout import MAX_UPDATE


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        type=count(0, MAX_UPDATE),
        default=None,
        metavar="N",
        help="the checkpoint to certify (default: the newest with K recorded updates after it)",
    )
    parser.add_argument(
        "--updates", type=count(1, MAX_UPDATE), default=1, metavar="K", help="updates to replay (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print the certificate as JSON")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the replay's copy of the run here")
    parser.add_argument(
        "--timeout", type=positive_seconds, default=600.0, help="seconds the replay may take (default 600)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _options(parser)
    parser.add_argument("run_dir", type=Path, metavar="RUN", help="the run directory")
    parser.add_argument(
        "launch", nargs=argparse.REMAINDER, metavar="-- LAUNCH…", help="the training launch command"
    )


def run(args: argparse.Namespace) -> int:
    from torchrelay.audit.certify import certify

    # argparse hands everything after RUN to the launch: the options written between RUN and -- are read here
    launch = list(args.launch)
    cut = launch.index("--") if "--" in launch else 0
    if cut:
        options = argparse.ArgumentParser(prog="torchrelay certify RUN", add_help=False)
        _options(options)
        options.parse_args(launch[:cut], namespace=args)
    launch = launch[cut + 1 :] if launch[cut : cut + 1] == ["--"] else launch
    cert = certify(
        args.run_dir,
        launch,
        checkpoint=args.checkpoint,
        updates=args.updates,
        work_dir=args.work_dir,
        timeout_s=args.timeout,
    )
    print(json.dumps(cert.to_dict(), indent=2, sort_keys=True) if args.json else cert.line())
    return 0 if cert.certified else 1
