"""The one exception hierarchy of torchrelay; each error knows its exit code and what to do next."""

from __future__ import annotations

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

    def __init__(self, path: str, differences: list[tuple[str, object, object]]) -> None:
        lines = "\n".join(f"  {k}: {_short(a)} -> {_short(b)}" for k, a, b in differences)
        super().__init__(
            f"resume refused: the training contract in {path} differs in {len(differences)} field(s):\n{lines}",
            hint="resume with the recorded values, or start a new run directory; only runtime fields may change",
        )
        self.differences = differences


class IntegrityError(RelayError):
    """A file does not match its recorded size or SHA-256, or is missing or unexpected."""

    exit_code = EXIT_REFUSED


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


class CheckpointError(RelayError):
    """No usable checkpoint, or a checkpoint that cannot be written or read."""

    exit_code = EXIT_ERROR


class DiskFull(CheckpointError):
    """Not enough free space to write a checkpoint; the previous complete one is untouched."""


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
