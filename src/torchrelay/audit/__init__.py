"""`torchrelay audit`: prove that a training script resumes exactly, or say where and why it does not."""

from __future__ import annotations

from torchrelay.audit.diagnose import (
    CAUSES,
    DATA_ORDER,
    NONDETERMINISM,
    NOT_RESTORED,
    RANK_STATE,
    RNG,
    UNKNOWN,
    UNREGISTERED,
    UNSEEDED,
)
from torchrelay.audit.runner import AuditError
from torchrelay.audit.verdict import Verdict, describe, last_verdict, shown_for_run, verdict_for_run

__all__ = [
    "CAUSES",
    "DATA_ORDER",
    "NONDETERMINISM",
    "NOT_RESTORED",
    "RANK_STATE",
    "RNG",
    "UNKNOWN",
    "UNREGISTERED",
    "UNSEEDED",
    "AuditError",
    "AuditPlan",
    "AuditSpec",
    "Verdict",
    "describe",
    "last_verdict",
    "run_audit",
    "shown_for_run",
    "verdict_for_run",
]


def __getattr__(name: str) -> object:
    # The runner pulls in torch; `torchrelay status` only needs last_verdict and should stay fast.
    if name in ("AuditSpec", "AuditPlan", "run_audit"):
        from torchrelay.audit import orchestrator

        return getattr(orchestrator, name)
    raise AttributeError(name)
