"""`torchrelay pack RUN_DIR BUNDLE`: a verifiable bundle of a stopped run; the source checkpoint is marked handed off."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.checkpoint.handed_off import HANDED_OFF
from torchrelay.commands.argtypes import run_directory, update
from torchrelay.errors import EXIT_FINISHED
from torchrelay.handoff.pack import PackOptions, checkpoint_to_pack, pack
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.records.contract import load_contract
from torchrelay.storage.url import parse_url, scheme_of
from torchrelay.util import bars, schema


def _checkpoint(text: str) -> int | None:
    return None if text == "latest" else update(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=run_directory, help="the stopped run directory")
    parser.add_argument(
        "bundle", help="the bundle directory to write (new or empty), or s3://BUCKET/PREFIX (an empty prefix)"
    )
    parser.add_argument(
        "--checkpoint", type=_checkpoint, default=None, metavar="N|latest", help="default: latest"
    )
    schema.add_flags(parser, PackOptions, ["link", "code_dir", "allow_dirty", "jobs", "sign"])


def run(args: argparse.Namespace) -> int:
    options = schema.from_namespace(PackOptions, args)
    run_dir: RunDir = args.run_dir
    load_contract(run_dir)  # a path that holds no run is refused as such, before any checkpoint is looked for
    # A run still training is refused as such (RunBusy, exit 2) before any checkpoint is looked for: until its
    # first save committed, the look refused it as "no complete checkpoint" (exit 1). pack() takes the lock again.
    RunLock(run_dir.path, "train").acquire().release()
    ckpt = checkpoint_to_pack(run_dir, options.checkpoint, guard=False)  # pack() itself guards
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    url = parse_url(args.bundle) if scheme_of(args.bundle) else None
    with bars.byte_bar(f"pack {ckpt.name}", total) as advance:
        if url is not None:
            from torchrelay.handoff.store_pack import pack_to_store

            result = pack_to_store(run_dir, url, options, on_bytes=advance)
        else:
            result = pack(run_dir, Path(args.bundle), options, on_bytes=advance)
    where = str(url) if url is not None else str(result.bundle)
    for note in result.notes:
        print(f"recovered: {note}")
    for warning in result.warnings:
        print(f"WARNING: {warning}")
    rate = result.bytes / result.seconds / 1e9 if result.seconds else 0.0
    print(
        f"packed update {result.update} into {where}: {result.files} files, {result.bytes / 1e9:.3f} GB "
        f"({result.linked} hardlinked) in {result.seconds:.2f} s ({rate:.2f} GB/s)"
    )
    contract = load_contract(args.run_dir)["sha256"]
    print(f"contract {contract} (the training prints it as TRAINING_CONTRACT)")
    print(f"bundle lineage {result.lineage}; {ckpt / HANDED_OFF} now refuses a second continuation here")
    print(f"BUNDLE_DIGEST sha256:{result.digest}")
    print(
        "  (the SHA-256 of SHA256SUMS; give it to whoever continues the run, who checks it with "
        "`torchrelay verify BUNDLE --expect DIGEST`)"
    )
    if result.signed:
        print(
            f"signed: {where}/{Bundle(result.bundle).sig_path.name} (ssh-keygen -Y sign -n torchrelay-bundle with {args.sign})"
        )
    print("PACK_OK")
    return EXIT_FINISHED
