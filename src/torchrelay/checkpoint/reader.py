"""Read a checkpoint's tensors without a model or a process group (audits, tests, diffs)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchrelay.checkpoint import dcp_io
from torchrelay.checkpoint.state import MODEL_DIR


def load_tensors(ckpt_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, full (unsharded), named `model.<fqn>` / `optim.<fqn>.<state>`."""
    model_dir = Path(ckpt_dir) / MODEL_DIR
    md = dcp_io.read_metadata(model_dir)
    state: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        assert isinstance(item, TensorStorageMetadata)
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp_io.load(state, model_dir, no_dist=True)
    return {k.replace("\x1f", "."): v for k, v in sorted(state.items())}
