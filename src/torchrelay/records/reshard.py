"""Math versus layout: what a run may change when it moves to another number of ranks, and what it may not.

The math of an update is its global batch (which samples, in which order), the schedule, the optimizer's
hyper-parameters and the precision: all in the resume contract. The layout is how the global batch is spread:
the world size and the micro-batch x gradient-accumulation split, with micro_batch x grad_accum x world_size =
global_batch. A layout change keeps the global batch, so every update sees the same samples (data/order.py cuts
each global batch into micro-batches and ranks without the world size); it is accepted only when asked for
(`torchrelay launch --reshard`, a plan's `train.reshard` or in-place fallback, TORCHRELAY_RESHARD=1,
`Run.open(reshard=True)` or `prepare --world-size N`) and recorded as the segment's
`layout_change` in history.jsonl; only `prepare` also writes it into REBASE_RECORD.json (an in-place move writes no
such file). A change of the global batch is another run and is refused. What a move keeps exactly and what it
changes: docs/ELASTIC.md.

The layout a checkpoint was saved with is its own (trainer_state.json `loop`); checkpoints written before
layouts could change say only their world size, and their split is the contract's.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from torchrelay.config import envvars
from torchrelay.errors import ContractMismatch
from torchrelay.util.records import Field, Optional, Schema

RESHARD_ENV = envvars.RESHARD.name
LAYOUT_FIELDS = ("world_size", "micro_batch", "grad_accum")
# Contract fields that repeat the run's grad_accum in a framework's own terms (a Trainer's TrainingArguments and the
# DeepSpeed configuration it records): layout like grad_accum itself while the global batch is kept, since the
# integration derives them from the run (integrations/transformers.py); with another global batch they are named.
GRAD_ACCUM_MIRRORS = (
    "params.training_args.gradient_accumulation_steps",
    "params.training_args.deepspeed.gradient_accumulation_steps",
    "params.deepspeed.gradient_accumulation_steps",
)
# What a layout change cannot carry over, and what replaces it (history.jsonl, `layout_change.rng`).
RNG_REDERIVED = "re-derived per rank from (seed, update, rank, world size)"


@dataclass(frozen=True, slots=True)
class Layout:
    """How one global batch is spread: world_size ranks x grad_accum micro-steps x micro_batch samples."""

    world_size: int
    micro_batch: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch * self.grad_accum

    def product(self) -> str:
        """'micro_batch 4 x grad_accum 2 x world_size 2 = 16'."""
        return (
            f"micro_batch {self.micro_batch} x grad_accum {self.grad_accum} x world_size {self.world_size} "
            f"= {self.global_batch}"
        )

    def to_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum}

    def __str__(self) -> str:
        return f"{self.world_size} rank(s) x {self.grad_accum} micro-step(s) x {self.micro_batch} sample(s)"


def reshard_asked(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """TORCHRELAY_RESHARD=1 (or true/yes): this launch may continue the run on another layout."""
    return bool(envvars.RESHARD.get(environ))


def reshard_asker(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """Who asked for this launch's layout change, as history.jsonl records it (`asked_by`): the controller's
    TORCHRELAY_RESHARD_BY (`launch --reshard, attempt 3`), else "reshard" (the variable or `Run.open`)."""
    return envvars.RESHARD_BY.text(environ) or "reshard"


def contract_layout(fields: dict[str, Any]) -> Layout:
    """The layout the run was created with (its contract)."""
    return Layout(int(fields["world_size"]), int(fields["micro_batch"]), int(fields["grad_accum"]))


def contract_global_batch(fields: dict[str, Any]) -> int:
    if isinstance(fields.get("global_batch"), int):
        return int(fields["global_batch"])
    return contract_layout(fields).global_batch


def checkpoint_layout(loop: dict[str, Any] | None, fields: dict[str, Any]) -> Layout:
    """The layout a checkpoint was saved with: its trainer state's, else (an older checkpoint, or none) the
    contract's split with the checkpoint's world size."""
    base = contract_layout(fields)
    if not loop:
        return base
    ws = loop.get("world_size", base.world_size)
    mb = loop.get("micro_batch", base.micro_batch)
    ga = loop.get("grad_accum", base.grad_accum)
    return Layout(int(ws), int(mb), int(ga))


def resolve(
    *,
    global_batch: int,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    original: Layout,
    current: Layout,
    explicit: set[str],
    reshard: bool,
) -> tuple[Layout, list[str]]:
    """The layout this launch runs with, and notes on what was taken from where.

    A script passes the configuration it was written with on every launch; after a layout change that would
    name the original split. So a split equal to the original one, not overridden explicitly, means "the run's
    current split" (the checkpoint's). When resharding, grad_accum (unless given) is derived so the product
    stays the global batch. Nothing here refuses: the contract comparison does, naming the product.
    """
    notes: list[str] = []
    mb, ga = micro_batch, grad_accum
    if (mb, ga) == (original.micro_batch, original.grad_accum) and (mb, ga) != (
        current.micro_batch,
        current.grad_accum,
    ):
        if "micro_batch" not in explicit:
            mb = current.micro_batch
        if "grad_accum" not in explicit:
            ga = current.grad_accum
        if (mb, ga) != (micro_batch, grad_accum):
            notes.append(
                f"kept the run's current split micro_batch={mb}, grad_accum={ga} (the script's config names the "
                f"original {micro_batch} x {grad_accum}); override them explicitly to change them"
            )
    if reshard and "grad_accum" not in explicit and world_size * mb * ga != global_batch:
        per_step = world_size * mb
        if global_batch % per_step == 0:
            notes.append(
                f"grad_accum {ga} -> {global_batch // per_step}: global batch {global_batch} over {world_size} "
                f"rank(s) of micro_batch {mb}"
            )
            ga = global_batch // per_step
    return Layout(world_size, mb, ga), notes


def refuse_global_batch(
    path: str, recorded: int, original: Layout, new: Layout, diffs: list[tuple[str, Any, Any]]
) -> ContractMismatch:
    """The refusal of a launch whose layout makes another global batch, naming the product and what changed
    (`diffs`: the contract fields that differ, the global batch and its factors)."""
    changed = [
        f"{name} {getattr(original, name)} -> {getattr(new, name)}"
        for name in LAYOUT_FIELDS
        if getattr(original, name) != getattr(new, name)
    ]
    per_step = new.world_size * new.micro_batch
    fits = (
        f"on {new.world_size} rank(s) with micro_batch {new.micro_batch} keep it with grad_accum "
        f"{recorded // per_step}"
        if recorded % per_step == 0
        else f"{recorded} is not a multiple of world_size x micro_batch = {per_step}: choose another "
        "micro_batch or world size"
    )
    return ContractMismatch(
        path,
        diffs,
        detail=(
            f"the global batch is the product micro_batch x grad_accum x world_size: the run's is "
            f"{recorded} ({original.product()}), this launch's is {new.product()} "
            f"({', '.join(changed) or 'no factor changed'}); a different global batch is a different run"
        ),
        hint=f"continue with the same global batch: {fits} (`launch --reshard` or TORCHRELAY_RESHARD=1 derives "
        "grad_accum)",
    )


def refuse_unasked(path: str, current: Layout, new: Layout) -> ContractMismatch:
    """The refusal of a layout change nobody asked for."""
    diffs = [
        (name, getattr(current, name), getattr(new, name))
        for name in LAYOUT_FIELDS
        if getattr(current, name) != getattr(new, name)
    ]
    return ContractMismatch(
        path,
        diffs,
        detail=(
            f"the layout changes from {current} to {new} with the same global batch {new.global_batch}: "
            "a layout change is accepted only when asked for"
        ),
        hint=f"launch with the checkpoint's layout ({current}), or ask for the change: `torchrelay launch PLAN "
        f"--reshard`, {RESHARD_ENV}=1 for this launch, or `torchrelay prepare BUNDLE --world-size N` "
        "(docs/ELASTIC.md)",
    )


_COUNT = 1 << 40  # a batch or an update: more than any run (records/contract.py)
LAYOUT_SCHEMA = Schema(
    {
        "world_size": Field(int, low=1, high=1 << 20),
        "micro_batch": Field(int, low=1, high=_COUNT),
        "grad_accum": Field(int, low=1, high=_COUNT),
    }
)
# A `layout_change` as history.jsonl and REBASE_RECORD.json hold it (change_record): what a resume, status and
# prepare compute with is checked before (a world size of Infinity overflowed an int).
LAYOUT_CHANGE_SCHEMA = Schema(
    {
        "from": Optional(Field(dict, fields=LAYOUT_SCHEMA)),
        "to": Field(dict, fields=LAYOUT_SCHEMA),
        "global_batch": Optional(Field(int, low=1, high=_COUNT)),
        "at_update": Optional(Field(int, low=0, high=_COUNT)),
        "asked_by": Optional(Field(str, length=64)),
        "rng": Optional(Field(str, length=200)),
        "notes": Optional(Field([str], items=64)),
    }
)


def change_record(old: Layout, new: Layout, update: int, how: str, notes: list[str]) -> dict[str, Any]:
    """The `layout_change` of a segment (history.jsonl, every move) and of a prepare (REBASE_RECORD.json too)."""
    return {
        "from": old.to_dict(),
        "to": new.to_dict(),
        "global_batch": new.global_batch,
        "at_update": update,
        "asked_by": how,
        "rng": RNG_REDERIVED,
        "notes": notes,
    }


def describe_change(record: Any) -> str:
    """One line for `status` and `report`: '2 x 2 x 4 -> 1 x 4 x 4 ranks x micro-steps x samples at update 8 ...'."""
    if not isinstance(record, dict):
        return ""
    try:
        old, new = Layout(**record["from"]), Layout(**record["to"])
    except (KeyError, TypeError):
        return f"layout change (unreadable record: {str(record)[:80]})"
    return (
        f"layout change at update {record.get('at_update')} ({record.get('asked_by', '?')}): {old} -> {new}, "
        f"global batch {record.get('global_batch')} kept; rank RNG streams re-derived"
    )


def rank_stream_seed(seed: int, update: int, rank: int, world_size: int) -> int:
    """The seed of a rank's generators after a layout change: a pure function of the new layout's position."""
    digest = hashlib.sha256(
        f"torchrelay-rank-stream-v1:{seed}:{update}:{rank}:{world_size}".encode()
    ).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
