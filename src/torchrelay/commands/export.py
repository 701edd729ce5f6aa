"""`torchrelay export RUN_DIR|CHECKPOINT OUT`: model weights as safetensors, with provenance and SHA256SUMS."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.argtypes import update
from torchrelay.errors import EXIT_FINISHED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="a run directory (its newest complete checkpoint), a bundle, "
                        "or a checkpoint-N directory")  # fmt: skip
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    parser.add_argument("--checkpoint", type=update, default=None, metavar="N", help="of a run: checkpoint-N")
    parser.add_argument("--format", default="safetensors", choices=["safetensors"])
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp16", "fp32"],
        help="cast floating tensors (default: as stored)",
    )
    parser.add_argument(
        "--drop", action="extend", nargs="+", default=[], metavar="PREFIX",
        help="leave out a module: 'head' drops head and head.* (e.g. a training-only head)",
    )  # fmt: skip
    parser.add_argument(
        "--rename", action="extend", nargs="+", default=[], metavar="OLD=NEW",
        help="rename a module path: 'lm=' strips the prefix lm., 'enc=encoder' renames it",
    )  # fmt: skip
    parser.add_argument(
        "--include", action="extend", nargs="+", default=[], type=Path, metavar="FILE",
        help="copy files beside the weights and into SHA256SUMS (config.json, tokenizer files)",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into files of at most this size (default 5GB)",
    )


def run(args: argparse.Namespace) -> int:
    # here, not at the top: it imports torch (~2 s), which `export --help` does not need
    from torchrelay.export import ExportOptions, export_weights, parse_rename, parse_size

    options = ExportOptions(
        format=args.format,
        dtype=args.dtype,
        drop=list(args.drop),
        rename=[parse_rename(r) for r in args.rename],
        max_shard_bytes=parse_size(args.max_shard_size),
        include=list(args.include),
        checkpoint=args.checkpoint,
    )
    result = export_weights(args.source, args.out, options)
    print(
        f"exported {result.tensors} tensors ({result.bytes / 1e6:.1f} MB) of {result.checkpoint} "
        f"into {result.out} in {result.seconds:.2f} s"
    )
    for name in result.files:
        print(f"  {name}")
    if result.dropped:
        print(
            f"dropped {len(result.dropped)}: {', '.join(result.dropped[:8])}{' ...' if len(result.dropped) > 8 else ''}"
        )
    if result.renamed:
        print(f"renamed {len(result.renamed)} (see torchrelay_export.json)")
    print("EXPORT_OK")
    return EXIT_FINISHED
