"""`torchrelay prepare BUNDLE --run-dir DIR --set KEY=VALUE ...`: re-point a bundle at this cluster, with proof."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.verify import add_trust_arguments
from torchrelay.config import parse_assignments
from torchrelay.errors import EXIT_FINISHED, EXIT_REFUSED
from torchrelay.handoff.prepare import PreflightFailed, PrepareOptions, prepare
from torchrelay.handoff.verify import bundle_bytes
from torchrelay.util import bars, schema


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", type=Path, help="the verified bundle directory")
    parser.add_argument(
        "--run-dir", type=Path, required=True, help="the run directory to create (new or empty)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a runtime field (data_root, num_workers, ...)",
    )
    parser.add_argument("--copy-mode", choices=("copy", "hardlink"), default="copy")
    parser.add_argument(
        "--check-files", action="store_true", help="check every manifest file exists under the new root"
    )
    parser.add_argument(
        "--code-dir",
        type=Path,
        default=None,
        help="validate against this checkout instead of the bundle's source",
    )
    parser.add_argument("--jobs", type=int, default=None, help="hash/copy threads (default: one per core)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="continue on N ranks: a layout change that keeps the global batch (grad_accum is derived)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        metavar="M",
        help="with --world-size: the per-rank micro-batch of the new layout (default: the checkpoint's)",
    )
    add_trust_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = schema.from_namespace(PrepareOptions, args, sets=parse_assignments(args.set))
    total = 2 * bundle_bytes(args.bundle)  # verified once, then copied once
    try:
        with bars.PrepareBars(total) as shown:
            result = prepare(args.bundle, options, on_bytes=shown.on_bytes, on_files=shown.on_files)
    except PreflightFailed as exc:
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
