"""Host-memory guard: the resident memory of the whole training process tree against a soft and a hard limit.

Above the soft limit the run is asked to stop cleanly (a stop request with reason "memory": the ranks save and
exit 6); above the hard limit there is no time for a save and the tree is killed. Limits come from the plan's
`memory` section, overridden by TORCHRELAY_MEM_SOFT_GIB / TORCHRELAY_MEM_HARD_GIB (the G3A1 card's HOST_GUARD_GIB).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from torchrelay.config import envvars
from torchrelay.controller.plan import MemorySpec
from torchrelay.errors import ConfigError

GIB = 1024**3
ENV_SOFT = envvars.MEM_SOFT_GIB.name
ENV_HARD = envvars.MEM_HARD_GIB.name

OK, SOFT, HARD = "ok", "soft", "hard"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLimits:
    soft_bytes: int
    hard_bytes: int

    def __post_init__(self) -> None:
        if self.soft_bytes <= 0 or self.hard_bytes < self.soft_bytes:
            raise ConfigError(
                f"memory limits must satisfy 0 < soft <= hard, got soft {self.soft_bytes / GIB:.2f} GiB, "
                f"hard {self.hard_bytes / GIB:.2f} GiB",
                hint=f"check the plan's memory section and {ENV_SOFT} / {ENV_HARD}",
            )

    @classmethod
    def resolve(
        cls, spec: MemorySpec, total_bytes: int | None = None, env: Mapping[str, str] | None = None
    ) -> MemoryLimits:
        """Limits from the environment, else the plan's GiB values, else fractions of this host's RAM."""
        env = os.environ if env is None else env
        total = psutil.virtual_memory().total if total_bytes is None else total_bytes
        soft = _gib(env, envvars.MEM_SOFT_GIB) or spec.soft_gib or 0.0
        hard = _gib(env, envvars.MEM_HARD_GIB) or spec.hard_gib or 0.0
        soft_bytes = int(soft * GIB) if soft else int(spec.soft_fraction * total)
        hard_bytes = int(hard * GIB) if hard else max(int(spec.hard_fraction * total), soft_bytes)
        return cls(soft_bytes=soft_bytes, hard_bytes=hard_bytes)

    def describe(self) -> str:
        return f"soft {self.soft_bytes / GIB:.2f} GiB, hard {self.hard_bytes / GIB:.2f} GiB"


def _gib(env: Mapping[str, str], var: envvars.Var) -> float:
    value = var.get(env)
    if value is not None and value <= 0:
        raise ConfigError(f"{var.name}={var.text(env)!r} must be > 0 GiB")
    return float(value or 0.0)


class MemoryGuard:
    """Fed one measurement at a time; says "soft" once (the stop request is enough) and "hard" when over."""

    def __init__(self, limits: MemoryLimits) -> None:
        self.limits = limits
        self.soft_tripped = False
        self.peak = 0

    def observe(self, rss: int) -> str:
        self.peak = max(self.peak, rss)
        if rss >= self.limits.hard_bytes:
            return HARD
        if rss >= self.limits.soft_bytes and not self.soft_tripped:
            self.soft_tripped = True
            return SOFT
        return OK


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # exited between listing and reading
    return total
