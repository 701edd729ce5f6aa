"""`torchrelay VERB`: a thin layer over the library; each verb is one library call plus printing."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from torchrelay import __version__
from torchrelay.config import envvars
from torchrelay.errors import EXIT_ERROR, ConfigError, RelayError, from_exception
from torchrelay.log import configure
from torchrelay.storage.url import SCHEMES, scheme_of
from torchrelay.util.finalize import freeze_at_exit
from torchrelay.util.shown import visible

# verb -> module under torchrelay.commands exposing `add_arguments(parser)` and `run(args) -> int`
VERBS: dict[str, str] = {
    "status": "status",
    "stop": "stop",
    "ledger": "ledger",
    "pack": "pack",
    "verify": "verify",
    "prepare": "prepare",
    "diff": "diff",
    "launch": "launch",
    "sbatch": "sbatch",
    "audit": "audit",
    "certify": "certify",
    "report": "report",
    "validate": "validate",
    "export": "export",
}

# verb -> the arguments that may name a store URL (s3://BUCKET/PREFIX); a `scheme://` argument anywhere else is
# refused, never taken for a local path (`pack RUN s3://b/x` wrote a folder ./s3:/b/x and said PACK_OK)
STORE_ARGS: dict[str, tuple[str, ...]] = {"pack": ("bundle",), "verify": ("bundle",), "prepare": ("bundle",)}

HELP = {
    "status": "show a run: progress, exposures, loss, checkpoints, segments",
    "stop": "ask a running run to save a checkpoint and stop at the next update",
    "ledger": "prove from the exposure logs that every sample was seen exactly once",
    "pack": "write a verifiable bundle of a stopped run for another cluster",
    "verify": "check every file of a bundle against SHA256SUMS",
    "prepare": "re-point a bundle at this cluster's paths, with proof nothing else changed",
    "diff": "show the contract difference between two runs, checkpoints or bundles",
    "launch": "run a plan: preflight, smoke, then the formal run, budget-aware",
    "sbatch": "write (and submit) a Slurm batch script that runs a plan and requeues itself",
    "audit": "prove that a training script resumes exactly",
    "certify": "replay updates from a checkpoint and compare them with the training's recorded digests",
    "report": "plot a run (loss, LR, speed, segments) into PNGs and one HTML page",
    "validate": "run a validation command on chosen checkpoints and record its metrics",
    "export": "write a checkpoint's model weights as safetensors (Hugging Face layout) for serving",
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen verb's module is imported (some pull in torch, which takes seconds)."""
    parser = argparse.ArgumentParser(prog="torchrelay", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torchrelay {__version__}")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("-v", "--verbose", action="store_true", help="also the library's debug records")
    noise.add_argument("-q", "--quiet", action="store_true", help="only the library's warnings and errors")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, module_name in VERBS.items():
        p = sub.add_parser(name, help=HELP.get(name), description=HELP.get(name))
        if name != verb:
            continue
        module = importlib.import_module(f"torchrelay.commands.{module_name}")
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb and return its exit code; library errors become a message and their own code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else None)
    args = parser.parse_args(argv)
    # the library's records (the rank in each): information on stdout, warnings on stderr, as the verbs print
    configure(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
    try:
        _refuse_urls(args.verb, argv, args)
        return int(args._run(args))
    except BrokenPipeError:  # `torchrelay status --json | head`
        return 0
    except KeyboardInterrupt:
        print(f"torchrelay {args.verb}: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except (RelayError, OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        # The one place where what went wrong becomes a message and an exit code: a library refusal keeps its
        # own; a path that is a file, missing or unreadable, or a file that is not text, is refused (exit 2).
        if envvars.TRACEBACK.get():
            raise
        err = from_exception(exc)
        # a message names paths and values a run's files hold: their control characters are shown, not sent
        # (a newline inside a path is one of them: the message is one line, its hint the next)
        # (a contract mismatch lists its differing fields a line each: those lines are kept)
        lines = err.message.split("\n") if getattr(err, "differences", None) else [err.message]
        text = "\n".join(map(visible, lines)) + (f"\n  hint: {visible(err.hint)}" if err.hint else "")
        print(f"torchrelay {args.verb}: error: {text}", file=sys.stderr)
        return err.exit_code


def _refuse_urls(verb: str, argv: list[str], args: argparse.Namespace) -> None:
    """One line for a `scheme://` argument (or `KEY=scheme://`) the verb does not take as a store URL."""
    allowed = [
        getattr(args, dest)
        for dest in STORE_ARGS.get(verb, ())
        if isinstance(getattr(args, dest, None), str) and scheme_of(getattr(args, dest)) in SCHEMES
    ]
    rest = getattr(args, "launch", None)  # audit's launch command: another program's arguments, not ours
    if isinstance(rest, list) and rest and argv[-len(rest) :] == rest:
        argv = argv[: -len(rest)]
    for token in argv:
        if token == "--":  # what follows is another program's command line
            return
        for value in (token, token.partition("=")[2]):
            scheme = scheme_of(value)
            if scheme is None:
                continue
            if value in allowed:
                allowed.remove(value)
                break
            where = STORE_ARGS.get(verb)
            raise ConfigError(
                f"{value!r} is a {scheme}:// URL; `torchrelay {verb}` takes a local path there",
                hint=(
                    f"`torchrelay {verb}` takes {'/'.join(SCHEMES)}:// URLs only as {' or '.join(w.upper() for w in where)}"
                    if where
                    else "copy the data to a local path first"
                ),
            )


def entry() -> None:
    freeze_at_exit()  # a verb that imported torch (verify, export, pack) ends without collecting its heap
    sys.exit(main())
