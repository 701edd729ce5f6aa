"""The cost model: is there time for one more update, a save and the margin? Pure objects, no clock inside."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from torchrelay.errors import ConfigError
from torchrelay.util.records import Field, Optional, Schema

_SECONDS = Field(float, low=0, high=1e7)  # at most 116 days: longer than any job's limit
# measurements.json of an attempt (controller/attempts.py): a value of another type, NaN, negative or huge was
# used as it came (a NaN reached the ranks as TORCHRELAY_SAVE_ESTIMATE_S), and is refused naming its field.
MEASUREMENTS_SCHEMA = Schema(
    {
        "update_s": Optional(_SECONDS),
        "save_s": Optional(_SECONDS),
        "startup_s": Optional(_SECONDS),
        "checkpoint_bytes": Optional(Field(int, low=0, high=1 << 60)),
        "source": Optional(Field(str, length=64)),
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """Seconds measured by a smoke run (or estimated in the plan) and the size of one checkpoint."""

    update_s: float = 0.0
    save_s: float = 0.0
    startup_s: float = 0.0  # launch until the first update starts (imports, rendezvous, restore)
    checkpoint_bytes: int = 0
    source: str = "plan"  # smoke | plan | attempt_NN

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> Measurements:
        return cls(
            update_s=float(data.get("update_s", 0.0)),
            save_s=float(data.get("save_s", 0.0)),
            startup_s=float(data.get("startup_s", 0.0)),
            checkpoint_bytes=int(data.get("checkpoint_bytes", 0)),
            source=source or str(data.get("source", "plan")),
        )


@dataclass(frozen=True, slots=True)
class Decision:
    go: bool
    needed_s: float
    left_s: float | None
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Start (or continue) only when startup + one update + one save + margin fit before the deadline."""

    measurements: Measurements
    margin_s: float

    def needed_s(self) -> float:
        m = self.measurements
        return m.startup_s + m.update_s + m.save_s + self.margin_s

    def decide(self, deadline: float | None, now: float) -> Decision:
        needed = self.needed_s()
        if deadline is None:
            return Decision(True, needed, None, "no deadline")
        left = deadline - now
        m = self.measurements
        parts = f"startup {m.startup_s:.1f}s + update {m.update_s:.2f}s + save {m.save_s:.2f}s + margin {self.margin_s:.1f}s"
        if left < needed:
            return Decision(False, needed, left, f"{left:.1f}s left < {needed:.1f}s needed ({parts})")
        return Decision(True, needed, left, f"{left:.1f}s left >= {needed:.1f}s needed ({parts})")

    def training_deadline(self, deadline: float | None) -> float | None:
        """The TORCHRELAY_DEADLINE handed to training: the deadline less the margin (process teardown)."""
        return None if deadline is None else deadline - self.margin_s


def validation_fits(estimate_s: float, deadline: float | None, now: float, margin_s: float) -> Decision:
    """One more validation of a checkpoint (about `estimate_s`, 0 when never measured) fits before the deadline?

    An unmeasured validation starts when anything is left beyond the margin: it is stopped at the deadline and
    recorded as interrupted, and its checkpoint stays to do for the next launch.
    """
    needed = estimate_s + margin_s
    if deadline is None:
        return Decision(True, needed, None, "no deadline")
    left = deadline - now
    what = (
        f"validation {estimate_s:.1f}s + margin {margin_s:.1f}s" if estimate_s else f"margin {margin_s:.1f}s"
    )
    if left < needed or left <= margin_s:
        return Decision(False, needed, left, f"{left:.1f}s left < {needed:.1f}s needed ({what})")
    return Decision(True, needed, left, f"{left:.1f}s left >= {needed:.1f}s needed ({what})")


def parse_deadline(text: str) -> float:
    """`--deadline`: unix seconds or an ISO 8601 time (naive times are local)."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
        except ValueError as exc:
            raise ConfigError(
                f"--deadline {text!r} is neither unix seconds nor an ISO time",
                hint="e.g. --deadline 1767225600 or --deadline 2026-12-31T23:00:00",
            ) from exc
    if not math.isfinite(value):
        raise ConfigError(f"--deadline {text!r} is not a finite time")
    return value


def earliest(*deadlines: float | None) -> float | None:
    """The earliest of the given deadlines, or None when none is given."""
    given = [d for d in deadlines if d is not None]
    return min(given) if given else None
