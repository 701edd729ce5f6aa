"""Which checkpoints survive retention, and why: small pure preservation policies, composed.

A run keeps the newest `keep` complete checkpoints for resuming, and may keep more for later use (validation at
chosen updates, an export): every `keep_every` updates, the updates listed in `keep_updates`, and the final one.
Each policy looks at the updates of the complete checkpoints and names those it preserves with a reason; a
checkpoint no policy names is deleted at the next save. Policies never see the disk: `commit.py` lists the
checkpoints, asks, and deletes; `status` asks the same question to say why each checkpoint is still there.

The same policies say where the loop must save besides `save_every`: a checkpoint to keep has to exist first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torchrelay.config.relay import RelayConfig


class PreservationPolicy(Protocol):
    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        """The updates (of `updates`, complete checkpoints oldest first) this policy keeps, with its reason."""
        ...

    def saves_at(self, update: int) -> bool:
        """Whether the loop must write a checkpoint at `update` so that this policy can keep it."""
        ...


@dataclass(frozen=True, slots=True)
class LatestN:
    """The newest `n` complete checkpoints: what a resume (or a crash during the next save) needs."""

    n: int

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        newest = sorted(updates)[-self.n :] if self.n > 0 else []
        return {u: f"latest {self.n}" for u in newest}

    def saves_at(self, update: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class EveryN:
    """Every checkpoint whose update is a multiple of `n` (keep_every)."""

    n: int

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        return {u: f"keep_every {self.n}" for u in updates if self.n > 0 and u % self.n == 0}

    def saves_at(self, update: int) -> bool:
        return self.n > 0 and update % self.n == 0


@dataclass(frozen=True, slots=True)
class Explicit:
    """The checkpoints of the listed updates (keep_updates)."""

    updates: frozenset[int]

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        return {u: "keep_updates" for u in updates if u in self.updates}

    def saves_at(self, update: int) -> bool:
        return update in self.updates


@dataclass(frozen=True, slots=True)
class SavedNow:
    """The checkpoints the loop saved because the script asked (step.save_now), as their inventories say: kept
    like keep_updates, through every later segment."""

    updates: frozenset[int]

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        return {u: "save_now" for u in updates if u in self.updates}

    def saves_at(self, update: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Final:
    """The checkpoint at the end of the schedule (the loop always writes it)."""

    total_updates: int

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        return {u: "final" for u in updates if u == self.total_updates}

    def saves_at(self, update: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class AnyOf:
    """Keeps what any of its policies keeps; the reasons of all of them are joined."""

    policies: tuple[PreservationPolicy, ...]

    def preserve(self, updates: Sequence[int]) -> dict[int, str]:
        reasons: dict[int, list[str]] = {}
        for policy in self.policies:
            for update, why in policy.preserve(updates).items():
                reasons.setdefault(update, []).append(why)
        return {u: ", ".join(reasons[u]) for u in sorted(reasons)}

    def saves_at(self, update: int) -> bool:
        return any(p.saves_at(update) for p in self.policies)


@dataclass(frozen=True, slots=True)
class Retention:
    """The verdict for one set of complete checkpoints: what stays (and why) and what goes."""

    kept: dict[int, str]
    deleted: list[int]


def policy_for(cfg: RelayConfig, saved_now: Iterable[int] = ()) -> AnyOf:
    """The run's preservation policy from its (runtime) configuration fields, and the updates step.save_now
    saved (`saved_now`, from the checkpoints' inventories)."""
    return AnyOf(
        (
            LatestN(cfg.keep),
            EveryN(cfg.keep_every),
            Explicit(frozenset(cfg.keep_updates)),
            Final(cfg.total_updates),
            SavedNow(frozenset(saved_now)),
        )
    )


def decide(policy: PreservationPolicy, updates: Iterable[int]) -> Retention:
    """Apply `policy` to the updates of the complete checkpoints; the newest is never deleted."""
    ordered = sorted(set(updates))
    kept = policy.preserve(ordered)
    if ordered and ordered[-1] not in kept:  # an invariant whatever the policy: a resume needs it
        kept[ordered[-1]] = "newest"
    return Retention(kept=dict(sorted(kept.items())), deleted=[u for u in ordered if u not in kept])


def unpreserved(cfg: RelayConfig, updates: Iterable[int]) -> list[int]:
    """Of `updates` (in the schedule), those no lasting policy keeps: only `keep` (latest N) might, until later
    saves push them out. A validation stage after the run needs them kept for sure."""
    lasting = AnyOf((EveryN(cfg.keep_every), Explicit(frozenset(cfg.keep_updates)), Final(cfg.total_updates)))
    named = sorted(u for u in set(updates) if u <= cfg.total_updates)
    kept = lasting.preserve(named)
    return [u for u in named if u not in kept]
