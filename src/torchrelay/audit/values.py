"""Every restored value of a checkpoint that is not a model or optimizer tensor, flat by key path: what the audit
compares beside the tensors.

A registered stateful holds numbers, strings and containers as well as tensors (nanoGPT's `best_val_loss`, an
iteration counter, early-stopping state); the optimizer's param groups and scalar state and the loop's position
are JSON; each rank's generators are restored from its own file. A `load_state_dict` that forgets one of them
resumes another run while every tensor is equal, so each is compared, bit for bit (floats as parsed from JSON,
which round-trips them exactly), and a difference is named by its key path and, where the value is kept per
rank, its rank (`…@rank<r>`).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# The loop's record of the layout a checkpoint was saved with: another segment number or layout is expected
# (the interrupted run has more segments; `--vary` may move micro_batch x grad_accum), the position is not.
LOOP_KEYS = ("update", "samples_consumed", "epoch", "global_batch")
_RNG_FILE = re.compile(r"^rank-(\d+)\.safetensors$")
_PER_RANK = re.compile(r"^(.*?)@rank(\d+)(.*)$", re.S)


def align_ranks(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`a` and `b` with what one side stored once and the other per rank named per rank on both sides.

    A save stores a value once when every rank holds it and per rank otherwise (checkpoint/ranks.py): a stateful
    that differs between ranks in one run and is the same on every rank in the other (a restored value lost on
    each rank alike) is `state/best.x` there and `state/best@rank<r>.x` here. Its shared copy is what each rank
    held, so it is compared with each rank's own.
    """

    def ranks_of(side: Mapping[str, Any]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key in sorted(side):
            found = _PER_RANK.match(key)
            if found:
                out.setdefault(found.group(1) + found.group(3), []).append(key)
        return out

    def spread(side: Mapping[str, Any], other: dict[str, list[str]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in side.items():
            out |= {own: value for own in other.get(key, [])} or {key: value}
        return out

    ra, rb = ranks_of(a), ranks_of(b)
    return spread(a, rb), spread(b, ra)


def leaves(state: Any, prefix: str) -> dict[str, Any]:
    """The values inside a nested state that are not tensors, `<prefix>.<key>…`; an empty container is a leaf."""
    out: dict[str, Any] = {}
    if isinstance(state, torch.Tensor):
        return out
    if isinstance(state, Mapping):
        if not state:
            out[prefix] = {}
        for key, value in state.items():
            out |= leaves(value, f"{prefix}.{key}")
    elif isinstance(state, list | tuple):
        if not state:
            out[prefix] = []
        for i, value in enumerate(state):
            out |= leaves(value, f"{prefix}.{i}")
    else:
        out[prefix] = state
    return out


def load_checkpoint_values(ckpt_dir: Path) -> dict[str, Any]:
    """`state/<name>.<path>` (statefuls, `<name>@rank<r>` when kept per rank), `optim.param_groups.<i>.<key>` and
    `optim.<fqn>.<name>` (the optimizer's JSON part), `loop.<key>`, `rng@rank<r>.<meta>` (each rank's generators'
    metadata; their state tensors are in `rng_tensors`)."""
    from torchrelay.checkpoint.reader import load_statefuls
    from torchrelay.checkpoint.state import read_trainer_state

    doc = read_trainer_state(Path(ckpt_dir))
    out: dict[str, Any] = {}
    loop = doc.get("loop") or {}
    out |= {f"loop.{k}": loop[k] for k in LOOP_KEYS if k in loop}
    optimizer = doc.get("optimizer")
    if isinstance(optimizer, dict):
        for i, group in enumerate(optimizer.get("param_groups") or []):
            out |= leaves(group, f"optim.param_groups.{i}")
        for fqn, scalars in (optimizer.get("scalars") or {}).items():
            out |= leaves(scalars, f"optim.{fqn}")
    for name, state in load_statefuls(ckpt_dir).items():
        out |= leaves(state, f"state/{name}")
    for rank, (_, meta) in _rng_files(Path(ckpt_dir)).items():
        out |= {f"rng@rank{rank}.{k}": v for k, v in sorted(meta.items())}
    return dict(sorted(out.items()))


def rng_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Each rank's generator states (python, numpy, torch CPU, CUDA) as `rng@rank<r>.<generator>`."""
    return {
        f"rng@rank{rank}.{k}": t
        for rank, (tensors, _) in _rng_files(Path(ckpt_dir)).items()
        for k, t in sorted(tensors.items())
    }


def _rng_files(ckpt_dir: Path) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    from torchrelay.util.safetensors_records import read_safetensors

    folder = ckpt_dir / "rng"
    out = {}
    found = (
        sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _RNG_FILE.match(p.name)))
        if folder.is_dir()
        else []
    )
    for rank, path in found:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out[rank] = read_safetensors(path, what="RNG state", root=ckpt_dir)
    return out


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, float) and isinstance(b, float) and a == 0.0 == b:
        return math.copysign(1.0, a) == math.copysign(1.0, b)  # -0.0 is not 0.0, as for the tensors
    return bool(a == b) and type(a) is type(b)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def value_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], atol: float = 0.0
) -> list[tuple[str, float, str]]:
    """(key, absolute difference or inf, "uninterrupted vs interrupted") for every value that differs by key."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            side = "interrupted" if key not in b else "uninterrupted"
            shown = _shown(a[key] if key in a else b[key])
            out.append((key, math.inf, f"value {shown} missing in the {side} run"))
            continue
        x, y = a[key], b[key]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y))
        if numbers and atol > 0.0 and abs(x - y) <= atol:
            continue
        if _same(x, y):
            continue
        diff = abs(float(x) - float(y)) if numbers else math.inf
        out.append((key, diff if math.isfinite(diff) else math.inf, f"value {_shown(x)} vs {_shown(y)}"))
    return out
