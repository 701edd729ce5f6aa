"""`torchrelay prepare BUNDLE --run-dir DIR --set KEY=VALUE ...`: re-point a bundle at this cluster, with proof."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.verify import add_trust_arguments
from torchrelay.config.relay import parse_assignments
from torchrelay.errors import EXIT_FINISHED, EXIT_REFUSED
from torchrelay.handoff.prepare import PrepareOptions, PrepareRefused, prepare
from torchrelay.handoff.verify import bundle_bytes
from torchrelay.storage.url import parse_url, scheme_of
from torchrelay.util import bars, schema


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundle", help="the verified bundle directory, or s3://BUCKET/PREFIX (downloaded verified first)"
    )
    schema.add_flags(parser, PrepareOptions, ["run_dir"])
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a runtime field (data_root, num_workers, ...)",
    )
    schema.add_flags(
        parser, PrepareOptions, ["copy_mode", "check_files", "code_dir", "jobs", "world_size", "micro_batch"]
    )
    add_trust_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = schema.from_namespace(PrepareOptions, args, sets=parse_assignments(args.set))
    try:
        if scheme_of(args.bundle):
            from torchrelay.handoff.store_fetch import prepare_from_store

            with bars.PrepareBars(0) as shown:  # downloaded + verified, then hardlinked and verified again
                result = prepare_from_store(
                    parse_url(args.bundle), options, on_bytes=shown.on_bytes, on_files=shown.on_files
                )
        else:
            total = 2 * bundle_bytes(Path(args.bundle))  # verified once, then copied once
            with bars.PrepareBars(total) as shown:
                result = prepare(Path(args.bundle), options, on_bytes=shown.on_bytes, on_files=shown.on_files)
    except PrepareRefused as exc:
        print("PREFLIGHT: FAIL")
        for failure in exc.failures:
            print(f"  - {failure}")
        return EXIT_REFUSED
    for key, (old, new) in result.changes.items():
        print(f"changed {key}: {old!r} -> {new!r}")
    if result.layout_change:
        old, new = result.layout_change["from"], result.layout_change["to"]
        print(
            f"layout change: {old['world_size']} -> {new['world_size']} rank(s), micro_batch {old['micro_batch']} "
            f"-> {new['micro_batch']}, grad_accum {old['grad_accum']} -> {new['grad_accum']}; global batch "
            f"{result.layout_change['global_batch']} kept (launch with --nproc_per_node={new['world_size']})"
        )
    for line in result.passed:
        print(f"  pass: {line}")
    print("PREFLIGHT: PASS")
    if result.code_dir is not None:
        print(f"code: {result.code_dir} (launch the training script from here)")
    print(
        f"run dir: {result.run_dir}{' (already prepared; nothing changed)' if result.already_prepared else ''}"
    )
    print("PREPARE_OK")
    return EXIT_FINISHED
