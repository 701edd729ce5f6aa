"""`elastic: exact`: an update's gradient summed in one order fixed by the global batch, so that it is the same bits
on any number of ranks.

With the same micro_batch, every micro-batch holds the same samples on any layout (data/order.py), so its
gradient is the same bits on any layout: the forward and backward of one micro-batch do not depend on where it
runs (no per-rank random numbers, no statistics across ranks: both refused below). Only the sum of the
micro-batch gradients changes with the layout: DDP adds a rank's micro-batches one after the other, then the ranks
in whatever order its all-reduce takes. Here they are added in one canonical binary tree over the global
micro-batch index g = micro_step x world_size + rank (order.slot), N = world_size x grad_accum of them:

    S(set) = S(evens of set) + S(odds of set), split on the lowest bit of g first,

the tree whose every node is a residue class of g modulo a power of two. A rank holds the class g = rank
(mod world_size): one node of the tree on every power-of-two layout, which is why other layouts are refused. So
a rank sums its own micro-batches as that subtree (micro-steps m and m + grad_accum/2 first, then halves again),
and the ranks' subtree sums are combined as the top of the same tree (ranks r and r + world_size/2 first). IEEE
addition is commutative, so each pair's sum is the same bits whichever side adds; only the pairing is the order.
Dividing by the world size (DDP's mean) is exact for a power of two, as is the script's loss / grad_accum.

After the reduction every rank holds the same whole gradient, so clip_grad_norm_ computes the same norm of the
same tensors on any layout (the canonical order of the norm is the one torch takes over a whole tensor list).

What it costs: a rank keeps grad_accum/2 micro-batch gradients (the leaves waiting for their pair), and the
all-gather holds world_size subtree sums; DDP's own all-reduce is not used. benchmarks/bench_exact_reduce.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torchrelay.checkpoint.torch_compat import BatchNormBase, DropoutBase
from torchrelay.errors import ConfigError, RelayError
from torchrelay.util import collective

EXACT = "exact"  # the value of config field `elastic` that turns this on


def power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_layout(world_size: int, grad_accum: int) -> None:
    """Refuse a layout on which a rank's micro-batches are not one subtree of the canonical tree."""
    for name, value in (("world_size", world_size), ("grad_accum", grad_accum)):
        if not power_of_two(value):
            raise ConfigError(
                f"config field 'elastic': exact needs a power-of-two {name}, got {value}: only then is every "
                "rank's share of the micro-batches one subtree of the canonical sum",
                hint="run on 1, 2, 4, 8... ranks with a power-of-two grad_accum, or set elastic: default",
            )


def check_model(model: torch.nn.Module) -> None:
    """Refuse what makes a micro-batch's gradient or the model's state depend on the layout, naming the module."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"step.micro_batches(model): elastic: exact needs the model (a torch.nn.Module), got {type(model).__name__}"
        )
    if callable(getattr(model, "zero_optimization_stage", None)):  # a DeepSpeed engine (it is a Module too)
        raise ConfigError(
            "elastic: exact: the model is a DeepSpeed engine, which reduces and partitions gradients itself",
            hint="wrap the model in DDP (or none) for elastic: exact, or set elastic: default",
        )
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) and callable(
        getattr(model, "set_requires_gradient_sync", None)
    ):
        raise ConfigError(
            "elastic: exact: the model is FSDP2 (fully_shard), whose reduce-scatter runs inside its backward hooks in "
            "an order torch does not let a caller choose; exact mode needs each micro-batch's whole gradient",
            hint="wrap the model in DDP (or none) for elastic: exact, or set elastic: default",
        )
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.SyncBatchNorm):
            raise ConfigError(
                f"elastic: exact: {name} is a SyncBatchNorm: its statistics span the ranks of a micro-step, so a "
                "micro-batch's gradient depends on the world size",
                hint="use GroupNorm or LayerNorm for elastic: exact, or set elastic: default",
            )
        if isinstance(module, BatchNormBase) and module.track_running_stats:
            raise ConfigError(
                f"elastic: exact: {name} is a BatchNorm that tracks running statistics: each rank updates them "
                "grad_accum times an update with its own micro-batches, so they depend on the layout",
                hint=f"give {name} track_running_stats=False, use GroupNorm or LayerNorm, or set elastic: default",
            )
        if isinstance(module, DropoutBase) and module.p > 0:
            raise ConfigError(
                f"elastic: exact: {name} is a Dropout (p={module.p}) drawing from the rank's random stream, which "
                "a move re-derives: the masks change with the layout",
                hint="draw the mask per sample with tr.sample_dropout, or set its p to 0",
            )


class ExactReduction:
    """One update's gradients: each micro-batch's taken from `.grad` after its backward, summed in the canonical
    tree, combined over the ranks in the same tree and written back as the mean, the same bits on any layout."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        grad_accum: int,
        group: dist.ProcessGroup | None = None,
        on_refusal: Callable[[RelayError], None] | None = None,
    ) -> None:
        check_layout(world_size, grad_accum)
        self.rank, self.world_size, self.grad_accum, self.group = rank, world_size, grad_accum, group
        self._on_refusal = on_refusal
        self._checked: set[int] = set()
        self._leaves: list[list[torch.Tensor | None]] = []

    def params(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The model's trainable parameters, the model checked once."""
        if id(model) not in self._checked:
            # Agreed (one exchange, once): every rank refuses the same model, and the refusal is said once.
            with collective.phase("step.micro_batches", name_rank=False, settle=self._on_refusal):
                check_model(model)
            self._checked.add(id(model))
        return [p for p in model.parameters() if p.requires_grad]

    def take(self, params: list[torch.nn.Parameter], micro: int) -> None:
        """After micro-step `micro`'s backward: keep its gradient apart (the next backward starts from none)."""
        grads: list[torch.Tensor | None] = []
        for p in params:
            grads.append(p.grad)
            p.grad = None
        half = max(1, self.grad_accum // 2)
        if micro < half:
            self._leaves.append(grads)
        else:  # the leaf's pair in the tree's lowest level: micro-steps m - A/2 and m
            self._leaves[micro - half] = _add(self._leaves[micro - half], grads)

    def local_sum(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """This rank's subtree of the canonical sum, flat (a parameter without any gradient as zeros)."""
        nodes, self._leaves = self._leaves, []
        assert len(nodes) == max(1, self.grad_accum // 2), "take() must see every micro-step"
        local = _halving(nodes)
        flat = [
            (g if g is not None else torch.zeros_like(p)).reshape(-1)
            for g, p in zip(local, params, strict=True)
        ]
        return torch.cat(flat) if flat else torch.zeros(0)

    @staticmethod
    def combine(subtrees: list[torch.Tensor]) -> torch.Tensor:
        """The ranks' subtree sums (in rank order) as the top of the canonical tree, then their mean."""
        total = _halving([[t] for t in subtrees])[0]
        assert total is not None
        return (
            total.div_(len(subtrees)) if len(subtrees) > 1 else total
        )  # DDP's mean; exact for a power of two

    def finish(self, params: list[torch.nn.Parameter]) -> None:
        """Sum this rank's subtree, combine the ranks' subtrees, and set every `.grad` to the mean."""
        flat = self.local_sum(params)
        if self.world_size > 1:
            # All-gather, then every rank adds in the same tree: the same bits everywhere, at world_size x the
            # gradient's memory for the moment (a pairwise exchange would need one; not needed at this size yet).
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            dist.all_gather(gathered, flat, group=self.group)
            flat = self.combine(gathered)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


def _add(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Element by element; a parameter without a gradient in one micro-batch contributes exact zeros."""
    out: list[torch.Tensor | None] = []
    for x, y in zip(a, b, strict=True):
        out.append(y if x is None else x if y is None else x.add_(y))
    return out


def _halving(nodes: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """The canonical tree over nodes in index order: i with i + n/2, then again, down to one."""
    while len(nodes) > 1:
        half = len(nodes) // 2
        nodes = [_add(nodes[i], nodes[i + half]) for i in range(half)]
    return nodes[0]
