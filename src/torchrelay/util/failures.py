"""A rank's failure as it travels to its peers (small, picklable, whatever the exception was) and the one error every
rank raises for the failures of a phase: the records of the failure protocol (util/collective.py, docs/FAILURES.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchrelay import errors as errors_module
from torchrelay.errors import EXIT_ERROR, RelayError, from_exception

_MAX_MESSAGE = 4000


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's failure as it travels to the others: small, picklable, whatever the exception was."""

    rank: int
    cls: str  # the RelayError subclass it is raised as
    message: str  # the error's message: it names the file, field or update
    hint: str | None
    exit_code: int
    bug: (
        str | None
    )  # the exception's type when it is not one of the library's own (its traceback stays there)
    # A deferred failure's own phase: it names the error whichever exchange carries it.
    phase: str | None = None

    @classmethod
    def of(cls, exc: BaseException, rank: int, name: str) -> Failure:
        """`exc` raised on `rank` during phase `name` (DCP's exception names the rank it happened on)."""
        rank, exc = unwrap(exc, rank)
        if isinstance(exc, RelayError) or is_plain(exc):
            err = from_exception(exc, name)
            return cls(rank, type(err).__name__, err.message[:_MAX_MESSAGE], err.hint, err.exit_code, None)
        text = str(exc).strip()
        first = text.splitlines()[0][:500] if text else ""
        return cls(rank, "RelayError", f"{type(exc).__name__}: {first}", None, EXIT_ERROR, type(exc).__name__)


def unwrap(exc: BaseException, rank: int = 0) -> tuple[int, BaseException]:
    """DCP's CheckpointException carries each rank's own exception: (its rank, the first of the library's own
    if any, else the first); any other exception as it is."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        inner = [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(failures.items())]
        for r, candidate in inner:
            if isinstance(candidate, RelayError) or is_plain(candidate):
                return int(r), candidate
        if isinstance(inner[0][1], BaseException):
            return int(inner[0][0]), inner[0][1]
    return rank, exc


def is_plain(exc: BaseException) -> bool:
    """An error one message explains: a path, a full disk, a file that is not text (see errors.from_exception)."""
    return isinstance(exc, (OSError, UnicodeDecodeError))


def agreed_error(name: str, failures: Sequence[Failure], *, name_rank: bool = True) -> RelayError:
    """The error every rank raises when `failures` (in rank order) happened in phase `name`."""
    first = failures[0]
    if first.phase is not None:
        name, name_rank = first.phase, True
    cls_ = getattr(errors_module, first.cls, RelayError)
    if not (isinstance(cls_, type) and issubclass(cls_, RelayError)):
        cls_ = RelayError
    inner = first.message.removeprefix(f"{name}: ")
    hint = first.hint
    if first.bug is not None:
        message = f"{name} failed on rank {first.rank} with {inner}"
        hint = hint or f"rank {first.rank}'s output holds the traceback"
    elif name_rank or first.rank != 0:
        message = f"{name} failed on rank {first.rank}: {inner}"
    else:
        message = first.message
    others = sorted({f.rank for f in failures[1:]} - {first.rank})
    if others:
        shown = ", ".join(map(str, others[:8])) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        message += f" (rank{'s' if len(others) > 1 else ''} {shown} failed too)"
    err = cls_.__new__(cls_)
    RelayError.__init__(err, message, hint)
    err.exit_code = first.exit_code
    return err


def mark_agreed(err: BaseException) -> BaseException:
    err.agreed = True  # type: ignore[attr-defined]
    return err


def is_agreed(exc: BaseException) -> bool:
    """Whether every rank raises `exc` already (an exchange of the protocol raised it)."""
    return bool(getattr(exc, "agreed", False))
