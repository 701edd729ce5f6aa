"""`torchrelay verify BUNDLE`: every file against SHA256SUMS, every checkpoint inventory against its files."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.argtypes import JOBS_LIMIT, count
from torchrelay.errors import EXIT_FINISHED, EXIT_REFUSED
from torchrelay.handoff.verify import bundle_bytes, verify_bundle
from torchrelay.storage.url import StoreURL, parse_url, scheme_of
from torchrelay.util import bars
from torchrelay.util.shown import visible


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle directory (holds SHA256SUMS), or s3://BUCKET/PREFIX")
    parser.add_argument(
        "--jobs", type=count(1, JOBS_LIMIT), default=None, help="hashing threads (default: one per core)"
    )
    # its own name: the global -q (before the verb) is `quiet`, which this flag's default would overwrite
    parser.add_argument(
        "--quiet", dest="verify_quiet", action="store_true", help="print only failures and the verdict"
    )
    add_trust_arguments(parser)


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    """--expect and --allowed-signers: what ties a bundle to the one that was packed (verify and prepare)."""
    parser.add_argument(
        "--expect",
        metavar="DIGEST",
        default=None,
        help="refuse unless the bundle digest (SHA-256 of SHA256SUMS, printed by pack) is this",
    )
    parser.add_argument(
        "--allowed-signers",
        type=Path,
        default=None,
        metavar="FILE",
        help="refuse unless SHA256SUMS.sig is a signature by a key of this ssh-keygen allowed-signers file",
    )


def run(args: argparse.Namespace) -> int:
    if scheme_of(args.bundle):
        return _run_in_store(args, parse_url(args.bundle))
    total = bundle_bytes(args.bundle)
    with bars.byte_bar("verify", total) as advance:
        report = verify_bundle(
            args.bundle,
            jobs=args.jobs,
            on_bytes=advance,
            expect=args.expect,
            allowed_signers=args.allowed_signers,
        )
    sums = report.sums
    for line in report.problems():
        print(visible(line))  # names the bundle's files (and SHA256SUMS's): an ESC in a name is shown as text
    if not args.verify_quiet:
        rate = sums.total_bytes / sums.seconds / 1e9 if sums.seconds > 0 else 0.0
        print(
            f"{len(sums.checks)} files, {sums.total_bytes / 1e9:.3f} GB in {sums.seconds:.2f} s ({rate:.2f} GB/s); "
            f"{len(report.checkpoints)} checkpoint inventories checked"
        )
    print(f"BUNDLE_DIGEST sha256:{report.digest}{' (= --expect)' if args.expect else ''}")
    if report.signer is not None:
        print(f"signed by {visible(report.signer)} (SHA256SUMS.sig, {args.allowed_signers})")
    if report.ok:
        print("VERIFY_OK")
        return EXIT_FINISHED
    print(f"VERIFY_FAILED: {len(report.problems())} problem(s)")
    return EXIT_REFUSED


def _run_in_store(args: argparse.Namespace, url: StoreURL) -> int:
    """The bundle checked in the store, without a local copy (handoff/store_read.py)."""
    from torchrelay.handoff.store_pack import store_jobs
    from torchrelay.handoff.store_read import read_store_bundle
    from torchrelay.storage.base import open_store

    store = open_store(url, jobs=store_jobs(args.jobs))
    with bars.byte_bar("verify", 0) as advance:
        report = read_store_bundle(
            store,
            url,
            jobs=store_jobs(args.jobs),
            on_bytes=advance,
            expect=args.expect,
            allowed_signers=args.allowed_signers,
        )
    for line in report.problems:
        print(visible(line))
    if not args.quiet:
        rate = report.bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
        print(
            f"{report.files} objects, {report.bytes / 1e9:.3f} GB in {report.seconds:.2f} s ({rate:.2f} GB/s); "
            f"{len(report.checkpoints)} checkpoint inventories checked (in {url}, no local copy)"
        )
    print(f"BUNDLE_DIGEST sha256:{report.digest}{' (= --expect)' if args.expect else ''}")
    if report.signer is not None:
        print(f"signed by {visible(report.signer)} (SHA256SUMS.sig, {args.allowed_signers})")
    if report.ok:
        print("VERIFY_OK")
        return EXIT_FINISHED
    print(f"VERIFY_FAILED: {len(report.problems)} problem(s)")
    return EXIT_REFUSED
