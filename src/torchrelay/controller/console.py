"""What a launch shows while its stages run (launcher.py): one method per thing said, on a rich `Console` its
caller may pass; the stages decide, this only words it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from torchrelay.paths.layout import checkpoint_name

if TYPE_CHECKING:
    from torchrelay.controller.attempts import Attempt, Outcome
    from torchrelay.controller.preflight import CheckResult
    from torchrelay.controller.smoke import SmokeResult
    from torchrelay.controller.validation import ValidationRecord
    from torchrelay.policy.costmodel import Measurements


class LaunchConsole:
    """The controller's console: the attempt, each stage as it starts and ends, the outcome."""

    def __init__(self, console: Console | None = None) -> None:
        # Logs (Slurm's output file) get wide tables; a terminal keeps its own width.
        width = None if sys.stderr.isatty() else 140
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True, width=width)

    # ------------------------------------------------------------------------------------- the attempt
    def attempt(
        self, name: str, number: int, path: Any, diff: list[tuple[str, Any, Any]], left_s: float | None
    ) -> None:
        left = f"{left_s:.0f}s left" if left_s is not None else "no deadline"
        self.console.rule(f"[bold]{name}[/]: attempt {number:02d} ({left})")
        self.console.print(f"attempt folder: {path}")
        if diff:
            table = Table(title="changes against the frozen plan", title_justify="left")
            for col in ("key", "frozen", "this attempt"):
                table.add_column(col)
            for key, old, new in diff:
                table.add_row(key, repr(old), repr(new))
            self.console.print(table)

    def fallback(self, description: str) -> None:
        self.console.print(f"[yellow]fallback[/]: {description}")

    def warning(self, note: str) -> None:
        self.console.print(f"[yellow]warning[/]: {note}")

    def time_unknown(self, job: str, exc: Exception) -> None:
        self.console.print(f"[yellow]time left of job {job} unknown[/]: {exc}")

    def check(self, result: CheckResult) -> None:
        """One preflight check, as it completes."""
        mark = (
            "[yellow]skip[/]"
            if result.skipped
            else "[yellow]warning[/]"
            if result.warning
            else "[green]ok[/]"
        )
        self.console.print(f"preflight {result.name}: {mark} {result.detail}", markup=True)

    def complete(self, total: int) -> None:
        self.console.print(f"the run is complete ({checkpoint_name(total)}): no smoke, no formal run")

    # ------------------------------------------------------------------------------------- smoke and formal run
    def smoke_skipped(self, why: str) -> None:
        self.console.print(f"smoke: skipped {why}")

    def smoke_start(self, updates: int, world_size: int, smoke_dir: Any) -> None:
        self.console.rule(f"smoke: {updates} updates on {world_size} rank(s) in {smoke_dir}")

    def smoke_done(self, measured: SmokeResult, m: Measurements) -> None:
        self.console.print(
            f"smoke: {measured.updates} updates, losses {', '.join(f'{x:.4f}' for x in measured.losses)}; "
            f"update {m.update_s:.3f}s, save {m.save_s:.3f}s, startup {m.startup_s:.1f}s, "
            f"checkpoint {m.checkpoint_bytes / 2**20:.1f} MiB"
        )

    def cost(self, why: str) -> None:
        self.console.print(f"[bold]cost model[/]: {why}")

    def formal_start(self, run_path: Any, world_size: int) -> None:
        self.console.rule(f"formal run: {run_path} ({world_size} rank(s))")

    # ------------------------------------------------------------------------------------- validation
    def validation_start(self, command: str) -> None:
        self.console.rule(f"validation: {command}")

    def validation(self, event: str, update: int, record: ValidationRecord | None) -> None:
        """One checkpoint's validation, as it starts and as it ends."""
        if event == "start":
            self.console.print(f"validating {checkpoint_name(update)} ...")
        elif record is not None:
            metrics = ", ".join(f"{k}={v}" for k, v in (record.metrics or {}).items())
            detail = metrics if record.status == "ok" else record.reason
            self.console.print(
                f"{checkpoint_name(update)}: {record.status} in {record.seconds:.1f}s: {detail}"
            )

    def validation_failed_to_run(self, exc: Exception) -> None:
        self.console.print(f"[red]validation could not run[/]: {exc}")

    def validation_missing(self, update: int, why: str) -> None:
        self.console.print(f"validation: {checkpoint_name(update)} not available: {why}")

    def validation_left(self, left: str, why: str) -> None:
        self.console.print(f"validation left for the next launch: {left} ({why})")

    # ------------------------------------------------------------------------------------- the outcome
    def outcome(self, attempt: Attempt, outcome: Outcome) -> None:
        table = Table(title=f"attempt {attempt.number:02d} outcome", title_justify="left", show_header=False)
        table.add_column("field")
        table.add_column("value")
        table.add_row("ended", outcome.ended)
        table.add_row("exit code", str(outcome.exit_code))
        table.add_row("stage reached", outcome.stage)
        table.add_row(
            "updates", f"{outcome.updates_before} -> {outcome.updates_after} (+{outcome.updates_done})"
        )
        if outcome.validation:
            v = outcome.validation
            table.add_row(
                "validation",
                f"ok {v['validated']}, failed {v['failed']}, before {v['done_before']}, left {sorted(v['left'])}",
            )
        for note in outcome.notes:
            table.add_row("note", note)
        self.console.print(table)
        if outcome.message:
            self.console.print(outcome.message, markup=False)
