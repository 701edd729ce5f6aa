"""The one exception hierarchy of torchrelay; each error knows its exit code and what to do next."""

from __future__ import annotations

import errno
import json
import os
import sys
from types import TracebackType
from typing import TextIO

# Exit codes of a training process and of the CLI (documented in README and docs/FORMATS.md).
EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_BUDGET = 3
EXIT_REQUEST = 4
EXIT_SIGNAL = 5
EXIT_MEMORY = 6


class RelayError(Exception):
    """Base class: a message that names the file, field or update, plus a hint saying what to do."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(RelayError):
    """A configuration value is missing, of the wrong type or out of range."""

    exit_code = EXIT_REFUSED


class ContractMismatch(RelayError):
    """The resumed run's contract differs from the recorded one."""

    exit_code = EXIT_REFUSED

    def __init__(
        self,
        path: str,
        differences: list[tuple[str, object, object]],
        *,
        detail: str = "",
        hint: str | None = None,
    ) -> None:
        lines = "\n".join(f"  {k}: {_short(a)} -> {_short(b)}" for k, a, b in differences)
        super().__init__(
            f"resume refused: the training contract in {path} differs in {len(differences)} field(s):\n{lines}"
            + (f"\n  ({detail})" if detail else ""),
            hint=hint
            or "resume with the recorded values, or start a new run directory; only runtime fields may change",
        )
        self.differences = differences


class NumericsChanged(RelayError):
    """strict_numerics: this launch would compute with another numerics identity than the earlier segments."""

    exit_code = EXIT_REFUSED


class IntegrityError(RelayError):
    """A file does not match its recorded size or SHA-256, or is missing or unexpected."""

    exit_code = EXIT_REFUSED


class StateMismatch(IntegrityError):
    """A checkpoint whose files match their inventory, yet whose state, once loaded, is not what its update trained
    (the parameters' per-update digest, records/digests.py)."""


class RecordError(IntegrityError):
    """A record on disk (JSON, a JSONL line, a safetensors header, a YAML plan) that is not what its reader
    expects: the message names the file, and the line and field where there is one (util/records.py)."""

    def __init__(
        self,
        source: str,
        problem: str,
        *,
        line: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = (
            source + (f", line {line}" if line is not None else "") + (f", field {field!r}" if field else "")
        )
        super().__init__(f"{where}: {problem}", hint=hint)
        self.source, self.line, self.field = source, line, field


class UnsafeInput(RelayError):
    """A path or payload that could escape its directory or execute code."""

    exit_code = EXIT_REFUSED


class ForkRefused(RelayError):
    """The checkpoint was handed off elsewhere; continuing here would fork the run."""

    exit_code = EXIT_REFUSED


class RunBusy(RelayError):
    """Another live process trains (or launches) this run directory."""

    exit_code = EXIT_REFUSED

    def __init__(self, run_dir: object, role: str, holder: dict[str, object], who: str) -> None:
        what = "a controller" if role == "launch" else "a writer"
        super().__init__(
            f"{run_dir} is in use by {what}: {who}; a second writer would fork the run",
            hint=f"wait for it to end, or stop it cleanly with `torchrelay stop {run_dir}`",
        )
        self.holder = holder


class PathError(RelayError):
    """A path given as input is missing, of the wrong kind (a file where a directory belongs) or unreadable."""

    exit_code = EXIT_REFUSED


class StoreError(RelayError):
    """An object store failed (unreachable, 5xx or throttling past the bounded retries, a body cut short)."""


class ParityError(RelayError):
    """An export does not compute what the training model computes (`export --parity`); no export is written."""

    exit_code = EXIT_REFUSED


class CheckpointError(RelayError):
    """No usable checkpoint, or a checkpoint that cannot be written or read."""

    exit_code = EXIT_ERROR


class DiskFull(CheckpointError):
    """Not enough free space to write a checkpoint; the previous complete one is untouched."""


# errno of an OSError that says the input path is wrong (refused, exit 2), with what to do about it.
_PATH_HINTS = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a regular file stands where a directory is expected: pass the directory",
    errno.EISDIR: "a directory stands where a file is expected: pass the file",
    errno.EACCES: "check the permissions of the path (and of the folders above it)",
    errno.EPERM: "check the permissions of the path (and of the folders above it)",
    errno.EEXIST: "choose a path that does not exist yet",
    errno.ELOOP: "a symbolic link loops: fix or remove it",
    errno.ENAMETOOLONG: "shorten the path",
    errno.EROFS: "the path lies on a read-only filesystem: choose a writable one",
}


def from_exception(exc: BaseException, what: str = "") -> RelayError:
    """Any exception as a RelayError with one message: an OSError on a wrong path is refused (exit 2) naming the
    path, a full disk is DiskFull, text that is not UTF-8 is an IntegrityError; anything else keeps exit 1."""
    if isinstance(exc, RelayError):
        return exc
    where = f"{what}: " if what else ""
    if isinstance(exc, OSError):
        path = exc.filename if exc.filename is not None else ""
        text = f"{where}{path}{': ' if path else ''}{exc.strerror or exc}"
        if exc.errno == errno.ENOSPC:
            return DiskFull(text, hint="free space on that filesystem and run it again")
        if exc.errno in _PATH_HINTS:
            return PathError(text, hint=_PATH_HINTS[exc.errno])
        return RelayError(text)
    if isinstance(exc, UnicodeDecodeError):
        return IntegrityError(
            f"{where}not UTF-8 text ({exc})", hint="the file is damaged or not what it should be"
        )
    if isinstance(exc, json.JSONDecodeError):
        return IntegrityError(
            f"{where}not valid JSON ({exc})", hint="the file is damaged or not what it should be"
        )
    return RelayError(f"{where}{type(exc).__name__}: {exc}")


def one_line(exc: BaseException) -> str:
    """`Type: first line of its message`: what one rank tells the others it raised (a collective carries it)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------- the uncaught error
# A training script does `with tr.Run.open(...) as run: ...` and `sys.exit(run.exit_code)`; a refusal raised by
# Run.open (or run.steps) escapes before that line. This hook turns it into one message on rank 0 and the error's
# exit code, instead of a traceback on every rank and exit 1. Anything that is not a RelayError goes to the hook
# that was installed before (a traceback: it is a bug, or the user's own error).
_previous_hook = None
# Until a Run opens in this process, a configuration error comes from the script's own configuration, which is
# the same on every rank: the first rank to meet it says it for all (`_first_to_say`). From Run.open on, a rank
# may fail alone and says so itself.
_before_run = True


def install_excepthook() -> None:
    """Make an uncaught RelayError print `torchrelay: <message>` (rank 0, or the rank it happened on) and exit with
    its code; idempotent, and chained to the hook installed before for every other exception."""
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook


def run_opening() -> None:
    """Run.open has started in this process: from here a rank's error may be its own (see _excepthook)."""
    global _before_run
    _before_run = False


def mark_shared(exc: RelayError) -> RelayError:
    """Every rank raises this error alike, before any of them talks to another: whichever rank's excepthook runs
    first prints it, the others stay quiet (a rank that left it to rank 0 exited first, and torchrun ended rank 0
    before it printed: no line in 4 launches of 5)."""
    exc.shared = True  # type: ignore[attr-defined]
    return exc


def mark_reported(exc: RelayError) -> RelayError:
    """The message is already out (rank 0 printed it, or this is rank 0's error carried to another rank)."""
    exc.reported = True  # type: ignore[attr-defined]
    return exc


def report(exc: RelayError, rank: int, stream: TextIO | None = None) -> None:
    """Print the error once, in the one format of an uncaught refusal."""
    if getattr(exc, "reported", False):
        return
    who = "torchrelay" if rank == 0 else f"torchrelay [rank {rank}]"
    print(f"{who}: {exc}", file=stream or sys.stderr, flush=True)
    mark_reported(exc)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    rank = _env_rank()
    if not isinstance(exc, RelayError) and not _before_run and _peer_gone(exc):
        exc = _lost_peers(exc, rank)
    if not isinstance(exc, RelayError):
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    if getattr(exc, "shared", False) or (_before_run and isinstance(exc, ConfigError)):
        if _first_to_say(rank):
            rank = 0  # said for every rank: no rank's name on it
        else:
            mark_reported(exc)  # another rank of this launch said it
    # The process's own stderr: torch.distributed's init_process_group wraps this hook and points sys.stderr at a
    # buffer while it runs (to prefix each line with the rank), which it writes out only after the hook returns.
    report(exc, rank, sys.__stderr__ or sys.stderr)
    code = int(getattr(exc, "exit_code", EXIT_ERROR))
    # After an uncaught exception the interpreter would exit 1 whatever the hook does; run the exit handlers
    # (logging, multiprocessing) ourselves, then leave with the documented code.
    import atexit

    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    atexit._run_exitfuncs()
    os._exit(code)


# What gloo and NCCL raise in a rank waiting in a collective of the training's own (DDP's gradient all-reduce) when
# a peer's process ended: the peer's own output says why, so this rank says so in one line, as the failure
# protocol's exchanges do (util/collective.py), instead of a traceback through the script.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


def _peer_gone(exc: BaseException) -> bool:
    text = str(exc)
    named = type(exc).__name__ in ("DistBackendError", "DistNetworkError")
    return isinstance(exc, RuntimeError) and (named or any(s in text for s in _PEER_GONE))


def _lost_peers(exc: BaseException, rank: int) -> RelayError:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = (lines[0] if lines else type(exc).__name__)[:300]
    return RelayError(
        f"training: rank {rank} lost its peers ({text})",
        hint="another rank ended: its output says why",
    )


def _first_to_say(rank: int) -> bool:
    """Whether this rank is the first of its launch on this host to say an error every rank meets alike: the one
    that creates a marker named after the launch (`_launch_key`) wins. Outside a launcher it knows, rank 0 says it
    for all, as before. Where no marker can be made, every rank says it (twice is better than never)."""
    key = _launch_key()
    if key is None:
        return rank == 0
    import tempfile
    from pathlib import Path

    from torchrelay.util.private_dir import private_folder

    shared = Path(tempfile.gettempdir())
    folder = shared / f"torchrelay-{os.getuid()}"
    try:
        if private_folder(folder, below=shared, make=True) is not None:
            return True  # another user's, a link, or writable by others: no marker there
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        os.close(os.open(folder / f"said-{key}", flags, 0o600))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def _launch_key() -> str | None:
    """A name for this launch shared by its ranks on this host: torchrun's agent (the parent of every local rank,
    with its start time, since a pid is used again) and restart, or Slurm's job step; None under no launcher."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.getppid()
        try:
            with open(f"/proc/{agent}/stat", "rb") as f:
                started = f.read().rsplit(b")", 1)[1].split()[19].decode()
        except (OSError, IndexError, UnicodeDecodeError):
            started = "0"
        return f"torchrun-{agent}-{started}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if job and step and "SLURM_PROCID" in os.environ:
        return f"slurm-{job}-{step}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return None


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0
