"""Validate one checkpoint of the example LM: its mean loss on held-out samples, as a small JSON of metrics.

    python examples/validate_lm.py --checkpoint runs/lm/checkpoint-24 --out metrics.json

The validation stage of a plan runs it once per checkpoint (examples/lm.plan.yaml):
    validate: {run: "python examples/validate_lm.py --checkpoint {checkpoint} --out {metrics}", updates: kept}

The weights are read tensor by tensor from the checkpoint without a process group (the optimizer is never read).
The held-out samples are the manifest's last --samples lines (the example trains on all of them; a real run would
pass its own validation manifest with --manifest).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from train_lm import ByteLM, SourceBytes, collate, lm_loss

from torchrelay.checkpoint.reader import iter_model_tensors
from torchrelay.manifest import Manifest
from torchrelay.readers import RunDir, stored_config


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="where to write the metrics JSON")
    parser.add_argument(
        "--manifest", type=Path, default=None, help="held-out samples (default: the run's own)"
    )
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rd = RunDir(args.checkpoint.resolve().parent)
    cfg = stored_config(rd)
    p = cfg.params
    manifest = Manifest.load(args.manifest or rd.manifest_path, cfg.data_root)
    model = ByteLM(p["d_model"], p["layers"], p["heads"], p["seq_len"], p["dropout"])
    model.load_state_dict(dict(iter_model_tensors(args.checkpoint)))
    model.eval()
    data = SourceBytes(manifest.records[-args.samples :], p["seq_len"])
    losses = []
    with torch.no_grad():
        for start in range(0, len(data), 8):
            xs, lengths = collate([data[i] for i in range(start, min(start + 8, len(data)))])
            losses.append(lm_loss(model, xs, lengths).item())
    loss = sum(losses) / len(losses)
    metrics = {"loss": loss, "bits_per_byte": loss / math.log(2), "samples": len(data)}
    args.out.write_text(json.dumps(metrics) + "\n")
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
