"""The rounding of an optimizer step that depends on the layout, measured by taking it at both layouts.

Adam, SGD and their kin update each element from that element alone: on any sharding, the same gradient gives the
same bits, and a move changes the parameters only through the order of the gradient sums (audit/drift.py). A step
that mixes the elements of a matrix does not: torch.optim.Muon orthogonalizes each matrix by a Newton-Schulz
iteration in bfloat16, and on a matrix that FSDP2 shards over W ranks (dim 0) its products are summed by DTensor in
another order on each W. Measured on the example LM (FSDP2, 2 -> 1 rank), the step of a tall matrix differs by
2 to 8 % between the layouts from the same state and gradient, a square or wide one by nothing; and once anything
differs, the bfloat16 iteration turns it into a difference of that size on every matrix it steps.

So the audit takes the step itself at each world size of the move from the same state: the checkpoint at the move
(parameters, momentum buffers, the group's hyper-parameters), with the momentum buffer as the gradient (the
gradient's own running mean: its shape and scale), each matrix sharded as the checkpoint stores it (dim 0 over the
ranks, as FSDP2 does; a matrix stored whole, as under DDP, is stepped whole, which no layout changes). The relative
difference of the two steps is that optimizer's rounding at the two layouts; audit/drift.py uses it in place of
eps where it is larger. Shampoo-like steps are not probed: their state does not name what they compute.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The keys of a param group that say it is torch.optim.Muon's (a Newton-Schulz step on each matrix).
_MUON_KEYS = ("ns_coefficients", "ns_steps")
_PROBE_TIMEOUT_S = 600.0
_MUON_ARGS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
)


@dataclass(slots=True)
class StepRounding:
    """Per parameter of a layout-dependent step, the relative difference of the step between the layouts."""

    optimizer: str  # "torch.optim.Muon", or "" where no step depends on the layout
    worlds: list[int]
    relative: dict[str, float] = field(default_factory=dict)  # `model.<fqn>` -> ||s_A - s_B|| / ||s_A||
    sharded: bool = False  # whether the matrices are stored sharded (else the step is layout-free)
    displacement: float = 0.0  # one step's size relative to the matrices' (RMS over them)

    @property
    def worst(self) -> float:
        return max(self.relative.values(), default=0.0)

    @property
    def applies(self) -> bool:
        """Whether a step here depends on the layout (else the bound is eps's alone)."""
        return self.sharded and self.worst > 0

    def rho(self, name: str, updates: int) -> float:
        """The relative rounding an update adds to a parameter's step, `updates` after a move: the measured one on
        the layout-dependent matrices; on every other parameter the share of it that reaches the model (that
        rounding times how far one step moves the matrices), from the second update on: the first one's gradient
        was taken from the same weights on both layouts, so there it is eps's alone."""
        if not self.applies:
            return 0.0
        if name in self.relative:
            return self.worst
        return self.worst * self.displacement * max(0, updates - 1) / max(1, updates)

    def line(self) -> str:
        if not self.optimizer:
            return ""
        if not self.sharded:
            return f"{self.optimizer} steps whole matrices here: its step does not depend on the layout"
        shown = ", ".join(f"{n.removeprefix('model.')} {r:.2g}" for n, r in sorted(self.relative.items())[:4])
        return (
            f"{self.optimizer}'s step taken on {' and '.join(map(str, self.worlds))} rank(s) from the same state "
            f"differs by up to {self.worst:.2g} of the step ({shown}); one step moves the matrices by "
            f"{self.displacement:.2g} of their size: the bound of each parameter holds that rounding"
        )


def muon_groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups of a checkpoint's optimizer state (relay_state.json) that are torch.optim.Muon's."""
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    return [g for g in groups if isinstance(g, dict) and all(k in g for k in _MUON_KEYS)]


def _sharded_dim0(ckpt: Path, names: list[str]) -> bool:
    """Whether the checkpoint stores these matrices in pieces along dim 0 (FSDP2's shards)."""
    from torchrelay.checkpoint import dcp_io

    md = dcp_io.read_metadata(ckpt / "model").state_dict_metadata
    for name in names:
        item = md.get(f"model.{name}")
        chunks = getattr(item, "chunks", None) or []
        if len(chunks) > 1 and all(all(o == 0 for o in c.offsets[1:]) for c in chunks):
            return True
    return False


def measure_step_rounding(ckpt: Path, worlds: list[int]) -> StepRounding:
    """Take each layout-dependent step of the checkpoint's optimizer at every world size in `worlds` from the same
    state and return how far the steps are apart (nothing to measure: an empty StepRounding)."""
    from torchrelay.checkpoint.reader import load_tensors
    from torchrelay.checkpoint.state import read_trainer_state

    distinct = sorted(set(worlds))
    groups = muon_groups(read_trainer_state(ckpt))
    if not groups or len(distinct) < 2:
        return StepRounding("", distinct)
    names = [str(n) for g in groups for n in g["params"]]
    if not _sharded_dim0(ckpt, names):
        return StepRounding("torch.optim.Muon", distinct)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensors = load_tensors(ckpt)
    work: list[dict[str, Any]] = []
    for g in groups:
        hyper = {k: g[k] for k in _MUON_ARGS if k in g}
        hyper["ns_coefficients"] = tuple(hyper.get("ns_coefficients", ()))
        for name in g["params"]:
            param, buf = tensors.get(f"model.{name}"), tensors.get(f"optim.{name}.momentum_buffer")
            if param is not None and buf is not None and param.dim() == 2:
                work.append({"name": f"model.{name}", "param": param, "buf": buf, "hyper": hyper})
    stepped = {w: _step_on(w, work) for w in distinct}
    relative: dict[str, float] = {}
    moved = sizes = 0.0
    for item in work:
        name, before = item["name"], item["param"].double()
        for a in distinct:
            for b in distinct:
                if a < b:
                    sa, sb = stepped[a][name].double() - before, stepped[b][name].double() - before
                    size = float(sa.norm())
                    r = float((sa - sb).norm()) / size if size > 0 else 0.0
                    relative[name] = max(relative.get(name, 0.0), r if math.isfinite(r) else math.inf)
        moved += float((stepped[distinct[0]][name].double() - before).norm()) ** 2
        sizes += float(before.norm()) ** 2
    displacement = math.sqrt(moved / sizes) if sizes > 0 else 0.0
    return StepRounding("torch.optim.Muon", distinct, relative, sharded=True, displacement=displacement)


def _step_on(world: int, work: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The parameters after one step on `world` ranks (gloo, this machine's CPU), gathered whole: one fresh
    interpreter per rank (`python -m torchrelay.audit.step_probe`), so no caller's __main__ is re-imported."""
    with tempfile.TemporaryDirectory(prefix="torchrelay-step-probe-") as tmp:
        source, out = Path(tmp) / "work.pt", Path(tmp) / "out.pt"
        torch.save(work, source)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torchrelay.audit.step_probe",
                    str(r),
                    str(world),
                    str(source),
                    str(out),
                    tmp,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        errors = [
            err
            for proc in ranks
            for err in [proc.communicate(timeout=_PROBE_TIMEOUT_S)[1]]
            if proc.returncode
        ]
        if errors:
            from torchrelay.audit.runner import AuditError

            raise AuditError(
                f"the step probe on {world} rank(s) failed: {errors[0].strip().splitlines()[-1:]}",
                hint="run the audit with the training environment's python (torch.optim.Muon, gloo)",
            )
        result: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
        return result


def _probe_rank(rank: int, world: int, source: str, out: str, tmp: str) -> None:
    """One rank of the probe: each matrix sharded along dim 0 over the ranks, one Muon step, gathered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        work = torch.load(source, weights_only=False)  # written by this process's parent, just now
        result = {}
        for item in work:
            param = torch.nn.Parameter(distribute_tensor(item["param"].clone(), mesh, [Shard(0)]))
            buf = distribute_tensor(item["buf"].clone(), mesh, [Shard(0)])
            opt = torch.optim.Muon([param], **item["hyper"])
            opt.state[param]["momentum_buffer"] = buf.clone()
            param.grad = buf.clone()  # the gradient's running mean, as the gradient (module docstring)
            opt.step()
            stepped = param.detach()
            result[item["name"]] = stepped.full_tensor() if isinstance(stepped, DTensor) else stepped
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # no rank leaves while another still talks to it (gloo aborts the process then)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _probe_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
