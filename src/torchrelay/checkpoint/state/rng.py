"""Per-rank random state (python, numpy, torch CPU, CUDA): captured to safetensors, restored exactly."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from torchrelay.errors import CheckpointError, RecordError
from torchrelay.util.records import check, parse_json
from torchrelay.util.safetensors_records import read_safetensors

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


def load(path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None) -> None:
    """Restore every generator from `path` (inside `root`, the checkpoint); refuse a file that is not this
    format's, a pickle or a forged header among them, in one RecordError naming it, before any generator moves."""
    tensors, meta = read_safetensors(path, what="RNG state", root=root)
    if meta.get("format") != str(RNG_FORMAT):
        raise CheckpointError(f"{path}: RNG state format {meta.get('format')!r} is not {RNG_FORMAT}")
    python, numpy_state, torch_cpu, saved_cuda = _checked(path, tensors, meta)
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_cpu)
    if saved_cuda and torch.cuda.is_available():
        if saved_cuda != torch.cuda.device_count():
            raise CheckpointError(
                f"{path}: saved with {saved_cuda} CUDA devices visible, {torch.cuda.device_count()} now",
                hint="launch with the same CUDA_VISIBLE_DEVICES per rank",
            )
        torch.cuda.set_rng_state_all([tensors[f"cuda_{i}"] for i in range(saved_cuda)])


def _checked(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> tuple[Any, Any, torch.Tensor, int]:
    """Every generator's state from the file's tensors and metadata, each checked to be what capture() wrote."""
    source = f"{path} (RNG state)"
    try:
        gauss = parse_json(meta["python_gauss"], source=f"{source} python_gauss")
        npm = check(
            parse_json(meta["numpy"], source=f"{source} numpy"),
            {"name": str, "pos": int, "has_gauss": int, "cached": float},
            source=f"{source} numpy",
        )
        python = (
            int(meta["python_version"]),
            tuple(int(x) for x in _tensor(tensors, "python", torch.int64, source).tolist()),
            gauss,
        )
        keys = _tensor(tensors, "numpy_keys", torch.int64, source).numpy().astype(np.uint32)
        numpy_state = (npm["name"], keys, npm["pos"], npm["has_gauss"], npm["cached"])
        torch_cpu = _tensor(tensors, "torch_cpu", torch.uint8, source)
        saved_cuda = int(meta.get("cuda_devices", "0"))
        # What the generators would refuse, asked first on throwaway ones: a bad state moves none of them.
        random.Random().setstate(python)
        np.random.RandomState().set_state(numpy_state)
        torch.Generator().set_state(torch_cpu)
    except RecordError:
        raise
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise RecordError(
            source,
            f"not a state capture() writes ({type(exc).__name__}: {str(exc)[:200]})",
            hint="the file is damaged; restore it, or resume from an older checkpoint",
        ) from None
    return python, numpy_state, torch_cpu, saved_cuda


def _tensor(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype, source: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None or t.dtype != dtype or t.dim() != 1:
        raise RecordError(source, f"holds no 1-D {dtype} tensor {name!r}")
    return t


def seed_all(seed: int) -> None:
    """Seed every generator of this rank (python, numpy, torch CPU, every CUDA device) from one integer.

    After a layout change the saved streams belong to ranks that no longer exist; each new rank gets streams
    that are a pure function of its place (reshard.rank_stream_seed), so the same move made twice draws the same.
    """
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # every CUDA device too


def seed_script_streams(seed: int) -> None:
    """Seed Python's `random` and numpy's global generator (not torch's: the script seeds it, and its model's
    initialization depends on it) from one integer: each launch opens with them in the same state."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "rng" / f"rank-{rank}.safetensors"
