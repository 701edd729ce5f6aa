"""Whether the update just done saves, and into which tier: a pure decision fed a context.

The loop asks after every update; nothing here touches the state, the disk or the ranks, so a test asks the same
question with plain numbers. What a save costs and how it is written is the Saver's business (run/saver.py). A stop
saves once more whatever this says (the loop's stop path); the end of the schedule saves as a stop does.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrelay.checkpoint.retention import PreservationPolicy


@dataclass(frozen=True, slots=True)
class SaveContext:
    """What the decision sees: the update just done, where the schedule ends, and whether the ranks agreed to save
    it (step.save_now)."""

    update: int
    total_updates: int
    saving: bool = False


@dataclass(frozen=True, slots=True)
class SaveVerdict:
    """Save the update durably (the run directory), into node memory, or not at all; durable wins over memory."""

    durable: bool = False
    memory: bool = False

    def __bool__(self) -> bool:
        return self.durable or self.memory


@dataclass(frozen=True, slots=True)
class SaveDecision:
    """Every `save_every` updates durably, and at the updates retention keeps (a checkpoint to keep has to exist
    first), and whenever the ranks agreed to (step.save_now, the last update too); every `memory_every` updates
    into the memory tier (0: no memory tier)."""

    save_every: int
    retention: PreservationPolicy
    memory_every: int = 0

    def decide(self, ctx: SaveContext) -> SaveVerdict:
        """The verdict for `ctx`; never at the end of the schedule unless asked (a stop's save covers it)."""
        u = ctx.update
        if ctx.saving:
            return SaveVerdict(durable=True)
        if u <= 0 or u >= ctx.total_updates:
            return SaveVerdict()
        if u % self.save_every == 0 or self.retention.saves_at(u):
            return SaveVerdict(durable=True)
        return SaveVerdict(memory=self.memory_every > 0 and u % self.memory_every == 0)
