"""`torchrelay audit [options] -- LAUNCH…`: run a script uninterrupted and interrupted, and compare bit for bit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrelay.audit import AuditError
from torchrelay.commands.argtypes import count, positive_seconds, tolerance, updates_list
from torchrelay.paths.layout import MAX_UPDATE
from torchrelay.util.schema import INT_LIMIT

if TYPE_CHECKING:  # the runner pulls in torch
    from torchrelay.audit.runner import SegmentLaunch


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare word such as a path or a mode name


def parse_vary(items: list[str] | None) -> dict[str, list[Any]]:
    """`["num_workers=0,2"]` -> `{"num_workers": [0, 2]}`; values are JSON where they parse, else strings."""
    out: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        if not sep or not key.strip():
            raise AuditError(f"--vary {item!r}: expected FIELD=V1,V2 (e.g. num_workers=0,2)")
        out[key.strip()] = [_value(v.strip()) for v in values.split(",") if v.strip()]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--updates",
        type=count(2, MAX_UPDATE),
        default=12,
        metavar="U",
        help="audit the first U updates (default 12)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--stops",
        type=count(1, MAX_UPDATE),
        default=3,
        metavar="K",
        help="stop K times, from early to late: after update 1, evenly in between, after U-1 (default 3)",
    )
    where.add_argument(
        "--stop-at", type=updates_list, metavar="A,B,…", help="stop after exactly these updates"
    )
    parser.add_argument("--random", action="store_true", help="draw the K stops at random (see --seed)")
    parser.add_argument("--seed", type=count(-INT_LIMIT), default=None, help="seed for --random")
    parser.add_argument(
        "--vary",
        action="append",
        metavar="FIELD=V1,V2",
        help="a runtime field whose value cycles between segments (repeatable), e.g. num_workers=0,2; "
        "world_size=2,1 moves the run between rank counts and measures the drift against a tolerance",
    )
    parser.add_argument(
        "--atol", type=tolerance, default=0.0, help="absolute tolerance (default 0: bit for bit)"
    )
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY",
        help="a metric key that may differ between runs, e.g. a memory reading (repeatable); timing keys always are",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the audit's run directories here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary run directories even when equal"
    )
    parser.add_argument(
        "--timeout", type=positive_seconds, default=600.0, help="seconds one launch may take (default 600)"
    )
    parser.add_argument(
        "--no-rerun",
        action="store_true",
        help="never launch a second uninterrupted run to confirm non-deterministic kernels",
    )
    parser.add_argument(
        "launch", nargs=argparse.REMAINDER, metavar="-- LAUNCH…", help="the training launch command"
    )


def run(args: argparse.Namespace) -> int:
    from torchrelay.audit.orchestrator import AuditSpec, run_audit
    from torchrelay.audit.verdict import render_table

    launch = list(args.launch)
    if launch and launch[0] == "--":
        launch = launch[1:]
    spec = AuditSpec(
        launch=launch,
        updates=args.updates,
        stops=args.stops,
        stop_at=args.stop_at,
        random_stops=args.random,
        seed=args.seed,
        vary=parse_vary(args.vary),
        atol=args.atol,
        ignore_keys=list(args.ignore),
        work_dir=args.work_dir,
        keep=args.keep,
        timeout_s=args.timeout,
        confirm_nondeterminism=not args.no_rerun,
    )
    if "world_size" in spec.vary:  # a layout audit: the drift against a tolerance, not bit for bit
        from torchrelay.audit.layout_audit import run_layout_audit

        layout = run_layout_audit(spec, spec.vary["world_size"], None if args.json else print_segment)
        if args.json:
            print(json.dumps(layout.to_dict(), indent=2, sort_keys=True))
        else:
            print("\n".join(layout.lines()))
            print("run directories: " + ", ".join(f"{k} {v}" for k, v in layout.run_dirs.items()))
        return 0 if layout.ok else 1
    verdict = run_audit(spec, on_segment=None if args.json else print_segment)
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2, sort_keys=True))
    else:
        render_table(verdict)
        if verdict.run_dirs:
            print("run directories kept: " + ", ".join(f"{k} {v}" for k, v in verdict.run_dirs.items()))
    return 0 if verdict.equal else 1


def print_segment(name: str, seg: SegmentLaunch) -> None:
    """One line per finished launch: the audit's progress."""
    over = f" overrides {seg.overrides}" if seg.overrides else ""
    print(
        f"  {name} run, segment {seg.index}: stop after update {seg.stop_at}: {seg.ended} "
        f"in {seg.seconds:.1f}s{over}",
        flush=True,
    )
