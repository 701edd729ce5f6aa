"""Restore: the one place that brings a segment back to where its checkpoint left it.

Three pieces, in the order a resume needs them: the tracked state (model, optimizer, statefuls) when the script
calls `run.track`; each rank's generators right before the first update (nothing may draw in between); and the
cross-check that the checkpoint's own loop state holds the update rank 0 chose while opening.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrelay.checkpoint import state as ckpt_state
from torchrelay.checkpoint.adapters import adapt
from torchrelay.checkpoint.deepspeed_engine import is_engine
from torchrelay.checkpoint.state import rng
from torchrelay.checkpoint.state.document import optimizers_of
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import RecordError, StateMismatch
from torchrelay.records.digests import restored_differs


@dataclass(slots=True)
class Tracked:
    """What `run.track` registered: what each save writes and a resume restores."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    statefuls: dict[str, ckpt_state.Stateful] = field(default_factory=dict)

    def register(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        statefuls: dict[str, Any],
    ) -> None:
        """Hold these objects; a generator, a NumPy or Python random stream... through its adapter."""
        self.model, self.optimizer = model, optimizer
        self.statefuls = {name: adapt(name, obj) for name, obj in statefuls.items()}

    def state_bytes(self) -> int:
        """The bytes of this rank's model and optimizer tensors (its own shard of a distributed tensor)."""
        from torch.distributed.tensor import DTensor

        from torchrelay.checkpoint.torch_compat import dtensor_local

        total = 0
        docs: list[Any] = [self.model.state_dict() if self.model is not None else {}]
        # run.track takes one optimizer or a list of them (Muon on the matrices, AdamW on the rest)
        docs += [opt.state_dict().get("state", {}) for opt in optimizers_of(self.optimizer)]
        if is_engine(self.model):
            # A DeepSpeed engine saves its optimizer too: ZeRO's wrapper holds the torch optimizer over this rank's
            # partition, whose parameters are the fp32 partition it saves beside the moments (stage 0: the model's).
            wrapper = getattr(self.model, "optimizer", None)
            base = getattr(wrapper, "optimizer", wrapper)
            if isinstance(base, torch.optim.Optimizer):
                docs += [list(base.state.values()), [g["params"] for g in base.param_groups]]
        stack: list[Any] = list(docs)
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list | tuple):
                stack.extend(item)
            elif isinstance(item, torch.Tensor):
                local = dtensor_local(item) if isinstance(item, DTensor) else item
                total += local.numel() * local.element_size()
        return total


class Restore:
    """Restores one rank from the checkpoint rank 0 chose (nothing when the segment starts a new run)."""

    def __init__(
        self,
        checkpoint: Path | None,
        update: int,
        rank: int,
        rederive: int | None = None,
        tuning: LoadTuning | None = None,
        verified: bool = False,
        digests: Path | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self._digests = digests  # this rank's digest log: the restored parameters checked against it
        # A memory checkpoint is hashed whole at open, before it is chosen (checkpoint/tiers.py): not again here.
        self._verified = verified
        self._tuning = tuning
        self.update = update
        self._rank = rank
        # After a layout change: the seed this rank's generators are derived from (reshard.rank_stream_seed), since
        # the saved streams belong to the old ranks; the model and optimizer are resharded by DCP.
        self._rederive = rederive

    def state(self, tracked: Tracked) -> None:
        """Load model, optimizer and statefuls, this rank's own copy of what differs by rank (checkpoint/ranks.py)."""
        if self.checkpoint is None:
            return
        loop = ckpt_state.load_state(
            self.checkpoint,
            rank=self._rank,
            model=tracked.model,
            optimizer=tracked.optimizer,
            statefuls=tracked.statefuls,
            verify=not self._verified,
            resharded=self._rederive is not None,
            tuning=self._tuning,
        )
        if loop.get("update") != self.update or isinstance(loop.get("update"), bool):
            # its inventory names one update, its state another: edited, or another checkpoint's file
            raise RecordError(
                str(ckpt_state.state_path(self.checkpoint)),
                f"says update {str(loop.get('update'))[:40]!r}, its checkpoint is of update {self.update}",
                field="loop.update",
                hint=f"restore it from a copy, or remove {self.checkpoint.name} to resume from an older checkpoint",
            )
        # The state right after the load against the digest update u logged when it trained (records/digests.py):
        # a checkpoint whose files agree with their inventory yet hold other values (a copy that raced the next
        # step, a staging that wrote zeros) is refused here, not trained on. Same layout only (a reshard's shards
        # differ); with no line of that update nothing is compared.
        if self._digests is not None and self._rederive is None:
            differs = restored_differs(self._digests, self.update, tracked.model)
            if differs is not None:
                raise StateMismatch(
                    f"{self.checkpoint}: {differs}",
                    hint=f"the checkpoint holds other values than its update trained: remove {self.checkpoint.name} "
                    "to resume from an older checkpoint, and report it",
                )

    def generators(self) -> None:
        """Load this rank's generators (Python, NumPy, torch CPU and CUDA): right before the first update."""
        if self.checkpoint is not None and self._rederive is not None:
            rng.seed_all(self._rederive)
        elif self.checkpoint is not None:
            ckpt_state.load_rng(self.checkpoint, self._rank)
