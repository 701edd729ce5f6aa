"""`torchrelay verify BUNDLE`: every file against SHA256SUMS, every checkpoint inventory against its files."""

from __future__ import annotations

import argparse

from torchrelay.errors import EXIT_FINISHED, EXIT_REFUSED
from torchrelay.handoff import bars
from torchrelay.handoff.verify import bundle_bytes, verify_bundle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle directory (holds SHA256SUMS)")
    parser.add_argument("--jobs", type=int, default=None, help="hashing threads (default: one per core)")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the verdict")


def run(args: argparse.Namespace) -> int:
    total = bundle_bytes(args.bundle)
    with bars.byte_bar("verify", total) as advance:
        report = verify_bundle(args.bundle, jobs=args.jobs, on_bytes=advance)
    sums = report.sums
    for line in report.problems():
        print(line)
    if not args.quiet:
        rate = sums.total_bytes / sums.seconds / 1e9 if sums.seconds > 0 else 0.0
        print(
            f"{len(sums.checks)} files, {sums.total_bytes / 1e9:.3f} GB in {sums.seconds:.2f} s ({rate:.2f} GB/s); "
            f"{len(report.checkpoints)} checkpoint inventories checked"
        )
    if report.ok:
        print("VERIFY_OK")
        return EXIT_FINISHED
    print(f"VERIFY_FAILED: {len(report.problems())} problem(s)")
    return EXIT_REFUSED
