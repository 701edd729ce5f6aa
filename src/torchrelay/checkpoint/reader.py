"""Read a checkpoint's tensors without a model or a process group (audits, tests, diffs)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
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


MODEL_PREFIX = "model."  # DCP flattens {"model": state_dict} into "model.<fqn>"


def model_tensor_specs(ckpt_dir: str | os.PathLike[str]) -> dict[str, tuple[list[int], torch.dtype]]:
    """{fqn: (shape, dtype)} of the model's tensors, keyed as the module's own state_dict; reads no tensor."""
    md = dcp_io.read_metadata(Path(ckpt_dir) / MODEL_DIR)
    out = {}
    for key, item in sorted(md.state_dict_metadata.items()):
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            out[key.removeprefix(MODEL_PREFIX)] = (list(item.size), item.properties.dtype)
    return out


def iter_model_tensors(
    ckpt_dir: str | os.PathLike[str], names: list[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, full tensor) of the model (not the optimizer), one at a time, in the order of `names` (default: all,
    sorted): only one tensor is in memory at a time, whatever the checkpoint's size."""
    model_dir = Path(ckpt_dir) / MODEL_DIR
    md = dcp_io.read_metadata(model_dir)
    for name in names if names is not None else list(model_tensor_specs(ckpt_dir)):
        yield name, dcp_io.read_tensor(model_dir, md, MODEL_PREFIX + name)
