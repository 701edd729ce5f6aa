"""Per-rank random state (python, numpy, torch CPU, CUDA): captured to safetensors, restored exactly."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from torchrelay.errors import CheckpointError

RNG_FORMAT = 1


def capture() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata that together hold every generator's state on this rank."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    name, keys, pos, has_gauss, cached = np_state
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    meta = {
        "format": str(RNG_FORMAT),
        "python_version": str(py_version),
        "python_gauss": json.dumps(py_gauss),
        "numpy": json.dumps(
            {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
        ),
        "cuda_devices": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
    }
    return tensors, meta


def save(path: str | os.PathLike[str]) -> None:
    tensors, meta = capture()
    save_file(tensors, str(path), metadata=meta)


def load(path: str | os.PathLike[str]) -> None:
    """Restore every generator from `path`; refuse a format or device-count mismatch loudly."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta: dict[str, Any] = f.metadata() or {}
    if meta.get("format") != str(RNG_FORMAT):
        raise CheckpointError(f"{path}: RNG state format {meta.get('format')!r} is not {RNG_FORMAT}")
    tensors = load_file(str(path))
    random.setstate(
        (
            int(meta["python_version"]),
            tuple(int(x) for x in tensors["python"].tolist()),
            json.loads(meta["python_gauss"]),
        )
    )
    npm = json.loads(meta["numpy"])
    np.random.set_state(
        (
            npm["name"],
            tensors["numpy_keys"].numpy().astype(np.uint32),
            npm["pos"],
            npm["has_gauss"],
            npm["cached"],
        )
    )
    torch.set_rng_state(tensors["torch_cpu"])
    saved_cuda = int(meta.get("cuda_devices", "0"))
    if saved_cuda and torch.cuda.is_available():
        if saved_cuda != torch.cuda.device_count():
            raise CheckpointError(
                f"{path}: saved with {saved_cuda} CUDA devices visible, {torch.cuda.device_count()} now",
                hint="launch with the same CUDA_VISIBLE_DEVICES per rank",
            )
        torch.cuda.set_rng_state_all([tensors[f"cuda_{i}"] for i in range(saved_cuda)])


def seed_all(seed: int) -> None:
    """Seed every generator of this rank (python, numpy, torch CPU, every CUDA device) from one integer.

    After a layout change the saved streams belong to ranks that no longer exist; each new rank gets streams
    that are a pure function of its place (reshard.rank_stream_seed), so the same move made twice draws the same.
    """
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # every CUDA device too


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "rng" / f"rank-{rank}.safetensors"
