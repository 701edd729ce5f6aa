"""Benchmark `torchrelay export`: its peak resident memory on a checkpoint of a few GB, against the checkpoint's size.

A synthetic torchrelay checkpoint (DCP shards of fp32 model tensors and a small optimizer part, with its
COMPLETE.json) is written by a child process; then each measured command runs as the only child of a fresh
wrapper process that reports `getrusage(RUSAGE_CHILDREN).ru_maxrss`, the kernel's exact peak RSS of that command:

- `import torch` and torchrelay's export module only (the interpreter's fixed cost);
- `torchrelay export CKPT OUT` (streams tensor by tensor), and the same with `--dtype bf16`;
- for contrast, reading the whole model at once (`torchrelay.checkpoint.reader.load_tensors`).

    .venv/bin/python benchmarks/bench_export.py --gb 2.5

The synthetic files are deleted afterwards (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from benchlib import wait_quiet

MB = 10**6

GENERATE = textwrap.dedent(
    """
    import sys, time, warnings
    from pathlib import Path
    import torch
    from torchrelay.checkpoint import dcp_io
    from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory

    ckpt, total, hidden, vocab = Path(sys.argv[1]), int(float(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    g = torch.Generator().manual_seed(0)
    model = {"embed.weight": torch.randn(vocab, hidden, generator=g)}
    size = model["embed.weight"].nbytes
    layer = 0
    while size < total - vocab * hidden * 4:  # layers until the head (as large as the embedding) fills the rest
        for name, shape in (("attn.qkv", (3 * hidden, hidden)), ("attn.out", (hidden, hidden)),
                            ("mlp.up", (4 * hidden, hidden)), ("mlp.down", (hidden, 4 * hidden))):
            model[f"layers.{layer}.{name}.weight"] = torch.randn(*shape, generator=g)
            size += model[f"layers.{layer}.{name}.weight"].nbytes
        model[f"layers.{layer}.norm.weight"] = torch.ones(hidden)
        layer += 1
    model["head.weight"] = torch.randn(vocab, hidden, generator=g)
    optim = {"layers.0.attn.out.weight\\x1fexp_avg": torch.zeros(hidden, hidden)}  # export must skip it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_io.save({"model": model, "optim": optim}, ckpt / "model")
    write_inventory(ckpt, inventory_entries(ckpt, list_files(ckpt)), update=1, created=time.time())
    print(len(model), layer, max(t.nbytes for t in model.values()))
    """
)

# The measured command is the wrapper's only child: RUSAGE_CHILDREN's ru_maxrss is that command's peak (KiB).
WRAPPER = textwrap.dedent(
    """
    import json, resource, subprocess, sys, time
    t = time.perf_counter()
    rc = subprocess.run(sys.argv[1:]).returncode
    print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t,
                      "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
    """
)


def measure(cmd: list[str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"{cmd} failed:\n{out.stderr[-3000:]}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/torchrelay-bench-export"))
    ap.add_argument("--gb", type=float, default=2.5, help="model bytes in the checkpoint (fp32)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and exports")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument(
        "--quiet-wait", type=float, default=30.0, help="seconds to wait for an idle machine first"
    )
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt = args.dir / "checkpoint-1"
    try:
        print(f"writing a {args.gb:.2f} GB synthetic checkpoint into {ckpt} ...", flush=True)
        gen = subprocess.run(
            [sys.executable, "-c", GENERATE, str(ckpt), str(args.gb * 1e9), str(args.hidden), str(args.vocab)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        tensors, layers, largest = (int(x) for x in gen.stdout.split())
        ckpt_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        busy = wait_quiet(args.quiet_wait)
        cli = [sys.executable, "-m", "torchrelay", "export"]
        base = measure([sys.executable, "-c", "import torch, torchrelay.export"])
        fp32 = measure([*cli, str(ckpt), str(args.dir / "out-fp32"), "--max-shard-size", "1GB"])
        bf16 = measure([*cli, str(ckpt), str(args.dir / "out-bf16"), "--dtype", "bf16"])
        whole = measure(
            [sys.executable, "-c", "import sys; from torchrelay.checkpoint.reader import load_tensors; "
             "load_tensors(sys.argv[1])", str(ckpt)]
        )  # fmt: skip
        out_files = sorted(p.name for p in (args.dir / "out-fp32").iterdir())
        check = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=args.dir / "out-fp32")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    def row(name: str, m: dict[str, float]) -> str:
        return (
            f"{name}: peak RSS {m['peak_rss'] / MB:,.0f} MB = {m['peak_rss'] / ckpt_bytes:.3f} × the checkpoint, "
            f"{m['seconds']:.1f} s"
        )

    lines = [
        f"checkpoint: {ckpt_bytes / MB:,.0f} MB on disk ({tensors} fp32 model tensors in {layers} layers + "
        f"embedding and head; largest tensor {largest / MB:,.0f} MB; a small optimizer part export skips)",
        row("`import torch, torchrelay.export` (fixed cost)", base),
        row("`torchrelay export` (fp32, 1 GB shards)", fp32)
        + f"; above the fixed cost: {(fp32['peak_rss'] - base['peak_rss']) / MB:,.0f} MB "
        f"= {(fp32['peak_rss'] - base['peak_rss']) / largest:.2f} × the largest tensor; "
        f"{ckpt_bytes / fp32['seconds'] / MB:,.0f} MB/s incl. verifying the inventory",
        row("`torchrelay export --dtype bf16`", bf16),
        row("contrast: the whole model read at once (`load_tensors`)", whole),
        f"export files: {', '.join(out_files)}; `sha256sum -c SHA256SUMS`: {'OK' if check.returncode == 0 else 'FAILED'}",
        f"machine busy before measuring: {busy:.0%} of all cores (other work shares them)",
    ]
    for line in lines:
        print(line)
    if args.json:
        args.json.write_text(json.dumps(
            {"checkpoint_bytes": ckpt_bytes, "largest_tensor": largest, "import": base, "export_fp32": fp32,
             "export_bf16": bf16, "load_whole": whole, "check_ok": check.returncode == 0},
            indent=1,
        ))  # fmt: skip
    return 0 if check.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
