"""`torchrelay export RUN_DIR|CHECKPOINT OUT`: model weights as safetensors, with provenance and SHA256SUMS."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrelay.commands.argtypes import update
from torchrelay.errors import EXIT_FINISHED, ConfigError


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
    parser.add_argument(
        "--parity", type=int, default=None, metavar="N",
        help="load the export with from_pretrained and compare its logits with the training model's on the run's "
        "first N samples (float32: equal; lower: --parity-kl); a failure writes nothing, exit 2",
    )  # fmt: skip
    parser.add_argument(
        "--parity-hooks", type=Path, default=None, metavar="FILE",
        help="Python file defining training_model(config), inputs(config, record), training_logits(model, inputs)",
    )  # fmt: skip
    parser.add_argument(
        "--parity-kl", type=float, default=1e-2, metavar="NATS",
        help="below float32: the largest mean KL(training || export) per position (default 0.01)",
    )  # fmt: skip
    parser.add_argument(
        "--parity-max-abs", type=float, default=None, metavar="X",
        help="below float32: also hold the largest |logit error| to X (default: recorded only)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    # here, not at the top: it imports torch (~2 s), which `export --help` does not need
    from torchrelay.export import ExportOptions, ParityOptions, export_weights, parse_rename, parse_size

    parity = None
    if args.parity is not None or args.parity_hooks is not None:
        if args.parity is None or args.parity_hooks is None:
            raise ConfigError("export --parity N and --parity-hooks FILE go together")
        parity = ParityOptions(
            samples=args.parity, hooks=args.parity_hooks, kl=args.parity_kl, max_abs=args.parity_max_abs
        )
    options = ExportOptions(
        format=args.format,
        dtype=args.dtype,
        drop=list(args.drop),
        rename=[parse_rename(r) for r in args.rename],
        max_shard_bytes=parse_size(args.max_shard_size),
        include=list(args.include),
        checkpoint=args.checkpoint,
        parity=parity,
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
    if result.parity is not None:
        p = result.parity
        said = "equal logits" if p["mode"] == "exact" else f"KL {p['kl']:.3g}, max |error| {p['max_abs']:.3g}"
        print(f"parity: {p['samples']} samples of the run, {p['dtype']}: {said} (torchrelay_export.json)")
    print("EXPORT_OK")
    return EXIT_FINISHED
