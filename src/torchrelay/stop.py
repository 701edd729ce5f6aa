"""When to stop: small pure policies over a context; signals and request files only set its inputs."""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.errors import EXIT_BUDGET, EXIT_MEMORY, EXIT_REQUEST, EXIT_SIGNAL
from torchrelay.fsutil import atomic_write_text

REQUEST_FILE = "REQUEST_STOP"
# The agreed stop code is the maximum over ranks; these values double as process exit codes.
NONE = 0
ENDED = {EXIT_BUDGET: "budget", EXIT_REQUEST: "request", EXIT_SIGNAL: "signal", EXIT_MEMORY: "memory"}


@dataclass(frozen=True, slots=True)
class StopRequest:
    job: str | None
    at_update: int | None
    reason: str
    time: float
    by: str

    @classmethod
    def read(cls, path: Path) -> StopRequest | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            data = {"job": text.strip()}  # the G3A1 convention: the file holds just a job id
        if isinstance(data, int | str):
            data = {"job": str(data)}
        elif not isinstance(data, dict):
            data = {}
        job = data.get("job")
        at = data.get("at_update")
        return cls(
            job=str(job) if job not in (None, "") else None,
            at_update=int(at) if at is not None else None,
            reason=str(data.get("reason", "user")),
            time=float(data.get("time", 0.0)),
            by=str(data.get("by", "")),
        )


def write_request(
    run_dir: str | os.PathLike[str],
    job: str | None = None,
    at_update: int | None = None,
    reason: str = "user",
) -> Path:
    """Ask the run in `run_dir` to save and stop (at the next boundary, or after `at_update`)."""
    path = Path(run_dir) / REQUEST_FILE
    try:
        by = f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        by = socket.gethostname()
    doc = {"job": job, "at_update": at_update, "reason": reason, "time": time.time(), "by": by}
    atomic_write_text(path, json.dumps(doc) + "\n")
    return path


@dataclass(slots=True)
class StopContext:
    """What the loop knows at an agreement boundary (ranks agree every `updates_to_next_check` updates)."""

    updates_done: int
    now: float
    job: str | None
    request: StopRequest | None = None
    signal_name: str | None = None
    deadline: float | None = None
    update_seconds: float = 0.0
    save_seconds: float = 0.0
    margin_seconds: float = 1.0
    updates_to_next_check: int = 1


@dataclass(frozen=True, slots=True)
class Verdict:
    code: int
    why: str


class RequestPolicy:
    """A request file is honoured when it names no job or this job, and its update has come."""

    def decide(self, ctx: StopContext) -> Verdict | None:
        req = ctx.request
        if req is None or (req.job is not None and req.job != ctx.job):
            return None
        if req.at_update is not None and ctx.updates_done < req.at_update:
            return None
        code = EXIT_MEMORY if req.reason == "memory" else EXIT_REQUEST
        return Verdict(code, f"stop requested by {req.by or 'a request file'} ({req.reason})")


class SignalPolicy:
    def decide(self, ctx: StopContext) -> Verdict | None:
        return Verdict(EXIT_SIGNAL, f"received {ctx.signal_name}") if ctx.signal_name else None


class BudgetPolicy:
    """Stop while a checkpoint still fits: if the run goes on to the next agreement, those updates, a save
    and the margin must all end by the deadline."""

    def decide(self, ctx: StopContext) -> Verdict | None:
        if ctx.deadline is None:
            return None
        ahead = ctx.updates_to_next_check * ctx.update_seconds
        needed = ahead + ctx.save_seconds + ctx.margin_seconds
        left = ctx.deadline - ctx.now
        if left < needed:
            return Verdict(
                EXIT_BUDGET,
                f"{left:.1f}s left < {ctx.updates_to_next_check} update(s) of {ctx.update_seconds:.2f}s + save {ctx.save_seconds:.2f}s"
                f" + margin {ctx.margin_seconds:.1f}s",
            )
        return None


POLICIES = (SignalPolicy(), RequestPolicy(), BudgetPolicy())


def decide(ctx: StopContext) -> Verdict | None:
    """The first policy that says stop, or None."""
    for policy in POLICIES:
        verdict = policy.decide(ctx)
        if verdict is not None:
            return verdict
    return None


def is_stale(req: StopRequest | None, job: str | None) -> bool:
    """A request naming another job: ignored by this one, and reported."""
    return req is not None and req.job is not None and req.job != job


@dataclass(slots=True)
class SignalFlag:
    """Installed in the main thread; the handler only records which signal came."""

    received: str | None = None
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self, signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        for signum in signums:
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()


def deadline_from_env(start: float) -> float | None:
    """TORCHRELAY_DEADLINE (unix seconds) and TORCHRELAY_BUDGET_S (from `start`); the earlier wins."""
    candidates = []
    if os.environ.get("TORCHRELAY_DEADLINE"):
        candidates.append(float(os.environ["TORCHRELAY_DEADLINE"]))
    if os.environ.get("TORCHRELAY_BUDGET_S"):
        candidates.append(start + float(os.environ["TORCHRELAY_BUDGET_S"]))
    return min(candidates) if candidates else None
