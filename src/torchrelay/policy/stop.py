"""When to stop: small pure policies over a context; signals and request files only set its inputs."""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from torchrelay.config import envvars
from torchrelay.errors import (
    EXIT_BUDGET,
    EXIT_MEMORY,
    EXIT_REQUEST,
    EXIT_SIGNAL,
    ConfigError,
    PathError,
    UnsafeInput,
)
from torchrelay.paths.layout import REQUEST_STOP
from torchrelay.paths.rundir import RunDir
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.safepath import open_regular

REQUEST_FILE = REQUEST_STOP  # the name lives in paths/layout.py
# The agreed stop code is the maximum over ranks; these values double as process exit codes.
NONE = 0


# A request is a few dozen bytes; a larger file is still a request, but it is never read whole.
REQUEST_MAX_BYTES = 64 * 1024
# What `echo -n $SLURM_JOB_ID > REQUEST_STOP` writes: a job id (arrays: 123_4, heterogeneous jobs: 123+0).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


@dataclass(frozen=True, slots=True)
class StopRequest:
    job: str | None
    at_update: int | None
    reason: str
    time: float
    by: str
    note: str | None = None  # what was wrong with the file, when it was not a well-formed request

    @classmethod
    def read(cls, path: Path) -> StopRequest | None:
        """The request in `path`, or None when there is none.

        Never raises for what the file holds: a request is a request, so a file that cannot be understood (not
        UTF-8, too large, a field of the wrong type, unreadable) asks any job to stop now, and `note` says why.
        """
        try:
            # The one safe opener: a link is not followed (its target's text would reach history.jsonl and
            # status, and travel in bundles), a pipe does not block the rank, a device is not read.
            fd, _ = open_regular(path, what="the stop request")
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return cls._anyway(path, "cannot be read (a folder, not a file)")
        except UnsafeInput:
            kind = "a symbolic link" if os.path.islink(path) else "not a regular file: a pipe or a device"
            return cls._anyway(path, f"is not read ({kind})")
        except OSError as exc:
            return cls._anyway(path, f"cannot be read ({exc.strerror or type(exc).__name__})")
        try:
            raw = b""
            while len(raw) <= REQUEST_MAX_BYTES and (chunk := os.read(fd, REQUEST_MAX_BYTES + 1 - len(raw))):
                raw += chunk
        except OSError as exc:
            return cls._anyway(path, f"cannot be read ({exc.strerror or type(exc).__name__})")
        finally:
            os.close(fd)
        if len(raw) > REQUEST_MAX_BYTES:
            return cls._anyway(path, f"is larger than {REQUEST_MAX_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return cls._anyway(path, f"is not UTF-8 text ({len(raw)} bytes)")
        try:
            data: Any = json.loads(text) if text.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            word = text.strip()
            if not JOB_ID.fullmatch(word):
                return cls._anyway(path, "holds neither JSON nor a job id")
            data = {"job": word}  # the G3A1 convention: the file holds just a job id
        if isinstance(data, int | str) and not isinstance(data, bool):
            data = {"job": str(data)}
        elif data is None:
            data = {}
        elif not isinstance(data, dict):
            return cls._anyway(path, f"holds a JSON {type(data).__name__}, not an object")
        problems: list[str] = []
        job = data.get("job")
        if job not in (None, "") and (isinstance(job, bool) or not JOB_ID.fullmatch(str(job))):
            problems.append(f"job {_short(job)} is not a job id")
            job = None
        at = data.get("at_update")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            problems.append(f"at_update {_short(at)} is not an update number")
            at = None
        when = data.get("time", 0.0)
        return cls(
            job=str(job) if job not in (None, "") else None,
            at_update=at,
            reason=_text(data.get("reason"), "user"),
            time=float(when) if isinstance(when, int | float) and math.isfinite(when) else 0.0,
            by=_text(data.get("by"), ""),
            note=f"{path}: {'; '.join(problems)}: stopping now, for any job" if problems else None,
        )

    @classmethod
    def _anyway(cls, path: Path, problem: str) -> StopRequest:
        return cls(
            None, None, "unreadable request", 0.0, "", f"{path} {problem}: treated as a request to stop now"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: Any, default: str) -> str:
    """A short printable string for a free-text field (its content came from anyone who can write the file)."""
    if not isinstance(value, str):
        return default
    return "".join(c if c.isprintable() else "?" for c in value[:200])


def write_request(
    run_dir: str | os.PathLike[str] | RunDir,
    job: str | None = None,
    at_update: int | None = None,
    reason: str = "user",
) -> Path:
    """Ask the run in `run_dir` to save and stop (at the next boundary, or after `at_update`)."""
    path = RunDir.of(run_dir).request_stop_path
    if path.is_dir() and not path.is_symlink():  # os.replace would name its temporary, not this
        raise PathError(
            f"{path} is a directory, not a stop request",
            hint=f"remove it (rmdir {path}, after checking what it holds) and ask again",
        )
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(slots=True)
class SignalFlag:
    """Installed in the main thread; the handler records which signal came, then calls the handler it replaced.

    A handler installed before (the user's, a logger's) keeps running. The default action of SIGTERM and SIGUSR1
    is to die, which is exactly what a clean stop replaces, so SIG_DFL, SIG_IGN and Python's KeyboardInterrupt
    handler are not called.
    """

    received: str | None = None
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self, signums: tuple[int, ...] = STOP_SIGNALS) -> None:
        for signum in signums:
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name
        before = self.previous.get(signum)
        if callable(before) and before is not signal.default_int_handler:
            before(signum, frame)

    def restore(self) -> None:
        """Put back the handlers found at install, unless someone replaced ours since (theirs stays)."""
        for signum, handler in self.previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()


def job_start(env: Mapping[str, str] | None = None) -> float:
    """When this job started, the origin of TORCHRELAY_BUDGET_S (unix seconds).

    Under torchrun it is the start of the agent that started this rank: the agent outlives the restarts of
    `--max-restarts`, so a restarted rank does not get a fresh budget. Otherwise it is this process's start, so
    the budget covers importing torch and opening the run too.
    """
    env = os.environ if env is None else env
    try:
        proc = psutil.Process()
        if env.get("TORCHELASTIC_RUN_ID"):
            proc = proc.parent() or proc
        return float(proc.create_time())
    except psutil.Error:
        return time.time()


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # unix seconds by which the process must have stopped with a complete checkpoint
    source: str  # which input set it, for the log and history.jsonl


def deadline_from_env(env: Mapping[str, str], start: float) -> Deadline | None:
    """The earliest of TORCHRELAY_DEADLINE (unix seconds), `start` + TORCHRELAY_BUDGET_S and Slurm's
    SLURM_JOB_END_TIME; each is fixed for the whole job, so a restart within the job keeps its deadline."""
    found: list[Deadline] = []
    for var in (envvars.DEADLINE, envvars.BUDGET_S):
        name, text = var.name, var.text(env)
        value = var.get(env)
        if value is None:
            continue
        if var is envvars.BUDGET_S and value < 0:
            raise ConfigError(
                f"{name}={text!r} is not a number of seconds",
                hint="TORCHRELAY_DEADLINE is unix seconds, TORCHRELAY_BUDGET_S seconds from the job's start",
            )
        if name == "TORCHRELAY_DEADLINE":
            found.append(Deadline(value, f"TORCHRELAY_DEADLINE={text}"))
        else:
            began = time.strftime("%H:%M:%S", time.localtime(start))
            found.append(
                Deadline(start + value, f"TORCHRELAY_BUDGET_S={text} from the job's start at {began}")
            )
    slurm_end = env.get("SLURM_JOB_END_TIME", "").strip()
    if slurm_end.isdigit() and int(slurm_end) > 0:  # newer Slurm sets it; a job without a limit has none
        found.append(Deadline(float(slurm_end), f"SLURM_JOB_END_TIME={slurm_end}"))
    return min(found, key=lambda d: d.at) if found else None
