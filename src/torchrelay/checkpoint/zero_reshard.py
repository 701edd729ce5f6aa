"""A DeepSpeed ZeRO-1/2 checkpoint moved to another number of data-parallel ranks, with the same global batch.

ZeRO-1/2 keeps the model whole on every rank and partitions only the optimizer: each param group's parameters are
flattened in order into one fp32 vector (the masters), padded at its end to a multiple the data-parallel size
sets, and rank r owns the r-th equal slice of it, with the same slice of each Adam moment (`exp_avg`,
`exp_avg_sq`) and the group's `step`. So a move is exact by construction: concatenate the old ranks' slices, cut the
old padding, pad for the new size and cut the new slices. The new engine's own partition size and padding (it was
built for the new world before loading) say where to cut, so the files it loads are what it would have saved.

Why our own resharder and not DeepSpeed's universal checkpoint: that is an offline conversion (ds_to_universal)
into a per-parameter layout that a ZeRO engine loads only with `load_universal_checkpoint` set in its
configuration (the contract) and that HF Trainer cannot load (the issue, DeepSpeed #7628, #5405, transformers
#33157); it writes a second full copy of the state. Here each rank reads the old partitions of the verified
checkpoint, writes its new partition into a folder beside the checkpoint (the checkpoint itself is never changed),
DeepSpeed loads it through its ordinary path, and the move is proven: the gathered masters and both moments are
bit for bit the concatenated old ones (`prove_moved`). The cost: benchmarks/bench_zero_reshard.py.

Stage 3 partitions the parameters themselves (and per parameter, not per group): refused.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchrelay.errors import CheckpointError, ConfigError

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(?P<prefix>.*zero_pp_rank_)(?P<rank>\d+)(?P<suffix>_mp_rank_00_optim_states\.pt)$")
SINGLE = "single_partition_of_fp32_groups"
BASE = "base_optimizer_state"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(slots=True)
class FlatState:
    """Per param group, the whole (unpadded) flat fp32 masters and moments, and the group's step: what the ranks
    hold together, whatever their number."""

    masters: list[torch.Tensor]
    moments: list[dict[str, torch.Tensor]]
    steps: list[Any]

    def equal(self, other: FlatState) -> list[str]:
        """What differs from `other`, bit for bit ([] when nothing)."""
        out = []
        for g, (a, b) in enumerate(zip(self.masters, other.masters, strict=True)):
            if a.dtype != b.dtype or not torch.equal(a, b):
                out.append(f"group {g} fp32 masters")
            for key in MOMENTS:
                x, y = self.moments[g].get(key), other.moments[g].get(key)
                if (x is None) != (y is None) or (x is not None and y is not None and not torch.equal(x, y)):
                    out.append(f"group {g} {key}")
        return out


def optim_files(folder: Path) -> list[Path]:
    """The ZeRO optimizer partition files of a DeepSpeed checkpoint folder, in data-parallel rank order."""
    found = sorted(
        ((int(m.group("rank")), p) for p in folder.iterdir() if (m := _OPTIM.match(p.name))),
        key=lambda x: x[0],
    )
    if [r for r, _ in found] != list(range(len(found))) or not found:
        raise CheckpointError(
            f"{folder}: the ZeRO optimizer partitions are not ranks 0..N-1 ({[p.name for _, p in found][:4]})"
        )
    return [p for _, p in found]


def _group_state(doc: dict[str, Any], group: int) -> dict[str, Any]:
    state = (doc[BASE].get("state") or {}) if isinstance(doc.get(BASE), dict) else {}
    return state.get(group) or state.get(str(group)) or {}


def gather(docs: list[dict[str, Any]]) -> FlatState:
    """The old ranks' `optimizer_state_dict`s (rank order) as one FlatState: slices concatenated, padding cut."""
    first = docs[0]
    if not isinstance(first.get(BASE), dict):
        raise CheckpointError(
            "a ZeRO checkpoint saved with elastic_checkpoint: its layout is DeepSpeed's own"
        )
    if any(any(p) for p in first.get("param_alignment_paddings") or []):
        raise ConfigError(
            "the ZeRO checkpoint pads inside its flat groups (zero_optimization.parameter_alignment): not resharded",
            hint="keep the world size it was saved with",
        )
    masters, moments, steps = [], [], []
    for g in range(len(first[SINGLE])):
        padding = sum(int(d["group_paddings"][g]) for d in docs)
        flat = torch.cat([d[SINGLE][g].reshape(-1) for d in docs])
        numel = flat.numel() - padding
        masters.append(flat[:numel].clone())
        group = {}
        for key in MOMENTS:
            parts = [t for d in docs if isinstance(t := _group_state(d, g).get(key), torch.Tensor)]
            if len(parts) == len(docs):
                group[key] = torch.cat([t.reshape(-1) for t in parts])[:numel].clone()
        moments.append(group)
        steps.append(_group_state(first, g).get("step"))
    return FlatState(masters, moments, steps)


def partition_doc(
    whole: FlatState, template: dict[str, Any], rank: int, world: int, sizes: list[int]
) -> dict[str, Any]:
    """Rank `rank`'s `optimizer_state_dict` of `world` ranks, each group cut in slices of `sizes[g]` elements
    (the new engine's own partition size; the padding at the end of the last slices)."""
    doc = dict(template)
    singles, state, paddings = [], {}, []
    for g, size in enumerate(sizes):
        n = whole.masters[g].numel()
        if size * world < n:
            raise CheckpointError(f"group {g}: {world} partitions of {size} cannot hold its {n} elements")
        start, stop = rank * size, (rank + 1) * size
        paddings.append(max(0, stop - max(start, n)))
        singles.append(_slice(whole.masters[g], start, stop))
        entry: dict[str, Any] = {k: _slice(v, start, stop) for k, v in whole.moments[g].items()}
        if whole.steps[g] is not None:
            entry["step"] = whole.steps[g]
        state[g] = entry
    doc[SINGLE] = singles
    doc[BASE] = {**template[BASE], "state": state}
    doc["group_paddings"] = paddings
    doc["partition_count"] = [world] * len(sizes)
    doc.pop("param_slice_mappings", None)  # for DeepSpeed's universal conversion only; not read on a load
    return doc


def _slice(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    piece = flat[min(start, flat.numel()) : min(stop, flat.numel())]
    pad = (stop - start) - piece.numel()
    return torch.cat([piece, flat.new_zeros(pad)]) if pad else piece.clone()


def reshard_folder(
    source: Path, target: Path, rank: int, world: int, sizes: list[int], load: Any
) -> FlatState:
    """Write this rank's partition of `world` ranks into `target` (rank 0 also the model states, their
    dp_world_size the new one) from the old partitions in `source`; `load` reads a verified file. Returns the
    gathered old state (what the move must keep)."""
    files = optim_files(source)
    raw = [load(p) for p in files]
    whole = gather([d["optimizer_state_dict"] for d in raw])
    target.mkdir(parents=True, exist_ok=True)
    m = _OPTIM.match(files[0].name)
    assert m is not None
    doc = {
        **raw[0],
        "optimizer_state_dict": partition_doc(whole, raw[0]["optimizer_state_dict"], rank, world, sizes),
    }
    name = f"{m.group('prefix')}{rank}{m.group('suffix')}"
    torch.save(doc, target / f".{name}.tmp")
    (target / f".{name}.tmp").replace(target / name)
    if rank == 0:
        model = load(source / MODEL_STATES)
        model["dp_world_size"] = world
        torch.save(model, target / f".{MODEL_STATES}.tmp")
        (target / f".{MODEL_STATES}.tmp").replace(target / MODEL_STATES)
    return whole


def live_state(optimizer: Any) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[int]]:
    """This rank's partition of a live ZeRO-1/2 optimizer: its fp32 master slices, their moments, its paddings."""
    singles = [t.detach().reshape(-1).cpu() for t in optimizer.single_partition_of_fp32_groups]
    inner = optimizer.optimizer
    moments = []
    for t in optimizer.single_partition_of_fp32_groups:
        st = inner.state.get(t, {})
        moments.append({k: st[k].detach().reshape(-1).cpu() for k in MOMENTS if k in st})
    return singles, moments, [int(p) for p in optimizer.groups_padding]


def assemble(parts: list[tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[int]]]) -> FlatState:
    """Every rank's live_state (rank order) as one FlatState."""
    masters, moments = [], []
    for g in range(len(parts[0][0])):
        padding = sum(p[2][g] for p in parts)
        flat = torch.cat([p[0][g] for p in parts])
        numel = flat.numel() - padding
        masters.append(flat[:numel])
        moments.append(
            {
                k: torch.cat([p[1][g][k] for p in parts])[:numel]
                for k in MOMENTS
                if all(k in p[1][g] for p in parts)
            }
        )
    return FlatState(masters, moments, [None] * len(masters))


def named_state(folder: Path, load: Any) -> dict[str, torch.Tensor]:
    """A ZeRO-1/2 checkpoint folder's optimizer state per parameter, as a plain optimizer's is named
    (`optim.<fqn>.exp_avg`, `.exp_avg_sq`): the partitions gathered and cut by the model's param_shapes, in the
    order the groups were flattened. What the layout audit judges a DeepSpeed run's parameters by."""
    shapes = load(folder / MODEL_STATES).get("param_shapes") or []
    whole = gather([load(p)["optimizer_state_dict"] for p in optim_files(folder)])
    out: dict[str, torch.Tensor] = {}
    for g, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            numel = int(torch.Size(shape).numel())
            for key, flat in whole.moments[g].items():
                out[f"optim.{name}.{key}"] = flat[offset : offset + numel].reshape(shape)
            offset += numel
    return out


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
